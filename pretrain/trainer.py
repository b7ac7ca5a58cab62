"""The one Trainer.

One step: the batch-size ramp says how many sequences this step takes (a function of tokens consumed,
so a resumed run lands on the same size), the LR schedule sets both optimizers' LR, the rank's share
of the global batch runs as gradient-accumulation micro-batches through the step plug-in's loss, the
optimizer steps, the MoE routers' selection biases move towards balance. Metrics go to JSONL +
TensorBoard, checkpoints (model, optimizer, data position, RNG) are written atomically and resumable
at any world size.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from orthon.core import distributed
from orthon.core.config import to_dict
from orthon.core.device_stats import peak_flops, step_memory, throughput_metrics
from orthon.core.errors import ConfigError
from orthon.core.files import atomic_write_bytes
from orthon.core.metrics import MetricsLogger, open_step_log, plot_training, read_metrics
from orthon.core.plugins import resolve
from orthon.core.profiling import StepProfiler
from orthon.core.step_guard import StepGuard
from orthon.core.step_loop import run_steps
from orthon.data.loader import IGNORE_INDEX, open_training_data
from orthon.optim import batch_size_at, build_for_model, lr_at
from orthon.optim.newton_schulz import bf16_gemm_is_native
from orthon.pretrain import context_parallel, expert_parallel, parallel
from orthon.pretrain.checkpoint import Checkpointer
from orthon.pretrain.config import TOKEN_ID_FIELDS
from orthon.pretrain.flops import ModelFlops
from orthon.pretrain.gathered_weights import gathered_parts, save_gathered
from orthon.pretrain.model import GLMForCausalLM, on_meta_device
from orthon.pretrain.moe import update_expert_bias
from orthon.pretrain.steps import NextTokenStep, TrainStep
from orthon.pretrain.weights import load_config, load_into, load_weights, save_weights

CONFIG_NAME = "config.yaml"
# Backends whose model this Trainer drives in place of orthon's (``recipe.backend``), by dotted path: a
# plug-in, so that the Trainer never imports a backend (they sit above it). The class takes the recipe and
# shows the face of orthon.pretrain.backend_model.BackendModel.
MODEL_BACKENDS = {"megatron": "orthon.backends.megatron.causal_lm.MegatronCausalLM"}


def _rng_state() -> dict:
    # Only torch draws random numbers during training (data order comes from the sampler's position): its
    # CPU generator and, on a GPU, this rank's device's.
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def use_deterministic_kernels() -> None:
    """``train.deterministic``: every run of a recipe, and a resumed one, the same bits on a GPU too (the CPU
    kernels already are): torch's deterministic kernels (an op without one warns, naming itself, rather
    than stopping the run) and cuBLAS with a fixed workspace (read when its first handle is made)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


_DEVICES_TOLD: set[torch.device] = set()


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def _hybrid_optimizer(model, recipe):
    return build_for_model(model, recipe.optim, recipe.schedule)


def _add_metric(sums: dict, key: str, value) -> None:
    """sums[key] += value in float64, a tensor staying one on its device (no wait for it)."""
    value = value.detach().double() if torch.is_tensor(value) else float(value)
    sums[key] = sums[key] + value if key in sums else value


def _all_reduce_dict(sums: dict, device) -> dict[str, float]:
    """Metric sums (floats or tensors) added over the ranks (every rank has the same keys), as floats: one
    transfer from the device for all of them."""
    if not sums:
        return {}
    keys = sorted(sums)
    total = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64).to(device) for k in keys])
    if distributed.is_distributed():
        total = distributed.all_reduce_sum(total)
    return dict(zip(keys, total.tolist()))


def weights_path(source) -> Path:
    """The weights directory of ``source``: a run directory's final/, or the weights directory itself."""
    path = Path(source)
    return path / "final" if (path / "final").is_dir() else path


