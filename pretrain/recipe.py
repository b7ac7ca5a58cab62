"""The recipe: the typed config tree of a training run; configs/*.yaml fill it. Mid-training derives
its stages' recipes from it, and RL extends it with its own section (``orthon.rl.recipe``)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from orthon.data.config import BuiltinConfig, DataConfig
from orthon.core import config as config_io
from orthon.optim.ablation import AblationConfig
from orthon.optim.config import BatchRampConfig, OptimConfig, ScheduleConfig
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.train_config import TrainConfig


@dataclass
class SmokeConfig:
    """The few training steps of `orthon smoke` (plain AdamW on random tokens; the pretraining loop
    is `orthon pretrain`)."""

    steps: int = 5
    batch_size: int = 4
    seq_len: int = 64
    lr: float = 1e-3
    seed: int = 0


@dataclass
class MindSporeConfig:
    """Where the MindSpore backend runs (``backend: mindspore``; orthon.backends.mindspore)."""

    device_target: Literal["CPU", "Ascend", "GPU"] = "CPU"  # Ascend: 910B NPUs (mindspore.set_device)
    device_id: int = 0
    mode: Literal["pynative", "graph"] = "pynative"  # graph: the training step compiled (static shapes)


@dataclass
class MegatronOptions:
    """How the megatron-core model is built and laid out (``backend: megatron``; orthon.backends.megatron).
    Declared here, beside the recipe that holds it; the backend's code lives in orthon.backends.megatron."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # Model chunks a pipeline rank holds (megatron's interleaved 1F1B: each rank runs 1 / (PP x this) of the
    # layers this many times a micro-batch, which shrinks the pipeline's idle start and end by this factor).
    virtual_pipeline_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None  # None: tensor_parallel (megatron-core's default)
    transformer_engine: Literal["auto", "on", "off"] = "auto"  # auto: TE layers when transformer-engine imports
    # The parameters' dtype of a model built on its own (orthon.backends.megatron.build_model); a training run
    # keeps them fp32 and follows train.precision (bf16: autocast), as the torch backend does.
    params_dtype: Literal["bf16", "fp32"] = "bf16"
    # alltoall: megatron's default on GPUs; allgather: what runs on a CPU (chosen there whatever this says).
    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    moe_bias_rate: float = 1e-3  # megatron's own loop's expert-bias step (orthon's Trainer uses train.moe_bias_rate)
    seed: int = 1234
    # How a training run without train.init_from starts. "orthon": orthon's initial weights for the seed (the
    # torch backend's), converted: both backends start alike, but every rank draws the whole model first.
    # "megatron": megatron-core draws each rank's part (normal(0, initializer_range), as orthon's rule), so no
    # rank holds the whole model: what a cluster-sized model needs.
    init: Literal["orthon", "megatron"] = "orthon"


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    batch: BatchRampConfig = field(default_factory=BatchRampConfig)
    data: DataConfig = field(default_factory=DataConfig)
    builtin: BuiltinConfig = field(default_factory=BuiltinConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    # Which framework trains the model: "torch" (orthon.pretrain.trainer), "megatron" (the same Trainer over
    # megatron-core's GPTModel, laid out by the ``megatron`` section: orthon.backends.megatron.causal_lm) or
    # "mindspore" (orthon.backends.mindspore.trainer, placed by the ``mindspore`` section).
    backend: Literal["torch", "megatron", "mindspore"] = "torch"
    megatron: MegatronOptions = field(default_factory=MegatronOptions)
    mindspore: MindSporeConfig = field(default_factory=MindSporeConfig)


def load_recipe(path=None, overrides=()) -> Recipe:
    return config_io.load(Recipe, path, overrides)


def with_tokenizer_ids(recipe: Recipe, log=print) -> Recipe:
    """The recipe with the model's bos / eos / pad token ids its tokenizer's (``data.tokenizer``): its
    documents end in that eos, so it is the token generation stops at by default and the one config.json
    gives transformers. Without a tokenizer the recipe is returned as it is."""
    if not recipe.data.tokenizer:
        return recipe
    from orthon.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(recipe.data.tokenizer)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    changed = {k: v for k, v in ids.items() if getattr(recipe.model, k) != v}
    if not changed:
        return recipe
    log("model: " + ", ".join(f"{k} {getattr(recipe.model, k)} -> {v}" for k, v in changed.items())
        + f" (the tokenizer's, {recipe.data.tokenizer})")
    return replace(recipe, model=recipe.model.replace(**changed))
