"""The synchronous GRPO + IcePop loop, built from separable parts: the rollout engine (its own copy of
the model), the Data Buffer, the trainer step (recompute log-probs, IcePop loss, optimizer step) and
the weight hand-over (copy into the engine's parameters in place). The asynchronous version runs the
same parts on different threads / actors.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

from orthon.core.plugins import resolve
from orthon.pretrain.checkpoint import Checkpointer
from orthon.core.metrics import MetricsLogger, plot_curves, read_metrics
from orthon.pretrain.weights import load_weights, save_weights
from orthon.rl.buffer import DataBuffer
from orthon.rl.engine import InProcessEngine
from orthon.rl.logprobs import sample_log_probs
from orthon.rl.loss import aggregate_loss, grpo_advantages, icepop_token_loss
from orthon.rl.rewards.registry import SafeReward
from orthon.rl.sample import Sample, SampleStatus
from orthon.rl.sampling import SamplingParams
from orthon.rl.train_config import RLConfig


def rl_lr(iteration: int, cfg: RLConfig) -> float:
    """The LR of 0-based ``iteration``: linear warmup over ``lr_warmup_iterations`` (reaching ``lr`` at the
    last warmup iteration), then cosine decay to ``lr * lr_min_ratio`` at the last iteration."""
    warmup = cfg.lr_warmup_iterations
    if iteration < warmup:
        return cfg.lr * (iteration + 1) / warmup
    span = cfg.iterations - 1 - max(warmup - 1, 0)
    progress = min(1.0, (iteration - max(warmup - 1, 0)) / span) if span > 0 else 1.0
    floor = cfg.lr * cfg.lr_min_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class RLTrainer:
    def __init__(self, cfg: RLConfig, policy_dir: Path, tokenizer, run_dir: Path, log=print):
        self.cfg, self.run_dir, self.log = cfg, Path(run_dir), log
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.tokenizer = tokenizer
        self.model = load_weights(policy_dir).train()
        self.model.set_indexers_trainable(False)  # the policy loss never reaches the DSA indexers
        self.engine = InProcessEngine(load_weights(policy_dir), cfg.engine)
        self.task = resolve(cfg.task, "rl.task")(tokenizer, seed=cfg.seed, **cfg.task_args)
        self.reward = SafeReward.from_config(cfg.reward) if cfg.reward else SafeReward(self.task.reward_fn)
        self.buffer = DataBuffer(cfg.buffer.num_repeat_per_sample, self.task.task_type)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=(0.9, 0.95))
        self.checkpointer = Checkpointer(self.run_dir, cfg.keep_last, log=log)
        self.eval_prompts = self.task.eval_set()
        self.iteration = 0

    # ------------------------------------------------------------ parts
    def sampling(self, greedy: bool = False, seed: int | None = None) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.cfg.max_new_tokens, temperature=0.0 if greedy else self.cfg.temperature,
                              top_p=1.0 if greedy else self.cfg.top_p, stop_token_ids=self.task.stop_token_ids,
                              seed=seed)

    def rollout(self) -> dict:
        """Generate G samples for each new prompt, score them, fill the buffer."""
        G = self.cfg.buffer.num_repeat_per_sample
        prompts = self.task.sample(self.cfg.prompts_per_iteration)
        requests = [p for p in prompts for _ in range(G)]
        seed = self.cfg.seed * 1_000_003 + self.iteration * len(requests)
        results = self.engine.generate([p.ids for p in requests], self.sampling(seed=seed))
        failed = 0
        for prompt, result in zip(requests, results):
            if result.status == SampleStatus.FAILED:
                failed += 1
                reward = 0.0
            else:
                reward = self.reward(self.tokenizer.decode(result.tokens), prompt.label)
            sample = Sample(instance_id=prompt.instance_id, tokens=prompt.ids + result.tokens,
                            response_length=len(result.tokens), loss_mask=[1] * len(result.tokens),
                            rollout_log_probs=result.log_probs, reward=reward, policy_version=result.policy_version,
                            status=result.status, metadata={"label": prompt.label})
            self.buffer.add(sample)
        return {"rollout_failed": failed}

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
        ``updates_per_iteration`` steps on equal shares of the groups (slime's steps per rollout). The
        first step runs on the weights that generated the samples, so its log-prob mismatch is the
        rollout/trainer one (``logp_mismatch_max``); later steps are off-policy by design, which
        IcePop's ratio and the asymmetric clip account for. No groups: no step."""
        if not groups:
            return {}
        cfg = self.cfg.loss
        rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)
        advantages = grpo_advantages(rewards, unbiased=cfg.advantage_std == "unbiased")
        share = math.ceil(len(groups) / self.cfg.updates_per_iteration)
        stats, sums, tokens = {}, {}, 0
        for k, start in enumerate(range(0, len(groups), share)):
            part = [s for g in groups[start : start + share] for s in g]
            step_sums, step_tokens, mismatch = self._update(part, advantages[start : start + share].reshape(-1))
            if k == 0:
                stats["logp_mismatch_max"] = mismatch
            for key, value in step_sums.items():
                sums[key] = sums.get(key, 0.0) + value
            tokens += step_tokens
        stats.update({k: v / max(tokens, 1) for k, v in sums.items()})
        return stats

    def _update(self, samples: list[Sample], advantages: torch.Tensor) -> tuple[dict, int, float]:
        """One optimizer step: recomputed log-probs, IcePop loss, micro-batched backward. Returns the
        token-weighted metric sums, the token count and the largest |logp_train - logp_rollout|."""
        cfg = self.cfg.loss
        trainable = [i for i, s in enumerate(samples) if s.response_length > 0]
        total_tokens = sum(samples[i].response_length for i in trainable)
        sums, mismatch_max = {}, 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(trainable), self.cfg.micro_batch_size):
            batch = [samples[i] for i in trainable[start : start + self.cfg.micro_batch_size]]
            adv = advantages[trainable[start : start + self.cfg.micro_batch_size]]
            out = sample_log_probs(self.model, batch, with_entropy=True)
            R = out.mask.shape[1]
            rollout = torch.zeros(len(batch), R)
            for b, s in enumerate(batch):
                rollout[b, : s.response_length] = s.rollout_log_probs
            token_loss, metrics = icepop_token_loss(
                out.log_probs, rollout, adv, out.mask.float(), beta=cfg.icepop_beta, eps_low=cfg.eps_low,
                eps_high=cfg.eps_high, keep_weight=cfg.keep_weight, kl_coef=cfg.kl_coef, entropy=out.entropy)
            # Normalised by the step's global count, so micro-batching does not change the gradient.
            denominator = total_tokens if cfg.aggregation == "token" else len(trainable)
            aggregate_loss(token_loss, out.mask.float(), cfg.aggregation, denominator=denominator).backward()
            n = int(out.mask.sum())
            for key in ("masked_fraction", "logp_abs_diff", "clip_fraction", "entropy"):
                sums[key] = sums.get(key, 0.0) + float(metrics[key]) * n
            mismatch_max = max(mismatch_max, float(((out.log_probs.detach() - rollout).abs() * out.mask).max()))
        self.optimizer.step()
        return sums, total_tokens, mismatch_max

    def sync_weights(self) -> None:
        """Hand the new weights to the engine (copied in place; the engine bumps its policy version)."""
        self.engine.update_weights(self.model.state_dict())

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out rewards: the mean over eval_samples sampled answers per prompt (a fixed seed, so every
        evaluation draws the same uniforms) and the greedy answer's."""
        n = self.cfg.eval_samples
        prompts = [p for p in self.eval_prompts for _ in range(n)]
        sampled = self.engine.generate([p.ids for p in prompts], self.sampling(seed=self.cfg.seed + 7_919))
        greedy = self.engine.generate([p.ids for p in self.eval_prompts], self.sampling(greedy=True))

        def mean_reward(prompts, results):
            return sum(self.reward(self.tokenizer.decode(r.tokens), p.label) for p, r in zip(prompts, results)) / len(results)

        return {"eval_reward": mean_reward(prompts, sampled), "eval_greedy": mean_reward(self.eval_prompts, greedy)}

    def set_lr(self) -> float:
        lr = rl_lr(self.iteration, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    # ------------------------------------------------------------ state
    def save_checkpoint(self) -> None:
        state = {"step": self.iteration, "task": self.task.state_dict(), "torch_rng": torch.get_rng_state().tolist(),
                 "policy_version": self.engine.policy_version}
        self.checkpointer.save(self.iteration, self.model, [self.optimizer], state)

    def resume(self) -> bool:
        path = self.checkpointer.latest_good()
        if path is None:
            return False
        state = self.checkpointer.load(path, self.model, [self.optimizer])
        self.iteration = state["step"]
        self.task.load_state_dict(state["task"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        self.sync_weights()
        self.engine.policy_version = state["policy_version"]
        self.log(f"resumed RL from {path} at iteration {self.iteration}")
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
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.iterations, initial=self.iteration, desc="rl", unit="it")
        while self.iteration < cfg.iterations:
            start = time.perf_counter()
            lr = self.set_lr()
            groups, stats = self.collect_groups()
            stats.update(lr=lr, **self.train_on(groups))
            self.sync_weights()
            self.iteration += 1
            stats["policy_version"] = self.engine.policy_version
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
            if cfg.checkpoint_interval and self.iteration % cfg.checkpoint_interval == 0:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        if not self.checkpointer.has(self.iteration):
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