def _layout_text(layout: dict) -> str:
    """A model layout (another backend's ``layout()``) as a log line names it."""
    return ", ".join(f"{key}={value}" for key, value in layout.items())


def other_fields(source, config) -> list[str]:
    """The architecture fields in which the model of ``source`` differs from ``config`` (token ids aside)."""
    saved = load_config(weights_path(source))
    return [f.name for f in dataclasses.fields(config)
            if f.name not in TOKEN_ID_FIELDS and getattr(saved, f.name) != getattr(config, f.name)]


def holds_shards(train, world: int) -> bool:
    """No rank holds the whole model: FSDP2 shards it, or expert parallelism spreads the experts (``train``:
    the TrainConfig, over ``world`` ranks)."""
    return world > 1 and (train.parallel == "fsdp" or train.expert_parallel > 1)


def init_source(source, config) -> Path:
    """The weights directory of ``source`` (a run directory's final/, or a weights directory), checked to
    hold the model ``config`` describes."""
    path = weights_path(source)
    differ = other_fields(path, config)
    if differ:
        raise ConfigError(f"train.init_from: {source} holds another model (model.{', model.'.join(differ)} differ)")
    return path


def initial_weights(source, config) -> dict:
    """The state dict of ``source`` (see init_source), whole."""
    return load_weights(init_source(source, config)).state_dict()


