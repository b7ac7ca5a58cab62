"""GRPO + IcePop: RL = Trainer + Engine + Buffer.

The policy trains on the one Trainer (its optimizer builder, schedule, data-parallel wrapper,
checkpointer) with RL's step plug-in (orthon.rl.steps.PolicyStep); rollouts, in either ``rl.mode``,
come from the RolloutManager (orthon.rl.rollout_manager). One iteration: take the iteration's ready
groups, compute GRPO advantages per group, take ``updates_per_iteration`` optimizer steps, hand the new
weights to the engines under the next weight version. On a Ray cluster the same loop runs with the
rollout manager, the engines and the trainer in different processes (orthon.rl.cluster).

Under torchrun, or as several trainer ranks on Ray (data parallelism: DDP, or FSDP2 by
``train.parallel``; expert parallelism by ``train.expert_parallel``) rank 0's rollout manager draws the
prompts and collects each iteration's groups, hands them to every rank, and every rank trains its share
of them (the policy step's DP schedule). With DDP alone in the synchronous mode every rank holds an
engine and generates a share of each round (orthon.rl.rank_rollouts); otherwise rank 0's engines
generate alone, and where the ranks hold shards (FSDP2, expert parallelism, another backend's model
parallelism) no process holds the whole model to hand it over: the engines take it a part at a time as
the ranks gather it, or as each rank's delta of what it holds (orthon.rl.weight_sync); it is gathered
whole, on rank 0 only, for an in-process engine and the shared path.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from orthon.core import distributed
from orthon.core.device_stats import throughput_metrics
from orthon.core.errors import DataError
from orthon.core.files import atomic_write_text
from orthon.core.interrupts import stop_signals_recorded
from orthon.core.metrics import MetricsLogger, moving_average, plot_curves, read_metrics
from orthon.core.net import service_host
from orthon.core.step_loop import stop_if_signalled
from orthon.engine.client import HTTPEngine
from orthon.engine.in_process import InProcessEngine
from orthon.pretrain.trainer import Trainer, other_fields
from orthon.pretrain.weights import load_weights
from orthon.rl.logprobs import sample_log_probs
from orthon.rl.loss import grpo_advantages
from orthon.rl.rank_rollouts import RankRollouts
from orthon.rl.rollout_manager import RolloutManager, rollout_state
from orthon.rl.sample import Sample, branches, sample_to_dict
from orthon.rl.steps import METRICS, PolicyStep
from orthon.rl.shard_delta import PartDelta, ShardDelta
from orthon.rl.stage_sync import StageSender, run_stages
from orthon.rl.weight_sync import IncompleteSync, ShardDeltas, StageParts, SyncForm, WeightParts


class RLTrainer:
    def __init__(self, recipe, tokenizer, log=print, engine=None, rollout=None, weight_sync=None,
                 sync_form=None):
        """``recipe``: an RLRecipe whose ``train.init_from`` names the policy's starting weights.
        ``engine``: the Engine rollouts and evaluation run on (default: an in-process one on a copy of
        the policy). ``rollout``: the RolloutManager (default: one on ``engine``), or a proxy of one in
        another process with the same methods (on rank 0; the other ranks follow rank 0's). ``weight_sync(
        weights, version)``: hands the new weights, the model or (where the ranks hold shards: FSDP2,
        expert parallelism) the state dict gathered from them, to the engines (default: ``engine.update_weights(state_dict, version)``).
        ``sync_form(version)`` (on rank 0): what ranks that hold shards hand over instead of the gathered
        state dict (orthon.rl.weight_sync.SyncForm: a directory they write, or parts they stream), or
        None."""
        self.recipe, self.cfg, self.log = recipe, recipe.rl, log
        self.last_stats: dict = {}  # the latest iteration's statistics
        self.held_out: float | None = None  # the latest held-out reward (evaluations are every eval_interval)
        self.run_dir = Path(recipe.train.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        policy = recipe.train.init_from
        step = PolicyStep(self.cfg.loss, opd=self.cfg.opd, dp_schedule=self.cfg.dp_schedule)
        self.trainer = Trainer(recipe, self.run_dir, log, step=step, with_data=False)
        self.model, self.rank, self.log = self.trainer.model, self.trainer.rank, self.trainer.log
        # The frozen models the loss reads: the KL reference (the policy's start) and OPD form 1's teachers.
        if self.cfg.loss.kl_coef > 0:
            step.reference = self._frozen("KL reference", policy)
        if self.cfg.opd is not None and self.cfg.opd.form == "kl_penalty":
            step.teachers = {t.name: self._frozen(f"teacher {t.name}", t.weights, in_loss=True) for t in self.cfg.opd.teachers}
        own_engines = engine is None and rollout is None
        # Every rank generates a share of each synchronous round where each holds the whole model; else
        # rank 0 alone (see the module docstring).
        shared = self.trainer.world > 1 and not self.trainer.holds_shards and self.cfg.mode == "sync" and own_engines
        # Synchronous rollouts on engines of our own sample with the weights the trainer holds at the next
        # update, so the engine's "rescore" (one more forward through the trainer's scoring) is the trainer's
        # own forward: the engine keeps its sampling log-probs and train_on replaces them (see there).
        rescores = (own_engines and self.cfg.mode == "sync" and self.cfg.debug == "none"
                    and self.cfg.engine.logprobs == "rescore")
        # Rank 0's choices on every rank: on Ray only rank 0 is handed the rollout manager.
        shared, self.trainer_rescores = self._from_rank_zero(lambda: (shared, rescores))
        if self.rank != 0 and not shared:
            engine = rollout = None
        elif rollout is None:
            engine_cfg = replace(self.cfg.engine, logprobs="decode") if self.trainer_rescores else self.cfg.engine
            engine = engine or InProcessEngine(load_weights(policy, device=self.trainer.device), engine_cfg,
                                               tokenizer)
            rollout = RolloutManager(self.cfg, tokenizer, engine, recipe.train.seed, log=self.log)
        self.engine, self.rollout = engine, rollout
        self.shared_rollouts = RankRollouts(rollout, self.rank, self.trainer.world) if shared else None
        if shared and self.rank == 0:
            rollout.roll_round = self.shared_rollouts.roll
        self.weight_sync = weight_sync or self._update_engine
        self.sync_form = sync_form
        self._deltas: ShardDelta | PartDelta | None = None  # this rank's, where the ranks hold shards and sync by delta
        self._stage_sender: StageSender | None = None  # a pipeline stage's leader's group with the engines
        self.weight_version = 0  # of the weights the engines hold; every sync adds one
        self.iteration = 0

    @property
    def optimizer(self):
        return self.trainer.optimizer

    @property
    def buffer(self):
        return self.rollout.buffer

    # ------------------------------------------------------------ parts
    def collect_groups(self) -> tuple[list[list[Sample]], dict]:
        """The iteration's groups (see RolloutManager.collect_groups), on every rank."""
        def collect():
            return self.rollout.collect_groups(self.weight_version, timeout=self.cfg.collect_timeout_s)

        if self.shared_rollouts is None:
            return self._from_rank_zero(collect)
        if self.rank != 0:
            self.shared_rollouts.serve()  # rank 0's rounds, until it has the iteration's groups
            return distributed.broadcast_object(None)
        try:
            result = collect()
        finally:
            self.shared_rollouts.stop()
        return distributed.broadcast_object(result)

    def _frozen(self, what: str, weights, in_loss: bool = False) -> torch.nn.Module:
        """A frozen model of ``weights``: placed as the policy where it has the policy's architecture (sharded
        where the policy is: no rank loads it whole), else whole in each process (shared by the runs of one).
        ``in_loss``: its forward runs inside the policy's loss (OPD's teachers), which under another backend's
        pipeline runs on the last stage alone: there it is orthon's model, whole in each process."""
        from orthon.rl.distill import teacher_model

        if other_fields(weights, self.recipe.model):
            model, where = teacher_model(weights).to(self.trainer.device), "whole (another architecture)"
        elif in_loss and self.trainer.foreign_model:
            model, where = teacher_model(weights).to(self.trainer.device), "whole (orthon's model, in the loss)"
        else:
            model, where = self.trainer.frozen_copy(weights), "placed as the policy" + (
                ": sharded" if self.trainer.holds_shards else "")
        self.log(f"{what}: {weights}, {where}")
        return model

    def _from_rank_zero(self, fn):
        """``fn()``'s result as rank 0 computes it, on every rank (rank 0 alone runs ``fn``)."""
        return distributed.broadcast_object(fn() if self.rank == 0 else None)

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
        batches = [[(b, float(a)) for g, adv in zip(groups[start : start + share], advantages[start : start + share])
                    for s, a in zip(g, adv) for b in branches(s)] for start in range(0, len(groups), share)]
        if self.trainer_rescores:
            # Rescored by the trainer on the weights that sampled them (nothing has updated them since):
            # the first update's samples by its own forward (PolicyStep.rescore_in_forward), the later
            # updates' now, before the first changes the weights. Groups the iteration dropped are never
            # scored, where the engine's rescore scored every sample it generated.
            self._rescore([s for batch in batches[1:] for s, _ in batch])
        stats, sums, tokens, flops, seconds = {}, {}, 0.0, 0.0, 0.0
        for k, batch in enumerate(batches):
            trained = sum(s.response_length for s, _ in batch)
            self.trainer.step_fn.rescore_in_forward = self.trainer_rescores and k == 0
            try:
                metrics = self.trainer.train_step(batch, tokens=trained)
            finally:
                self.trainer.step_fn.rescore_in_forward = False
            if k == 0:
                stats["logp_mismatch_max"] = metrics["logp_mismatch_max"]
                stats["lr"] = metrics["lr"]
            n = metrics["trained_tokens"]
            for key in METRICS:
                if key in metrics:
                    sums[key] = sums.get(key, 0.0) + metrics[key] * n
            tokens += n
            # The DP schedule: micro-batches per rank and oversized samples summed over the updates,
            # the worst rank balance, padding and peak memory.
            for key in ("micro_batches", "oversized_samples"):
                stats[key] = stats.get(key, 0) + metrics[key]
            for key in ("dp_balance", "padding_fraction", "memory_peak_gib"):
                stats[key] = max(stats.get(key, 0.0), metrics[key])
            flops += metrics["tflops_per_device"] * metrics["step_time_s"]
            seconds += metrics["step_time_s"]
        # The updates' model FLOPs a second a device (and utilisation), over their time together.
        stats.update(throughput_metrics(flops * 1e12 / seconds, self.trainer.peak_flops))
        stats.update({k: v / max(tokens, 1.0) for k, v in sums.items()})
        stats["trained_tokens"] = tokens
        return stats

    def _rescore(self, samples: list[Sample]) -> None:
        """Replace the rollout log-probs of ``samples`` by the trainer's forward of them on the current
        weights (train.micro_batch_size at a time, under the training precision); on every rank alike."""
        size = self.recipe.train.micro_batch_size
        with torch.no_grad(), self.trainer.autocast():
            for start in range(0, len(samples), size):
                part = samples[start : start + size]
                scored = sample_log_probs(self.trainer.wrapped, part).log_probs.float().cpu()
                for sample, row in zip(part, scored):
                    sample.rollout_log_probs = row[: sample.response_length].clone()

    def _update_engine(self, weights, version: int) -> None:
        self.engine.update_weights(weights if isinstance(weights, Mapping) else weights.state_dict(), version=version)

    def hand_over(self) -> None:
        """The current weights to the engines under ``weight_version`` (called on every rank)."""
        form = None
        if self.trainer.holds_shards:  # no process need hold the whole model: see orthon.rl.weight_sync
            form = self._from_rank_zero(lambda: self.sync_form and self.sync_form(self.weight_version))
        if form is not None and (form.part_bytes or form.delta_directory):
            form = (self._stream_parts(form.part_bytes) if form.part_bytes
                    else self._stream_shard_deltas(Path(form.delta_directory)))
            if form is None:
                return
        if form is not None:  # the ranks write the version's directory a safetensors shard at a time
            self.trainer.write_weights(form.directory)
            if self.rank == 0:
                self.weight_sync(form.directory, self.weight_version)
            if self.recipe.rl.cluster.delta:  # the engines hold these bytes: the ranks' next deltas start here
                self._shard_delta().reset(self.weight_version)
            return
        state = self.trainer.whole_state()
        weights = self.model if state is None else state
        if self.rank != 0:
            if self.engine is not None:  # a rank that generates too (DDP: its weights are whole)
                self._update_engine(weights, self.weight_version)
            return
        self.weight_sync(weights, self.weight_version)

    def _stream_parts(self, part_bytes: int):
        """The weights to the engines part by part as the ranks gather them (a model in pipeline stages:
        each stage's over its own group, orthon.rl.stage_sync); None once sent, else (the sync failed part
        way) the SyncForm of the directory for a full copy."""
        stage = self.trainer.stage_parts(part_bytes)
        if stage is not None:
            if self._stage_sender is None and stage.leader:
                self._stage_sender = StageSender(stage.stage, service_host(self.recipe.rl.cluster.network))
            cluster = self.recipe.rl.cluster
            run = partial(run_stages, stage, self._stage_sender, self.weight_version,
                          lambda url: HTTPEngine(url, timeout_s=cluster.request_timeout_s), cluster.check_weights)
            sync, idle = StageParts(run, stage.stages), lambda: run(None)
        else:
            loaders = self.trainer.weight_parts(part_bytes)
            sync, idle = WeightParts(loaders), lambda: [load() for load in loaders]
        retry = None
        if self.rank == 0:
            try:
                self.weight_sync(sync, self.weight_version)
            except IncompleteSync as exc:
                self.log(str(exc))
                retry = SyncForm(directory=exc.directory)
        else:
            idle()
        return self._from_rank_zero(lambda: retry)

    def _shard_delta(self) -> ShardDelta | PartDelta:
        """Each rank's delta of what it holds (its rows of FSDP2's shards; of another backend's model, whose
        ranks' parts are not rows of orthon's tensors, the parts it keeps), planned on every rank together
        at the first full copy."""
        if self._deltas is None:
            self._deltas = (PartDelta(self.model, self.rank, self.trainer.world, self.recipe.rl.cluster.part_bytes)
                            if self.trainer.foreign_model else ShardDelta(self.model, self.rank))
        return self._deltas

    def _stream_shard_deltas(self, directory: Path):
        """Every rank's delta of its rows to the engines (rank 0 hands the files over in rank order); None
        once sent, else (the sync failed) the SyncForm of the directory for a full copy."""
        directory.mkdir(parents=True, exist_ok=True)
        last = self.trainer.world - 1
        try:
            path = self._shard_delta().write(directory, self.weight_version, final=self.rank == last)
        except OSError as exc:  # a full disk: the others go on; rank 0 sees the missing file
            self.log(f"rank {self.rank}: delta payload not written ({exc})")
            path = None
        paths = distributed.all_gather_object(path)
        check = self.trainer.weight_parts(self.recipe.rl.cluster.part_bytes) if self.recipe.rl.cluster.check_weights else []
        retry = None
        if self.rank == 0:
            try:
                self.weight_sync(ShardDeltas(paths, check), self.weight_version)
            except IncompleteSync as exc:
                self.log(str(exc))
                retry = SyncForm(directory=exc.directory)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
        else:
            for load in check:
                load()
        return self._from_rank_zero(lambda: retry)

    def evaluate(self) -> dict:
        return self._from_rank_zero(lambda: self.rollout.evaluate())

    # ------------------------------------------------------------ debug modes
    def rollouts_path(self, iteration: int) -> Path:
        root = Path(self.cfg.rollouts_dir) if self.cfg.rollouts_dir else self.run_dir / "rollouts"
        return root / f"iteration_{iteration:06d}.jsonl"

    def save_rollouts(self, iteration: int, groups: list[list[Sample]]) -> None:
        if self.rank != 0:
            return
        lines = (json.dumps(sample_to_dict(s)) for g in groups for s in g)
        self.rollouts_path(iteration).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.rollouts_path(iteration), "".join(line + "\n" for line in lines))

    def load_rollouts(self, iteration: int) -> list[list[Sample]]:
        path = self.rollouts_path(iteration)
        if not path.is_file():
            raise DataError(f"rl.debug train_only: no saved rollouts for iteration {iteration} ({path}); "
                            "write them with rl.debug=rollout_only")
        groups: dict[str, list[Sample]] = {}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                sample = Sample(**json.loads(line))
            except (ValueError, TypeError) as exc:
                raise DataError(f"{path}:{number}: not a saved sample ({exc})") from None
            groups.setdefault(sample.instance_id, []).append(sample)
        return list(groups.values())

    # ------------------------------------------------------------ state
    def save_checkpoint(self) -> None:
        # Written by rank 0, whose rollout manager it is.
        self.trainer.save_checkpoint({"iteration": self.iteration, "weight_version": self.weight_version,
                                      "rollout": self.rollout.state_dict() if self.rank == 0 else None})

    def resume(self) -> bool:
        state = self.trainer.resume()
        if state is None:
            return False
        self.iteration = state["iteration"]
        self.weight_version = state["weight_version"]
        if self.rank == 0:
            self.rollout.load_state_dict(rollout_state(state))
        self.hand_over()
        self.log(f"resumed RL at iteration {self.iteration} (weight version {self.weight_version})")
        return True

    # ------------------------------------------------------------ the loop
    def iterate(self) -> dict:
        """One iteration: take the groups, train on them, hand the weights over, evaluate when due.
        ``wait_s`` is the time the trainer waited for rollouts: in the synchronous mode all of
        generation; in the asynchronous one what the producers did not have ready."""
        cfg = self.cfg
        start = time.perf_counter()
        if cfg.debug == "train_only":
            groups = self._from_rank_zero(lambda: self.load_rollouts(self.iteration))
            stats = {"reward_mean": sum(s.reward for g in groups for s in g) / max(1, sum(map(len, groups)))}
        else:
            groups, stats = self.collect_groups()
        waited = time.perf_counter()
        if cfg.debug == "rollout_only":
            self.save_rollouts(self.iteration, groups)
        else:
            stats.update(self.train_on(groups))
        trained = time.perf_counter()
        if cfg.debug != "rollout_only":  # the new weights to the engines, under the next version
            self.weight_version += 1
            self.hand_over()
        self.iteration += 1
        # trained_ids: the audit trail (every prompt trained on once, across restarts and resumes).
        stats.update(policy_version=self.weight_version, trained_samples=sum(map(len, groups)),
                     trained_ids=[g[0].instance_id for g in groups],
                     rollout_ranks=self.trainer.world if self.shared_rollouts else 1,
                     wait_s=waited - start, train_s=trained - waited, sync_s=time.perf_counter() - trained)
        if cfg.eval_interval and self.iteration % cfg.eval_interval == 0 or self.iteration == cfg.iterations:
            evaluated = time.perf_counter()
            stats.update(self.evaluate())
            stats["eval_s"] = time.perf_counter() - evaluated
        stats["iteration_time_s"] = time.perf_counter() - start
        return stats

    def fit(self) -> dict:
        cfg = self.cfg
        resumed = self.iteration or None
        metrics = MetricsLogger(self.run_dir, enabled=self.rank == 0, resume_step=resumed)
        if not resumed:
            start = self.evaluate()
            metrics.log(0, **start)
            self.log(f"iteration 0: held-out reward {start['eval_reward']:.3f} (greedy {start['eval_greedy']:.3f})")
            self.held_out = start["eval_reward"]
        postfix = ProgressPostfix(self.held_out)
        bar = None
        if self.recipe.train.progress and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=cfg.iterations, initial=self.iteration, desc="rl", unit="it")
        if cfg.mode == "async" and self.rank == 0:
            self.rollout.start()
        try:
            with stop_signals_recorded(self.recipe.train.stop_signals) as received:
                while self.iteration < cfg.iterations:
                    stats = self.last_stats = self.iterate()
                    self.held_out = stats.get("eval_reward", self.held_out)
                    metrics.log(self.iteration, **stats)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(postfix(stats))
                    interval = self.recipe.train.checkpoint_interval
                    if interval and self.iteration % interval == 0:
                        self.save_checkpoint()
                    stop_if_signalled(received, self.trainer.device, self.iteration,
                                      lambda: self.trainer.checkpointer.has(self.trainer.step),
                                      self.save_checkpoint, unit="iteration")
        finally:
            if cfg.mode == "async" and self.rank == 0:
                self.rollout.stop()
            if bar is not None:
                bar.close()
            metrics.close()
        if not self.trainer.checkpointer.has(self.trainer.step):
            self.save_checkpoint()
        self.trainer.write_weights(self.run_dir / "final")  # a collective where the ranks hold shards
        return self._from_rank_zero(self._finish)

    def _finish(self) -> dict:
        """The plots and the run's summary (final/ is written)."""
        records = read_metrics(self.run_dir / "metrics.jsonl")
        plot_curves(records, ["reward_mean", "eval_reward", "eval_greedy"], self.run_dir / "reward.png",
                    title="GRPO + IcePop: mean reward (train samples; held-out sampled and greedy)")
        plot_opd_kl(records, self.run_dir / "opd_kl.png")
        evals = [r["eval_reward"] for r in records if "eval_reward" in r]
        greedy = [r["eval_greedy"] for r in records if "eval_greedy" in r]
        return {"iterations": self.iteration, "eval_start": evals[0] if evals else math.nan,
                "eval_end": evals[-1] if evals else math.nan, "eval_best": max(evals) if evals else math.nan,
                "greedy_start": greedy[0] if greedy else math.nan, "greedy_end": greedy[-1] if greedy else math.nan}


