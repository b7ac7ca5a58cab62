"""The RL recipe: the training recipe (optimizer, schedule, run settings) plus the ``rl:`` section."""
from __future__ import annotations

from dataclasses import dataclass, field

from orthon.core import config as config_io
from orthon.pretrain.recipe import Recipe
from orthon.rl.train_config import RLConfig


@dataclass
class RLRecipe(Recipe):
    rl: RLConfig = field(default_factory=RLConfig)


def load_rl_recipe(path=None, overrides=()) -> RLRecipe:
    return config_io.load(RLRecipe, path, overrides)
