"""The recipe: one typed config tree for every orthon command; configs/*.yaml fill it."""
from __future__ import annotations

from dataclasses import dataclass, field

from orthon.data.config import BuiltinConfig, DataConfig
from orthon.launch import config as config_io
from orthon.optim.ablation import AblationConfig
from orthon.optim.config import BatchRampConfig, OptimConfig, ScheduleConfig
from orthon.pretrain.config import ModelConfig
from orthon.pretrain.train_config import TrainConfig
from orthon.rl.train_config import RLConfig


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
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    batch: BatchRampConfig = field(default_factory=BatchRampConfig)
    data: DataConfig = field(default_factory=DataConfig)
    builtin: BuiltinConfig = field(default_factory=BuiltinConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    rl: RLConfig = field(default_factory=RLConfig)


def load_recipe(path=None, overrides=()) -> Recipe:
    return config_io.load(Recipe, path, overrides)


def add_recipe_args(parser) -> None:
    parser.add_argument("-c", "--config", help="YAML recipe (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.hidden_size=512")
