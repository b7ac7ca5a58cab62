"""The RL recipe: the training recipe (optimizer, schedule, run settings) plus the ``rl:`` section.

RL's defaults differ from pretraining's where RL differs: AdamW on every parameter without weight
decay at a constant 2e-5 (the optimizer is the same builder, so ``optim.algorithm: muon`` works too),
a schedule that counts optimizer steps (rl.iterations x rl.updates_per_iteration unless given), and
the run settings of a short run."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from orthon.core import config as config_io
from orthon.core.errors import CheckpointError, ConfigError
from orthon.optim.config import OptimConfig, ScheduleConfig
from orthon.pretrain.recipe import Recipe
from orthon.pretrain.train_config import TrainConfig
from orthon.rl.config import SFTConfig
from orthon.rl.train_config import RLConfig


@dataclass
class RLRecipe(Recipe):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(algorithm="adamw", adamw_weight_decay=0.0,
                                                                   weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(peak_lr=2e-5, floor_lr=2e-5,
                                                                            warmup_tokens=0, total_tokens=1))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        run_dir="runs/rl", micro_batch_size=64, checkpoint_interval=10, keep_last=2, track_max_logit=False,
        progress_label="rl", builtin_dir=""))
    rl: RLConfig = field(default_factory=RLConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def __post_init__(self):
        steps = self.rl.iterations * self.rl.updates_per_iteration
        if not self.schedule.total_steps:
            if self.schedule.warmup_steps >= steps:
                raise ConfigError(f"schedule.warmup_steps: {self.schedule.warmup_steps} is not below the run's "
                                  f"{steps} optimizer steps")
            self.schedule = replace(self.schedule, total_steps=steps)


def load_rl_recipe(path=None, overrides=()) -> RLRecipe:
    return config_io.load(RLRecipe, path, overrides)


def source_tokenizer(source) -> str:
    """The tokenizer of the model in run directory ``source`` (pretraining, mid-training, RL, distillation
    or a post-training stage): its config's data.tokenizer, or, for an RL run that did not record it,
    that of the run it started from (source.txt)."""
    config = Path(source) / "config.yaml"
    if not config.is_file():
        raise CheckpointError(f"{source}: no config.yaml (not a run directory)")
    tokenizer = load_rl_recipe(config).data.tokenizer  # reads pretraining recipes too
    if tokenizer:
        return tokenizer
    origin = Path(source) / "source.txt"
    if origin.is_file():
        return source_tokenizer(origin.read_text().strip())
    raise ConfigError(f"{config} names no tokenizer (data.tokenizer): give data.tokenizer=PATH")