def summary_line(result: dict) -> str:
    """One line of a finished RL run's summary (``RLTrainer.fit``'s result)."""
    return (f"{result['iterations']} iterations; held-out mean reward {result['eval_start']:.3f} -> "
            f"{result['eval_end']:.3f} (best {result['eval_best']:.3f}), greedy {result['greedy_start']:.3f} -> "
            f"{result['greedy_end']:.3f}")


class ProgressPostfix:
    """What the progress bar shows after an iteration: its mean training reward and the latest held-out
    reward (evaluations are every ``rl.eval_interval`` iterations)."""

    def __init__(self, held_out: float | None = None):
        self.held_out = held_out

    def __call__(self, stats: dict) -> dict:
        self.held_out = stats.get("eval_reward", self.held_out)
        shown = {"reward": f"{stats['reward_mean']:.2f}"}
        if self.held_out is not None:
            shown["held_out"] = f"{self.held_out:.2f}"
        return shown


def plot_opd_kl(records: list[dict], out_png: Path, window: int = 10) -> None:
    """On-policy distillation's per-iteration reverse-KL estimate and its trailing mean, when logged."""
    points = [r for r in records if isinstance(r.get("opd_reverse_kl"), (int, float))]
    if not points:
        return
    smooth = moving_average([r["opd_reverse_kl"] for r in points], window)
    curves = [{"step": r["step"], "opd_reverse_kl": r["opd_reverse_kl"], f"mean of the last {window}": m}
              for r, m in zip(points, smooth)]
    plot_curves(curves, ["opd_reverse_kl", f"mean of the last {window}"], out_png,
                title="OPD: reverse KL(student || teacher) per token, student samples")
