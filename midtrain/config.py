"""The mid-training plan: stages of long-context extension and DSA adaptation, checked before training.

A plan is a list of stages run in order, each continuing the previous one's weights and optimizer
state. Per stage: sequence length, token budget, RoPE base (changed at the boundary, no YaRN or
dynamic scaling), its place in the plan's LR decay, IndexShare on/off and the DSA phase:

- ``dsa: off``            dense attention; the indexers are neither used nor trained.
- ``dsa: indexer_warmup`` DSA adaptation: the first ``indexer_only_steps`` steps freeze everything but
                          the indexers and fit them to the dense attention (phase 1), the rest of the
                          budget trains jointly with sparse attention (phase 2).
- ``dsa: sparse``         phase 2 from the first step (the indexers were adapted earlier).

GLM-5's recipe (README, "The recipe"): 32K / 1T tokens with rope_theta 8M; 128K / 500B with IndexShare; 200K /
50B; LR linear 4e-5 -> 1e-5 across the three; DSA adaptation 20B tokens at 128K+, of which the first
1000 steps train only the indexer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from orthon.core.config import build
from orthon.core.errors import ConfigError
from orthon.data.config import DataConfig
from orthon.pretrain.config import RuntimeOptions
from orthon.pretrain.train_config import TrainConfig

DsaPhase = Literal["off", "indexer_warmup", "sparse"]


@dataclass
class StageConfig:
    name: str
    seq_len: int
    tokens: int  # the stage's token budget
    rope_theta: float | None = None  # None: keep the previous stage's (or the pretrained) base
    # Multiply every layer's attention logits by this at the stage's start (folded into q_b_proj: the
    # model's shape and its HF export are unchanged). At a DSA hand-over it concentrates the dense
    # attention that the indexers must then find, and sparse training, which never sees unselected keys,
    # does not spread it again. (0.1 ln s + 1)^2 is YaRN's attention temperature for an s-fold extension
    # (1.296 for 4x). 1.0: unchanged (GLM-5's recipe).
    attention_scale: float = 1.0
    index_share: bool = False  # "shared" layers reuse the previous "full" layer's top-k
    dsa: DsaPhase = "off"
    indexer_only_steps: int = 0  # with dsa indexer_warmup: phase-1 steps at the start of the stage
    # LR for the indexers during the indexer-only steps (None: the stage's LR). Phase 2 trains every
    # parameter at the stage's LR.
    indexer_lr: float | None = None
    # "decay": the stage's tokens advance the plan's linear decay; "hold": the LR stays where the decay
    # stands (for a stage outside the decay, such as the DSA adaptation).
    lr_mode: Literal["decay", "hold"] = "decay"
    batch_tokens: int = 0  # global batch per step in tokens (0: the plan's)
    micro_batch_size: int = 0  # sequences per micro-batch (0: the plan's)
    # Ranks each sequence is split over (train.context_parallel for this stage; 0: the plan's). The long
    # stages need it where one device cannot hold a sequence's activations.
    context_parallel: int = 0

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: must be a non-empty name without '/', got {self.name!r}")
        if self.seq_len < 1:
            raise ConfigError(f"seq_len: must be positive, got {self.seq_len}")
        if self.tokens <= 0:
            raise ConfigError(f"tokens: the stage's token budget must be positive, got {self.tokens}")
        if self.rope_theta is not None and self.rope_theta <= 0:
            raise ConfigError(f"rope_theta: must be positive, got {self.rope_theta}")
        if not self.attention_scale > 0:
            raise ConfigError(f"attention_scale: must be positive, got {self.attention_scale}")
        if self.context_parallel < 0:
            raise ConfigError(f"context_parallel: must be >= 0 (0: the plan's train.context_parallel), got "
                              f"{self.context_parallel}")
        if self.indexer_only_steps < 0:
            raise ConfigError(f"indexer_only_steps: must be >= 0, got {self.indexer_only_steps}")
        if self.dsa == "indexer_warmup" and self.indexer_only_steps == 0:
            raise ConfigError("indexer_only_steps: dsa 'indexer_warmup' needs at least one indexer-only step")
        if self.dsa != "indexer_warmup" and self.indexer_only_steps:
            raise ConfigError(f"indexer_only_steps: only a dsa 'indexer_warmup' stage has indexer-only steps "
                              f"(this stage is dsa {self.dsa!r})")
        if self.indexer_lr is not None and self.indexer_lr < 0:
            raise ConfigError(f"indexer_lr: must be >= 0, got {self.indexer_lr}")
        for name in ("batch_tokens", "micro_batch_size"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (0: the plan's), got {getattr(self, name)}")

    def step_phase(self, step: int) -> str:
        """What optimizer step ``step`` (0-based, within the stage) runs: dense | indexer_only | sparse."""
        if self.dsa == "off":
            return "dense"
        if self.dsa == "indexer_warmup" and step < self.indexer_only_steps:
            return "indexer_only"
        return "sparse"


@dataclass
class LongEvalConfig:
    """Long-context evaluation: passkey retrieval at lengths x depths, perplexity by position."""

    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    trials: int = 8  # passkeys per (length, depth) cell
    digits: int = 5
    ppl_length: int = 1024  # sequence length of the perplexity-by-position measurement
    ppl_buckets: int = 8
    ppl_samples: int = 16
    seed: int = 0
    # The needle (``{key}`` is the key) and the question that ends every prompt: a prefix of the needle,
    # so that the rest of the needle is the answer. Both must encode in the run's tokenizer.
    needle: str = "\nPASSKEY = {key}\n"
    question: str = "\nPASSKEY ="
    # The held-out store (by name, data.valid) the haystack is cut from; "": the largest one that is not
    # "recall" (recall documents hold needles of their own).
    haystack: str = ""
    # A held-out store (by name) whose windows the indexer recall is also measured on, at each length:
    # the documents the model was trained on, where dense attention reads something. The passkey prompts
    # alone are filler, where much of an induction head's mass spreads over every earlier "the".
    # "": the passkey prompts only.
    recall_store: str = ""
    recall_windows: int = 8
    # How each run is evaluated: "saved" (its saved runtime), "dense" or "sparse" (DSA on, whatever was
    # saved); with more than one mode each run is evaluated once per mode.
    attention: list[Literal["saved", "dense", "sparse"]] = field(default_factory=lambda: ["saved"])

    def __post_init__(self):
        if not self.lengths or any(n < 16 for n in self.lengths):
            raise ConfigError(f"lengths: need at least one length, each >= 16, got {self.lengths}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ConfigError(f"depths: need fractions in [0, 1], got {self.depths}")
        for name in ("trials", "digits", "ppl_length", "ppl_buckets", "ppl_samples", "recall_windows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.needle.count("{key}") != 1:
            raise ConfigError(f"needle: must hold {{key}} once, got {self.needle!r}")
        if not self.question or not self.needle.startswith(self.question):
            raise ConfigError(f"question: must be a non-empty prefix of the needle {self.needle!r}, got {self.question!r}")
        if not self.attention or len(set(self.attention)) != len(self.attention):
            raise ConfigError(f"attention: one or more distinct modes of saved / dense / sparse, got {self.attention}")


# Mid-training's own defaults for the stages' Trainer and runtime (a plan's keys are merged over them).
TRAIN_DEFAULTS = {"micro_batch_size": 1, "checkpoint_interval": 100, "keep_last": 2, "eval_interval": 0,
                  "eval_samples": 16, "loss_chunk": 1024, "track_max_logit": False}
RUNTIME_DEFAULTS = {"sparse_impl": "gather", "activation_checkpointing": True}
STAGE_SETS = {"run_dir", "total_tokens", "max_steps", "init_from"}


@dataclass
class MidtrainPlan:
    stages: list[StageConfig] = field(default_factory=list)
    run_dir: str = "runs/midtrain"
    source: str = ""  # the pretraining run directory to continue (`--from` sets it)
    # One linear decay across the "decay" stages (GLM-5: 4e-5 -> 1e-5).
    lr_start: float = 4e-5
    lr_end: float = 1e-5
    batch_tokens: int = 64 * 2**20
    # Layer pattern once IndexShare is on, repeated over the layers (starts with "full").
    index_share_pattern: list[str] = field(default_factory=lambda: ["full", "shared"])
    source_has_dsa: bool = False  # the source model's indexers are already adapted
    # How each stage's Trainer runs: overrides of the source run's ``train`` section (TrainConfig keys; the
    # stage sets run_dir, total_tokens and max_steps itself) and of its ``runtime`` (RuntimeOptions keys).
    # Given keys are merged over these defaults.
    train: dict[str, Any] = field(default_factory=dict)
    runtime: dict[str, Any] = field(default_factory=dict)
    # Overrides of the source run's ``data`` section (DataConfig keys; each stage sets seq_len and seed),
    # e.g. other stores for long documents: ``sources`` and ``valid`` replace the source run's lists.
    data: dict[str, Any] = field(default_factory=dict)
    eval: LongEvalConfig = field(default_factory=LongEvalConfig)

    def __post_init__(self):
        if not self.stages:
            raise ConfigError("stages: the plan has no stages")
        if not 0 <= self.lr_end <= self.lr_start:
            raise ConfigError(f"lr_end: need 0 <= lr_end <= lr_start, got {self.lr_end} and {self.lr_start}")
        if self.batch_tokens < 1:
            raise ConfigError(f"batch_tokens: must be positive, got {self.batch_tokens}")
        self.train = {**TRAIN_DEFAULTS, **self.train}
        self.runtime = {**RUNTIME_DEFAULTS, **self.runtime}
        fixed = sorted(set(self.train) & STAGE_SETS)
        if fixed:
            raise ConfigError(f"train.{fixed[0]}: set by each stage, not by the plan")
        build(TrainConfig, self.train, "train")  # every key and value checked at load time
        build(RuntimeOptions, self.runtime, "runtime")
        if set(self.data) & {"seq_len", "seed"}:
            raise ConfigError(f"data.{sorted(set(self.data) & {'seq_len', 'seed'})[0]}: set by each stage, not by the plan")
        build(DataConfig, self.data, "data")
        if not self.index_share_pattern or self.index_share_pattern[0] != "full" or any(
                k not in ("full", "shared") for k in self.index_share_pattern):
            raise ConfigError(f"index_share_pattern: a list of 'full' / 'shared' starting with 'full', "
                              f"got {self.index_share_pattern}")
        if not any(s.lr_mode == "decay" for s in self.stages):
            raise ConfigError("stages: no stage has lr_mode 'decay'; the plan's LR decay has nowhere to run")
        self._check_stages_fit()

    def _check_stages_fit(self) -> None:
        names = set()
        dsa_ready = self.source_has_dsa
        shared_since = None
        for i, stage in enumerate(self.stages):
            where = f"stages[{i}]"
            if stage.name in names:
                raise ConfigError(f"{where}.name: {stage.name!r} names two stages")
            names.add(stage.name)
            if i and stage.seq_len < self.stages[i - 1].seq_len:
                raise ConfigError(f"{where}.seq_len: {stage.seq_len} is shorter than the previous stage's "
                                  f"{self.stages[i - 1].seq_len}; context length must not go down")
            if stage.dsa == "sparse" and not dsa_ready:
                raise ConfigError(f"{where}.dsa: 'sparse' before any DSA adaptation; an earlier stage (or this "
                                  f"one) must be dsa 'indexer_warmup', or set source_has_dsa")
            if stage.index_share:
                if not dsa_ready:
                    raise ConfigError(f"{where}.index_share: IndexShare before DSA exists; shared layers reuse "
                                      f"a top-k that only an adapted indexer gives (adapt in an earlier stage)")
                if stage.dsa == "off":
                    raise ConfigError(f"{where}.index_share: IndexShare on a dense (dsa 'off') stage selects nothing")
                shared_since = shared_since or stage.name
            elif shared_since is not None:
                raise ConfigError(f"{where}.index_share: turned off after stage {shared_since!r} turned it on; "
                                  f"the shared layers' indexers are gone")
            batch = stage.batch_tokens or self.batch_tokens
            if batch < stage.seq_len:
                raise ConfigError(f"{where}.batch_tokens: {batch} tokens per step hold no {stage.seq_len}-token sequence")
            if stage.dsa != "off":
                dsa_ready = True

    # ------------------------------------------------------------ derived
    def decay_tokens(self) -> int:
        return sum(s.tokens for s in self.stages if s.lr_mode == "decay")

    def lr_segment(self, index: int) -> tuple[float, float]:
        """(LR at the start, LR at the end) of stage ``index`` on the plan's linear decay."""
        total = self.decay_tokens()
        before = sum(s.tokens for s in self.stages[:index] if s.lr_mode == "decay")
        at = lambda t: self.lr_start * (1 - t / total) + self.lr_end * (t / total)
        stage = self.stages[index]
        if stage.lr_mode == "hold":
            return at(before), at(before)
        return at(before), at(before + stage.tokens)

    def rope_theta(self, index: int, pretrained: float) -> float:
        """The RoPE base in force at stage ``index``."""
        theta = pretrained
        for stage in self.stages[: index + 1]:
            if stage.rope_theta is not None:
                theta = stage.rope_theta
        return theta

    def indexer_types(self, num_layers: int) -> list[str]:
        pattern = self.index_share_pattern
        return [pattern[i % len(pattern)] for i in range(num_layers)]

    def check_against_model(self, model) -> None:
        """Checks that need the source model's config (run before any training)."""
        for i, stage in enumerate(self.stages):
            if stage.seq_len > model.max_position_embeddings:
                raise ConfigError(f"stages[{i}].seq_len: {stage.seq_len} exceeds the model's max_position_embeddings "
                                  f"({model.max_position_embeddings})")
        if any(s.index_share for s in self.stages):
            types = self.indexer_types(model.num_hidden_layers)
            if "shared" not in types:
                raise ConfigError(f"index_share_pattern: {self.index_share_pattern} over {model.num_hidden_layers} "
                                  f"layers shares nothing")
