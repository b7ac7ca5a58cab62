"""TrainConfig: how the pretraining loop runs (the what — model, data, optimizer, schedules — lives in
their own sections of the recipe)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from orthon.core.errors import ConfigError
from orthon.core.interrupts import check_stop_signals


@dataclass
class TrainConfig:
    run_dir: str = "runs/pretrain"
    micro_batch_size: int = 8  # sequences per micro-batch on each rank
    total_tokens: int = 0  # stop after this many tokens; 0: the LR schedule's total_tokens
    max_steps: int = 0  # also stop after this many optimizer steps; 0: no step limit
    eval_interval: int = 50  # steps between held-out evaluations (0: only at the end)
    eval_samples: int = 64  # held-out sequences per source
    checkpoint_interval: int = 100  # steps between checkpoints (0: only at the end)
    keep_last: int = 3
    # Write the step loop's checkpoints in the background: the state is copied to CPU memory (as much
    # again as the model and optimizer state), then a thread writes it while training goes on; the
    # checkpoint is completed (manifest, name, pruning) at the next save or the run's end.
    async_checkpoint: bool = False
    log_interval: int = 1
    # torch.profiler over steps profile_from_step .. + profile_steps - 1 (0: off): a Chrome / Perfetto
    # trace per rank and a table of the ops by time, in RUN_DIR/profile/.
    profile_from_step: int = 0
    profile_steps: int = 2
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast the forward
    grad_clip: float = 0.0  # max global grad norm; 0 = off (GLM-5 trains Muon Split without clipping)
    # A step whose gradient norm is inf or NaN is skipped (no update; the data moves on; counted as the
    # metric skipped_steps); more than this many in a row stop the run as diverged. 0: stop at the first.
    max_nonfinite_skips: int = 5
    # > 0: a step whose gradient norm or loss is more than this many standard deviations above the mean
    # of the last spike_window steps' is skipped too (OLMo 2's skipped steps use 6 over 128). 0: off.
    spike_sigma: float = 0.0
    spike_window: int = 128
    moe_bias_rate: float = 1e-3  # aux-loss-free balancing: bias step per optimizer step
    seed: int = 0
    # The same bits on every run of the recipe, resumed ones too, on a GPU as on the CPU: torch's
    # deterministic kernels and a fixed cuBLAS workspace (slower; the CPU's kernels are deterministic already).
    deterministic: bool = False
    parallel: Literal["ddp", "fsdp"] = "ddp"  # how to shard when launched on more than one rank
    # FSDP2's dtype for the gathered parameters: bf16 halves the bytes of every all-gather and of the
    # gathered layers (torchtitan's default) and rounds the weights each forward sees to bf16, as autocast
    # does for matmuls but for norms and routers too; gradients are reduced in fp32 and the optimizer steps
    # the fp32 shards. Needs precision bf16. fp32: gathered as stored, autocast casting per op.
    fsdp_param_dtype: Literal["fp32", "bf16"] = "fp32"
    # FSDP2 as HSDP: shard within groups of this many consecutive ranks (a node's GPUs, say) and keep a copy
    # per group, so the all-gathers stay inside a group and only the gradients' all-reduce crosses them.
    # 0: shard over all ranks. It divides the world size.
    fsdp_shard_ranks: int = 0
    # > 1: each MoE layer's routed experts spread over this many ranks (it divides the world size and
    # model.n_routed_experts), tokens sent to their experts' ranks and back (all-to-all); the rest stays
    # data-parallel by `parallel`. Pretraining's and mid-training's steps (RL and SFT generate with every
    # expert on one rank).
    expert_parallel: int = 1
    # > 1: each sequence split over this many consecutive ranks (context parallelism, for contexts one
    # device cannot hold: orthon.pretrain.context_parallel); it divides the world size, and the sequence
    # length is a multiple of twice it. Data parallelism then runs over world / context_parallel groups.
    context_parallel: int = 1
    track_max_logit: bool = True  # log the largest attention logit (the Muon Split claim)
    # The device's peak TFLOP/s for the step metric mfu_pct (model FLOPs a second over this peak; the
    # model FLOPs are orthon.pretrain.flops'). 0: a known GPU's dense bf16 peak (orthon.core.device_stats),
    # and no MFU where there is none (CPUs, unlisted GPUs); tflops_per_device is logged either way.
    peak_tflops: float = 0.0
    log_sample_ids: bool = False  # write every consumed sample id to samples.jsonl
    progress: bool = True
    progress_label: str = "pretrain"  # the progress bar's and loss plot's name for this run
    # Positions per chunk of the chunked cross-entropy (no full logits in memory); 0: one piece.
    loss_chunk: int = 0
    # Start from another run's final weights (its run directory or a weights directory), with a fresh
    # optimizer and schedule: continued pretraining on other data. "" = random initialisation.
    init_from: str = ""
    # Where the built-in corpus is prepared when data.sources is empty ("" = no built-in corpus).
    builtin_dir: str = "runs/builtin"
    # Signals that stop the run after the current step with a checkpoint of it (exit code 128 + the
    # signal's number): SIGTERM is what Slurm (at --time, or --signal=TERM@SECONDS before it), Kubernetes
    # and torchrun send before killing. [] = the signals' default action (the run dies mid-step and
    # resumes from its last interval checkpoint).
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])

    def __post_init__(self):
        for name in ("micro_batch_size", "log_interval", "keep_last", "profile_steps", "spike_window", "expert_parallel",
                     "context_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("total_tokens", "max_steps", "eval_interval", "checkpoint_interval", "eval_samples", "loss_chunk",
                     "max_nonfinite_skips", "profile_from_step", "fsdp_shard_ranks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.fsdp_param_dtype == "bf16" and (self.parallel != "fsdp" or self.precision != "bf16"):
            raise ConfigError(f"fsdp_param_dtype: bf16 gathers FSDP2's parameters in bf16 for a bf16 forward; it "
                              f"needs parallel: fsdp and precision: bf16 (got parallel: {self.parallel}, precision: "
                              f"{self.precision})")
        if self.fsdp_shard_ranks and self.parallel != "fsdp":
            raise ConfigError(f"fsdp_shard_ranks: HSDP groups are an FSDP2 setting (parallel: fsdp); got parallel: "
                              f"{self.parallel} with fsdp_shard_ranks: {self.fsdp_shard_ranks}")
        check_stop_signals(self.stop_signals)
        if self.spike_sigma < 0:
            raise ConfigError(f"spike_sigma: must be >= 0 (0 = off), got {self.spike_sigma}")
        if self.peak_tflops < 0:
            raise ConfigError(f"peak_tflops: must be >= 0 (0 = the device's own, where known), got {self.peak_tflops}")
        if self.grad_clip < 0:
            raise ConfigError(f"grad_clip: must be >= 0 (0 = off), got {self.grad_clip}")
