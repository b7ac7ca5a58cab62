"""GRPO + IcePop: RL = Trainer + Engine + Buffer.

The policy trains on the one Trainer (its optimizer builder, schedule, data-parallel wrapper,
checkpointer) with RL's step plug-in (orthon.rl.steps.PolicyStep); rollouts come from an Engine (the
in-process one by default; anything that speaks the Engine protocol), through the rollout plug-in named
by ``rl.rollout``; the Data Buffer groups the samples of each prompt. One iteration: roll out until
enough groups are ready, compute GRPO advantages per group, take ``updates_per_iteration`` optimizer
steps, hand the new weights to the engine. This loop is synchronous; the asynchronous one runs the same
parts on different actors.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from orthon.core.metrics import MetricsLogger, plot_curves, read_metrics
from orthon.engine.in_process import InProcessEngine
from orthon.engine.sampling import SamplingParams
from orthon.core.plugins import resolve
from orthon.pretrain.trainer import Trainer
from orthon.pretrain.weights import load_weights, save_weights
from orthon.rl.buffer import DataBuffer
from orthon.rl.loss import grpo_advantages
from orthon.rl.rewards.registry import SafeReward
from orthon.rl.rollout import RolloutContext
from orthon.rl.sample import Sample, SampleStatus
from orthon.rl.steps import METRICS, PolicyStep


class RLTrainer:
    def __init__(self, recipe, tokenizer, log=print, engine=None):
        """``recipe``: an RLRecipe whose ``train.init_from`` names the policy's starting weights."""
        self.recipe, self.cfg, self.log = recipe, recipe.rl, log
        self.run_dir = Path(recipe.train.run_dir)
        self.tokenizer = tokenizer
        policy = recipe.train.init_from
        reference = None
        if self.cfg.loss.kl_coef > 0:
            reference = load_weights(policy).eval().requires_grad_(False)
        self.trainer = Trainer(recipe, self.run_dir, log, step=PolicyStep(self.cfg.loss, reference), with_data=False)
        self.model = self.trainer.model
        if reference is not None:
            reference.to(self.trainer.device)
        self.engine = engine or InProcessEngine(load_weights(policy, device=self.trainer.device), self.cfg.engine)
        seed = recipe.train.seed
        self.task = resolve(self.cfg.task, "rl.task")(tokenizer, seed=seed, **self.cfg.task_args)
        self.reward = SafeReward.from_config(self.cfg.reward) if self.cfg.reward else SafeReward(self.task.reward_fn)
        self.rollout_fn = resolve(self.cfg.rollout, "rl.rollout")
        self.buffer = DataBuffer(self.cfg.buffer.num_repeat_per_sample, self.task.task_type)
        self.eval_prompts = self.task.eval_set()
        self.iteration = 0

    @property
    def optimizer(self):
        return self.trainer.optimizer

    # ------------------------------------------------------------ parts
    def sampling(self, greedy: bool = False, seed: int | None = None) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.cfg.max_new_tokens, temperature=0.0 if greedy else self.cfg.temperature,
                              top_p=1.0 if greedy else self.cfg.top_p, stop_token_ids=self.task.stop_token_ids,
                              seed=seed)

    def rollout(self) -> dict:
        """Generate G samples for each new prompt through the rollout plug-in, fill the buffer."""
        G = self.cfg.buffer.num_repeat_per_sample
        prompts = self.task.sample(self.cfg.prompts_per_iteration)
        seed = self.recipe.train.seed * 1_000_003 + self.iteration * len(prompts) * G
        ctx = RolloutContext(self.engine, self.tokenizer, self.reward, self.sampling(seed=seed), G)
        samples = self.rollout_fn(ctx, prompts)
        for sample in samples:
            self.buffer.add(sample)
        return {"rollout_failed": sum(1 for s in samples if s.status is SampleStatus.FAILED)}

    def collect_groups(self) -> tuple[list[list[Sample]], dict]:
        """The iteration's ready groups and rollout statistics over everything sampled. With
        ``drop_zero_std_groups`` only informative groups (rewards not all equal) are kept, and up to
        ``max_sampling_rounds`` rollout rounds refill them to ``prompts_per_iteration`` (DAPO's dynamic
        sampling); informative groups beyond that are dropped."""
        cfg = self.cfg
        kept, rewards, lengths, failed, rounds = [], [], [], 0, 0
        while rounds < cfg.max_sampling_rounds and (not rounds or len(kept) < cfg.prompts_per_iteration):
            failed += self.rollout()["rollout_failed"]
            rounds += 1
            for group in self.buffer.take_ready():
                r = [s.reward for s in group]
                rewards.append(r)
                lengths += [s.response_length for s in group]
                if not cfg.drop_zero_std_groups or min(r) != max(r):
                    kept.append(group)
        extra = max(0, len(kept) - cfg.prompts_per_iteration) if cfg.drop_zero_std_groups else 0
        rewards_t = torch.tensor(rewards, dtype=torch.float32)
        stats = {"rollout_failed": failed, "reward_mean": rewards_t.mean().item(),
                 "groups_all_equal": float((rewards_t.std(-1) == 0).float().mean()),
                 "response_length": sum(lengths) / max(len(lengths), 1)}
        if cfg.drop_zero_std_groups:
            stats.update(sampling_rounds=rounds, groups_kept=len(kept) - extra, groups_extra_dropped=extra)
        return kept[: len(kept) - extra], stats

    def train_on(self, groups: list[list[Sample]]) -> dict:
        """The iteration's optimizer steps on its groups: GRPO advantages per group, then
        ``updates_per_iteration`` Trainer steps on equal shares of the groups (slime's steps per
        rollout). The first step runs on the weights that generated the samples, so its log-prob
        mismatch is the rollout/trainer one (``logp_mismatch_max``); later steps are off-policy by
        design, which IcePop's ratio and the asymmetric clip account for. No groups: no step."""
        if not groups:
            return {}
        rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)
        advantages = grpo_advantages(rewards, unbiased=self.cfg.loss.advantage_std == "unbiased")
        share = math.ceil(len(groups) / self.cfg.updates_per_iteration)
        stats, sums, tokens = {}, {}, 0.0
        for k, start in enumerate(range(0, len(groups), share)):
            batch = [(s, float(a)) for g, adv in zip(groups[start : start + share], advantages[start : start + share])
                     for s, a in zip(g, adv)]
            trained = sum(s.response_length for s, _ in batch)
            metrics = self.trainer.train_step(batch, tokens=trained)
            if k == 0:
                stats["logp_mismatch_max"] = metrics["logp_mismatch_max"]
                stats["lr"] = metrics["lr"]
            n = metrics["trained_tokens"]
            for key in METRICS:
                if key in metrics:
                    sums[key] = sums.get(key, 0.0) + metrics[key] * n
            tokens += n
        stats.update({k: v / max(tokens, 1.0) for k, v in sums.items()})
        return stats

    def sync_weights(self) -> None:
        """Hand the new weights to the engine (copied in place; the engine bumps its weight version)."""
        self.engine.update_weights(self.model.state_dict())

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out rewards: the mean over eval_samples sampled answers per prompt (a fixed seed, so every
        evaluation draws the same uniforms) and the greedy answer's."""
        n = self.cfg.eval_samples
        prompts = [p for p in self.eval_prompts for _ in range(n)]
        sampled = self.engine.generate([p.ids for p in prompts], self.sampling(seed=self.recipe.train.seed + 7_919))
        greedy = self.engine.generate([p.ids for p in self.eval_prompts], self.sampling(greedy=True))

        def mean_reward(prompts, results):
            return sum(self.reward(self.tokenizer.decode(r.tokens), p.label) for p, r in zip(prompts, results)) / len(results)

        return {"eval_reward": mean_reward(prompts, sampled), "eval_greedy": mean_reward(self.eval_prompts, greedy)}

    # ------------------------------------------------------------ state
    def save_checkpoint(self) -> None:
        self.trainer.save_checkpoint({"iteration": self.iteration, "task": self.task.state_dict(),
                                      "weight_version": self.engine.weight_version,
                                      "buffer": self.buffer.state_dict(), "reward_stats": self.reward.stats.as_dict()})

    def resume(self) -> bool:
        state = self.trainer.resume()
        if state is None:
            return False
        self.iteration = state["iteration"]
        self.task.load_state_dict(state["task"])
        self.buffer.load_state_dict(state["buffer"])
        self.reward.stats.load(state["reward_stats"])
        self.sync_weights()
        self.engine.weight_version = state["weight_version"]
        self.log(f"resumed RL at iteration {self.iteration}")
        return True

    # ------------------------------------------------------------ the loop
    def fit(self) -> dict:
        cfg = self.cfg
        resumed = self.iteration or None
        metrics = MetricsLogger(self.run_dir, resume_step=resumed)
        if not resumed:
            start = self.evaluate()
            metrics.log(0, **start)
            self.log(f"iteration 0: held-out reward {start['eval_reward']:.3f} (greedy {start['eval_greedy']:.3f})")
        bar = None
        if self.recipe.train.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.iterations, initial=self.iteration, desc="rl", unit="it")
        while self.iteration < cfg.iterations:
            start = time.perf_counter()
            groups, stats = self.collect_groups()
            stats.update(self.train_on(groups))
            self.sync_weights()
            self.iteration += 1
            stats["policy_version"] = self.engine.weight_version
            stats.update({f"buffer_{k}": v for k, v in self.buffer.counters().as_dict().items()})
            stats.update({f"reward_{k}": v for k, v in self.reward.stats.as_dict().items()
                          if isinstance(v, (int, float))})
            if cfg.eval_interval and self.iteration % cfg.eval_interval == 0 or self.iteration == cfg.iterations:
                stats.update(self.evaluate())
            stats["iteration_time_s"] = time.perf_counter() - start
            metrics.log(self.iteration, **stats)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{stats['reward_mean']:.2f}", eval=stats.get("eval_reward", ""))
            interval = self.recipe.train.checkpoint_interval
            if interval and self.iteration % interval == 0:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        if not self.trainer.checkpointer.has(self.trainer.step):
            self.save_checkpoint()
        metrics.close()
        save_weights(self.model, self.run_dir / "final")
        records = read_metrics(self.run_dir / "metrics.jsonl")
        plot_curves(records, ["reward_mean", "eval_reward", "eval_greedy"], self.run_dir / "reward.png",
                    title="GRPO + IcePop: mean reward (train samples; held-out sampled and greedy)")
        evals = [r["eval_reward"] for r in records if "eval_reward" in r]
        greedy = [r["eval_greedy"] for r in records if "eval_greedy" in r]
        return {"iterations": self.iteration, "eval_start": evals[0] if evals else math.nan,
                "eval_end": evals[-1] if evals else math.nan, "eval_best": max(evals) if evals else math.nan,
                "greedy_start": greedy[0] if greedy else math.nan, "greedy_end": greedy[-1] if greedy else math.nan}