class Trainer:
    """The one training loop: pretraining, mid-training and RL are configurations of it.

    It builds the model, places it on the device (CUDA when present), wraps it for data
    parallelism (DDP / FSDP2 by ``train.parallel``), builds the optimizer (the hybrid Muon/AdamW
    routing, or whatever ``build_optimizer`` returns), and runs optimizer steps whose loss is the
    ``step`` plug-in's (orthon.pretrain.steps). ``fit`` drives it from the recipe's data; RL calls
    ``train_step`` with its own batches. Checkpoints (model, optimizer, data position, RNG, and any
    extra state the caller adds) go through one Checkpointer; metrics through one MetricsLogger."""

    def __init__(self, recipe, run_dir: Path, log=print, step: TrainStep | None = None,
                 build_optimizer=None, with_data: bool = True):
        self.recipe = recipe
        self.cfg = recipe.train
        self.run_dir = Path(run_dir)
        self.rank, self.world, self.device = distributed.init_distributed()
        self.log = log if self.rank == 0 else (lambda *_: None)
        if self.cfg.deterministic:
            use_deterministic_kernels()
        if self.device not in _DEVICES_TOLD:  # once a process: mid-training builds a Trainer a stage
            _DEVICES_TOLD.add(self.device)
            self.log(f"device: {describe_device(self.device)}{', deterministic kernels' if self.cfg.deterministic else ''}")
        torch.manual_seed(self.cfg.seed)
        random.seed(self.cfg.seed)
        np.random.seed(self.cfg.seed)

        # Another framework's model (``recipe.backend``, see MODEL_BACKENDS) is built whole and brings its own
        # weights I/O and optimizer; orthon's own is GLMForCausalLM.
        self.foreign_model = recipe.backend in MODEL_BACKENDS
        sharded_build = self._builds_sharded()
        source = init_source(self.cfg.init_from, recipe.model) if self.cfg.init_from else None
        with on_meta_device() if sharded_build else nullcontext():
            if self.foreign_model:
                self.model = resolve(MODEL_BACKENDS[recipe.backend], "backend")(recipe)
            else:
                self.model = GLMForCausalLM(recipe.model, runtime=dataclasses.replace(recipe.runtime))  # a copy: phases change it
        if not sharded_build:
            if source is not None and self.foreign_model:
                self.model.load_weights(source)
            elif source is not None:
                load_into(self.model, source)
            self.model.to(self.device)
        if self.cfg.precision == "bf16" and not bf16_gemm_is_native(self.device):
            self.log("warning: train.precision bf16 on a CPU whose bf16 matmul is emulated (no AVX512-BF16 / AMX; "
                     "about 1 GFLOP/s): each step will take many times as long as in fp32 (train.precision=fp32)")
        self.model.set_indexers_trainable(False)  # the LM loss never reaches them; mid-training trains them
        self.model.track_max_logit(self.cfg.track_max_logit)
        self.step_fn = step or NextTokenStep(self.cfg.loss_chunk, recipe.data.document_mask, self.cfg.track_max_logit)
        if self.foreign_model:
            self.model.check_step(self.step_fn)
        parallel.check_shard_ranks(self.cfg.fsdp_shard_ranks, self.world)
        self.expert_parallel = self.cfg.expert_parallel if self.world > 1 else 1
        self.expert_mesh = self._shard_experts() if self.expert_parallel > 1 else None
        # Context parallelism: the ranks of a group take the same sequences, so the data is split over the
        # groups (data ranks), each rank running its part of every sequence.
        cp = self.cfg.context_parallel
        if cp > 1 and not self.step_fn.runs_context_parallel:
            raise ConfigError(f"train.context_parallel = {cp}: {type(self.step_fn).__name__} does not split its "
                              f"sequences over ranks (pretraining's and mid-training's steps do); set "
                              f"train.context_parallel=1")
        cp = cp if self.world > 1 else 1
        self.context = self._context_group(cp) if cp > 1 else None
        self.data_rank, self.data_world = self.rank // cp, self.world // cp
        if self.foreign_model:  # its own model parallelism: the ranks of one model replica read the same batches
            self.data_rank, self.data_world = self.model.data_parallel()
        self._wrap()  # before the optimizer: FSDP2 replaces the parameters it shards
        if sharded_build:
            self.model.to_empty(device=self.device)
            if source is not None:
                load_into(self.model, source)
            else:
                self.model.draw_as_built()
                self.model.reset_parameters()
            groups = self.cfg.fsdp_shard_ranks
            hsdp = f", sharded within groups of {groups}" if 0 < groups < self.world else ""
            self.log(f"model built sharded (FSDP2 over {self.world} ranks{hsdp}): no rank held all of it")
        if build_optimizer is None:
            build_optimizer = (lambda model, recipe: model.build_optimizer(recipe)) if self.foreign_model else _hybrid_optimizer
        self.optimizer = build_optimizer(self.model, recipe)
        self.data, self.valid = (open_training_data(recipe.data, recipe.model.vocab_size, recipe.train.eval_samples,
                                                    self.data_rank, self.data_world)
                                 if with_data else (None, None))
        self.checkpointer = Checkpointer(self.run_dir, self.cfg.keep_last, log=self.log)
        self._background_saves = False  # train.async_checkpoint, inside fit (whose end completes the last save)
        self.seq_len = recipe.data.seq_len
        self.step, self.tokens = 0, 0
        self.guard = StepGuard(self.cfg.max_nonfinite_skips, self.cfg.spike_sigma, self.cfg.spike_window, self.log)
        self.total_tokens = self.cfg.total_tokens or recipe.schedule.total_tokens
        self.model_flops = ModelFlops.of(recipe.model)
        self.peak_flops = peak_flops(self.device, self.cfg.peak_tflops)

    # ------------------------------------------------------------ state
    def resume(self, step: int | None = None) -> dict | None:
        """Load the newest good checkpoint (or the one of ``step``, the later ones then set aside as
        abandoned); returns its trainer state (with any extra keys the caller saved), or None when there
        is none."""
        if step is None:
            path = self.checkpointer.latest_good()
        else:
            path = self.checkpointer.of_step(step)
            abandoned = self.checkpointer.set_aside_after(step)
            if abandoned:
                self.log(f"resuming from step {step}: the later checkpoints ({', '.join(abandoned)}) moved to "
                         f"{self.checkpointer.root / 'abandoned'}")
        if path is None:
            return None
        rebuild = None
        if self.foreign_model:  # its checkpoints hold each rank's part of the model as that layout cut it
            saved = self.checkpointer.trainer_state(path).get("layout")
            rebuild = self.model.resharding(saved, path)
            if rebuild is not None:
                self.log(f"{path} was written at {_layout_text(saved)}: each rank's weights and optimizer state "
                         f"rebuilt for {_layout_text(self.model.layout())}")
        state = self.checkpointer.load(path, self.wrapped, self.optimizer.optimizers, rebuild=rebuild)
        self.step, self.tokens = state["step"], state["tokens"]
        if "guard" in state:  # checkpoints from before skipped steps have none: nothing was skipped
            self.guard.load_state_dict(state["guard"])
        if self.data is not None:
            self.data.load_state_dict(state["data"])
        _set_rng_state(state["rng"])
        self.log(f"resumed from {path} at step {self.step} ({self.tokens:,} tokens)")
        return state

    def skip_batches(self, batches: int) -> None:
        """Move the data past the next ``batches`` steps' batches without training on them (the remedy for
        a loss spike tied to the data: resume before it and skip past it). The step, the tokens and so
        the schedule stay where they are; the next checkpoint records the new data position."""
        samples = batches * self.batch_sequences()
        self.data.skip(samples)
        self.log(f"skipped {batches} batches ({samples:,} sequences, {samples * self.seq_len:,} tokens) of data "
                 f"after step {self.step}")

    def save_checkpoint(self, extra: dict | None = None) -> None:
        state = {"step": self.step, "tokens": self.tokens, "rng": _rng_state(),
                 "guard": self.guard.state_dict(), **(extra or {})}
        if self.data is not None:
            state["data"] = self.data.state_dict()
        if self.foreign_model:
            state["layout"] = self.model.layout()
        self.checkpointer.save(self.step, self.wrapped, self.optimizer.optimizers, state, background=self._background_saves)

    def _shard_experts(self):
        ep = self.expert_parallel
        expert_parallel.check_degree(ep, self.world, self.recipe.model.n_routed_experts)
        if not self.step_fn.runs_expert_parallel:
            raise ConfigError(f"train.expert_parallel = {ep}: {type(self.step_fn).__name__} does not run every "
                              f"forward on every rank (pretraining's and mid-training's steps do, post-training's with "
                              f"rl.dp_schedule.equal_micro_batches); set train.expert_parallel=1")
        mesh = expert_parallel.shard_experts(self.model, ep, self.device)
        n = self.recipe.model.n_routed_experts
        self.log(f"expert parallelism: {n // ep} of the {n} experts of each MoE layer on each rank ({self.world // ep} "
                 f"ranks hold the same ones{', FSDP2-sharded among them' if self.cfg.parallel == 'fsdp' else ''})")
        return mesh

    def _context_group(self, cp: int):
        context_parallel.check_degree(cp, self.world, self.recipe.data.seq_len)
        self.log(f"context parallelism: each sequence of {self.recipe.data.seq_len} tokens split over {cp} ranks "
                 f"({self.recipe.data.seq_len // cp} positions each); data parallelism over {self.world // cp} such groups")
        return context_parallel.ContextParallel(cp, self.device)

    def _trainable_names(self) -> frozenset[str]:
        return frozenset(n for n, p in self.model.named_parameters() if p.requires_grad)

    @property
    def pipelined(self) -> bool:
        """Another backend's model runs each step's micro-batches through its pipeline schedule."""
        return self.foreign_model and self.model.pipelined

    def _wrap(self) -> None:
        self.wrapped = None  # an old DDP wrapper's reducer (and its gradient hooks) goes first
        if self.pipelined:  # its schedule runs the forwards and backwards; it averages the gradients itself
            self.wrapped, self._wrapped_for = self.model, self._trainable_names()
            return
        self.wrapped = parallel.wrap(self.model, self.cfg.parallel, self.expert_mesh, self.cfg.fsdp_shard_ranks,
                                     torch.bfloat16 if self.cfg.fsdp_param_dtype == "bf16" else None,
                                     self.model.ddp_group() if self.foreign_model else None)
        self._wrapped_for = self._trainable_names()

    def set_trainable(self, trainable) -> None:
        """requires_grad from ``trainable(name) -> bool``. DDP registers its gradient hooks for the
        parameters that require grad when it wraps, so a change of that set re-wraps the model."""
        for name, p in self.model.named_parameters():
            p.requires_grad_(bool(trainable(name)))
        if self._trainable_names() != self._wrapped_for and self.cfg.parallel == "ddp":
            self._wrap()

    # ------------------------------------------------------------ one step
    def batch_sequences(self) -> int:
        """Global batch of this step in sequences, from the token-based ramp."""
        micro_tokens = self.cfg.micro_batch_size * self.seq_len
        return batch_size_at(self.recipe.batch, self.tokens, micro_tokens, self.data_world) // self.seq_len

    def set_lr(self) -> float:
        """Both optimizers' LRs from the schedule (by tokens consumed, or by steps when the schedule
        counts steps); returns the peak-LR group's value."""
        self.optimizer.set_tokens(self.tokens, self.step)
        return lr_at(self.recipe.schedule, self.tokens, self.step)

    def autocast(self):
        """The context forwards run in under ``train.precision`` (bf16: autocast; fp32: nothing)."""
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def train_step(self, batch=None, tokens: int | None = None) -> dict:
        """One optimizer step on ``batch`` (default: the next batch of the recipe's data, sized by the
        batch ramp); ``tokens`` is what the step consumes globally (for the schedule)."""
        start = time.perf_counter()
        data_time = None
        if batch is None:
            n_seqs = self.batch_sequences()
            batch, tokens = self.data.next_batch(n_seqs), n_seqs * self.seq_len
            data_time = time.perf_counter() - start  # a data pipeline that cannot keep up shows here first
            self.sample_ids = batch.sample_ids
        lr = self.set_lr()
        self.step_fn.begin(self, batch)
        micros = self.step_fn.micro_batches(batch, self.cfg.micro_batch_size, self.device)
        sums: dict = {}
        autocast = self.autocast()
        lengths = [n for micro in micros for n in self.step_fn.sequence_lengths(micro)]
        if self.pipelined:
            with autocast:
                every_micro_sums = self.model.train_micro_batches(self.step_fn, micros)
        else:
            every_micro_sums = []
            for i, micro in enumerate(micros):
                with parallel.no_sync(self.wrapped, last=i == len(micros) - 1), autocast:
                    objective, micro_sums = self.step_fn.loss(self.wrapped, micro)
                    if objective.requires_grad:
                        objective.backward()
                every_micro_sums.append(micro_sums)
        for micro_sums in every_micro_sums:
            for key, value in micro_sums.items():
                _add_metric(sums, key, value)
        _add_metric(sums, "model_flops", self._model_flops(lengths))
        if self.expert_parallel > 1:
            expert_parallel.reduce_expert_grads(self.model, self.expert_mesh, self.cfg.parallel == "fsdp")
        if self.foreign_model:  # what DDP leaves to the model's own parallelism
            self.model.finish_grads()
        sums = _all_reduce_dict(sums, self.device)
        flops = sums.pop("model_flops")
        step_metrics = self.step_fn.end(self, sums)
        grad_norm = self._clip_and_norm()
        skipped = self.guard.skip(self.step + 1, grad_norm, step_metrics.get("loss"))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        balance = {}
        if self.step_fn.update_moe_bias and not skipped:
            balance = self._update_moe_bias()
        else:
            self._discard_moe_load()
        self.step += 1
        self.tokens += int(tokens or 0)
        elapsed = time.perf_counter() - start
        metrics = {**step_metrics, "lr": lr, "grad_norm": grad_norm, "step_time_s": elapsed,
                   "micro_batches": len(micros)}
        if tokens:
            metrics.update(batch_tokens=tokens, tokens=self.tokens, tokens_per_s=tokens / elapsed)
        metrics.update(throughput_metrics(flops / self.world / elapsed, self.peak_flops))  # orthon.pretrain.flops
        metrics.update(step_memory(self.device))
        if data_time is not None:
            metrics["data_time_s"] = data_time
        metrics.update(balance)
        if self.guard.total:
            metrics["skipped_steps"] = self.guard.total
        return metrics

    def _model_flops(self, lengths: list[int]) -> float:
        """This rank's share of the model FLOPs of training on sequences of ``lengths`` (its micro-batches);
        context parallelism splits each sequence over its group's ranks."""
        indexer_trains = any(p.requires_grad for indexer in self.model.indexers() for p in indexer.parameters())
        flops = self.model_flops.sequences(lengths, self.model.runtime.sparse_attention, indexer_trains)
        return flops * self.data_world / self.world

    def _clip_and_norm(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        if self.foreign_model:
            return self.model.clip_grads(max_norm)
        if self.expert_parallel > 1:  # expert stacks on another mesh than FSDP2's: torch's cannot mix them
            return parallel.clip_grads(params, max_norm)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    @torch.no_grad()
    def _update_moe_bias(self) -> dict[str, float]:
        """Aux-loss-free balancing: every router's bias moves by rate * sign(mean load - load). Returns the
        loads' metrics, means over the MoE layers: moe_load_max_over_mean (the busiest expert against the
        mean) and, under expert parallelism, moe_rank_load_max_over_mean (the rows a rank's experts take:
        what every rank of the exchange waits for)."""
        ratios, rank_ratios = [], []
        for router in self.model.moe_routers():
            load = distributed.all_reduce_sum(router.expert_load.clone())
            if load.sum() > 0:
                ratios.append(float(load.max() / load.mean()))
                if self.expert_parallel > 1:
                    per_rank = load.view(self.expert_parallel, -1).sum(1)
                    rank_ratios.append(float(per_rank.max() / per_rank.mean()))
                router.e_score_correction_bias.copy_(
                    update_expert_bias(router.e_score_correction_bias, load, self.cfg.moe_bias_rate))
            router.expert_load.zero_()
        names = ("moe_load_max_over_mean", "moe_rank_load_max_over_mean")
        return {name: sum(r) / len(r) for name, r in zip(names, (ratios, rank_ratios)) if r}

    @torch.no_grad()
    def _discard_moe_load(self) -> None:
        """The routing counts of a step that moves no bias (skipped, or a step plug-in that leaves the
        biases alone): dropped, so the next bias update sees its own step's alone."""
        for router in self.model.moe_routers():
            router.expert_load.zero_()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean held-out next-token loss (through the wrapper: FSDP2 gathers the shards in forward)."""
        if self.valid is None:
            return None
        self.wrapped.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch, counted in self._eval_batches():
            batch = batch.to(self.device)
            docs = batch.doc_ids if self.recipe.data.document_mask else None
            loss = self.wrapped(batch.input_ids, labels=batch.labels, doc_ids=docs, return_logits=False,
                                loss_reduction="sum", loss_chunk=self.cfg.loss_chunk, context=self.context).loss.double()
            if counted:
                total += loss
                labels = batch.labels if self.context is None else self.context.local(batch.labels)
                count += (labels != IGNORE_INDEX).sum()
        self.wrapped.train()
        distributed.all_reduce_sum(total)
        distributed.all_reduce_sum(count)
        return (total / count).item() if count > 0 else None

    def _eval_batches(self):
        """(batch, counted) of this rank's held-out share. Every rank runs as many forwards as the others:
        under FSDP2 each forward gathers shards from all ranks, under expert parallelism each joins every
        MoE layer's exchange, so a rank whose share has fewer batches (held-out samples that do not split
        evenly) runs the first held-out batch again, not counted, until all are done."""
        size = self.cfg.micro_batch_size
        mine = self.valid.num_batches(size, self.data_rank, self.data_world)
        most = int(distributed.all_reduce_max(torch.tensor([mine], device=self.device)).item())
        yield from ((batch, True) for batch in self.valid.batches(size, self.data_rank, self.data_world))
        if mine < most:
            filler = next(self.valid.batches(size, 0, 1))
            yield from ((filler, False) for _ in range(most - mine))

    # ------------------------------------------------------------ the loop
    def done(self) -> bool:
        return self.tokens >= self.total_tokens or (self.cfg.max_steps and self.step >= self.cfg.max_steps)

    def fit(self) -> dict:
        resumed_step = self.step if self.step else None
        metrics_log = MetricsLogger(self.run_dir, enabled=self.rank == 0, resume_step=resumed_step)
        samples_log = self._samples_log(resumed_step)
        self.wrapped.train()

        def log_sample_ids():
            samples_log.write(json.dumps({"step": self.step, "ids": self.sample_ids.tolist()}) + "\n")
            samples_log.flush()
        label = self.cfg.progress_label if self.cfg.progress and self.rank == 0 else None
        self._background_saves = self.cfg.async_checkpoint
        profiler = StepProfiler(self.run_dir, self.cfg.profile_from_step, self.cfg.profile_steps, self.rank,
                                self.step, self.log)

        def after_step():
            profiler.step()
            if samples_log is not None:
                log_sample_ids()
        try:
            last, final_eval = run_steps(self, metrics_log, label, after_step)
        finally:  # a stop signal or Ctrl-C: the checkpoint being written is completed, and what was logged
            profiler.close()  # reaches the files (TensorBoard buffers events)
            self._background_saves = False
            self.checkpointer.wait()
            metrics_log.close()
            if samples_log is not None:
                samples_log.close()
        self.write_weights(self.run_dir / "final")
        if self.rank == 0:
            self.finish()
        if not last:  # resumed at its end: no step ran here, so report the last logged step's figures
            path = self.run_dir / "metrics.jsonl"
            logged = [r for r in read_metrics(path) if "loss" in r] if path.is_file() else []
            last = {k: v for k, v in logged[-1].items() if k != "step"} if logged else {}
        return {"step": self.step, "tokens": self.tokens, "final_eval_loss": final_eval, **last}

    def _samples_log(self, resume_step):
        if not (self.cfg.log_sample_ids and self.rank == 0):
            return None
        return open_step_log(self.run_dir / "samples.jsonl", resume_step)  # cut back as the metrics are

    def frozen_copy(self, source) -> GLMForCausalLM:
        """A frozen model of the policy's architecture holding the weights of ``source`` (a weights
        directory or a run), placed as the policy is: under FSDP2 built on the meta device and sharded
        before it has memory, the experts spread under expert parallelism (no rank holds all of it; its
        forward is a collective, as the policy's), whole on each rank otherwise. A KL reference, a
        distillation teacher. Another backend's model: that backend's, built as the policy is (its ranks
        holding the parts of it the policy's hold)."""
        source = init_source(source, self.recipe.model)
        if self.foreign_model:
            recipe = dataclasses.replace(self.recipe, train=dataclasses.replace(self.recipe.train, init_from=str(source)))
            model = resolve(MODEL_BACKENDS[recipe.backend], "backend")(recipe)
            model.load_weights(source)
            return model.to(self.device).requires_grad_(False).eval()
        fsdp = self.cfg.parallel == "fsdp" and self.world > 1
        sharded_build = self._builds_sharded()
        with on_meta_device() if sharded_build else nullcontext():
            model = GLMForCausalLM(self.recipe.model, runtime=dataclasses.replace(self.recipe.runtime))
        model.requires_grad_(False)
        if not sharded_build:
            load_into(model, source)
            model.to(self.device)
        mesh = expert_parallel.shard_experts(model, self.expert_parallel, self.device) if self.expert_mesh else None
        if fsdp:
            parallel.wrap(model, "fsdp", mesh, self.cfg.fsdp_shard_ranks)
        if sharded_build:
            model.to_empty(device=self.device)
            load_into(model, source)
        return model.eval()

    def _builds_sharded(self) -> bool:
        """FSDP2 over several ranks: a model is built on the meta device and sharded before it has memory, so
        no rank ever holds the whole of it (GLM-5's 744B parameters would not fit); the same values as a
        direct build. Not for tied embeddings: such a model is built whole."""
        return (self.cfg.parallel == "fsdp" and self.world > 1 and not self.recipe.model.tie_word_embeddings
                and not self.foreign_model)

    @property
    def holds_shards(self) -> bool:
        """No rank holds the whole model (``holds_shards``; another backend's model: its own model
        parallelism)."""
        return self.model.model_parallel if self.foreign_model else holds_shards(self.cfg, self.world)

    def whole_state(self) -> dict | None:
        """The model's state dict gathered from the ranks' shards (a collective: every rank calls it; CPU
        copies, on rank 0 only; empty elsewhere), or None where every rank holds the whole model
        (``self.model``'s own). Another backend's model: its state in orthon's names (on every rank where
        each holds the whole model)."""
        if self.foreign_model:  # another framework's names: orthon's, as every reader of this expects
            return self.model.whole_state(0 if self.holds_shards else self.rank) or {}
        if not self.holds_shards:
            return None
        return get_model_state_dict(self.wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def weight_parts(self, part_bytes: int) -> list:
        """The model in parts of about ``part_bytes`` as loaders, each gathering its part from the ranks'
        shards (a collective: every rank calls each in turn); the i-th returns on rank 0 its {name: CPU
        tensor} in orthon's names (a routed-expert stack larger than a part as windows of whole experts),
        None elsewhere (``orthon.pretrain.gathered_weights.gathered_parts``; another backend's model its own)."""
        if self.foreign_model:
            return self.model.weight_parts(part_bytes)
        return gathered_parts(self.model, self.rank, part_bytes, split_experts=True)

    def stage_parts(self, part_bytes: int):
        """Where the model runs in pipeline stages (another backend's: megatron's), this rank's stage's
        parts, each gathered within the stage to its leader, side by side with the other stages; None
        where it does not."""
        return self.model.stage_parts(part_bytes) if self.foreign_model else None

    def write_weights(self, directory) -> None:
        """The model as a weights directory (``orthon.pretrain.weights``), written by rank 0. Where the
        ranks hold shards, a collective that gathers one safetensors shard at a time
        (``orthon.pretrain.gathered_weights``), so no process holds the whole model."""
        if self.foreign_model:  # a collective where its ranks hold parts of it (tensor, expert parallelism)
            self.model.save_weights(directory, write=self.rank == 0)
        elif self.holds_shards:
            save_gathered(self.model, directory, self.rank)
        elif self.rank == 0:
            save_weights(self.model, directory)

    def finish(self) -> None:
        """The run's loss plot and the step plug-in's own (rank 0, after final/ is written)."""
        records = read_metrics(self.run_dir / "metrics.jsonl")
        plot_training(records, self.run_dir / "loss.png",
                      title=f"{self.cfg.progress_label} loss ({self.recipe.model.hidden_size}-wide, "
                            f"{self.recipe.model.num_hidden_layers} layers)",
                      reference=math.log(self.recipe.model.vocab_size), reference_label="ln(vocab)")
        self.step_fn.finish(self, records)


def run_config_text(recipe) -> str:
    """The recipe as a run directory's config.yaml holds it."""
    return yaml.safe_dump(to_dict(recipe), sort_keys=False)


def write_run_config(run_dir: Path, recipe) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / CONFIG_NAME, run_config_text(recipe).encode())
