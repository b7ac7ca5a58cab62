"""`orthon optim-plan -c recipe.yaml`: which optimizer updates each parameter, with its Muon Split blocks.

The model is built on the meta device (no weights allocated), so the full
GLM-5 plan prints in seconds. The routing options come from the recipe's
``optim`` section (orthon.optim.OptimConfig), overridable as usual:
``orthon optim-plan -c configs/glm5.yaml optim.head_to_muon=true``.
"""
from __future__ import annotations

import dataclasses

from orthon.core import config as config_io
from orthon.launch.args import add_recipe_args
from orthon.pretrain.recipe import Recipe
from orthon.optim.config import OptimConfig
from orthon.optim.hybrid import plan_for_model
from orthon.optim.routing import format_plan
from orthon.pretrain.model_info import meta_model


def register(parser, name):
    add_recipe_args(parser)


def load_model_and_optim(path, overrides):
    """The recipe's ModelConfig and OptimConfig (the optim section is read here if Recipe has none)."""
    mapping = config_io.apply_overrides(config_io.read_yaml(path) if path else {}, overrides)
    if any(f.name == "optim" for f in dataclasses.fields(Recipe)):
        recipe = config_io.build(Recipe, mapping)
        return recipe.model, recipe.optim
    optim = config_io.build(OptimConfig, mapping.pop("optim", None) or {}, "optim")
    return config_io.build(Recipe, mapping).model, optim


def run(args, name):
    model_config, optim_config = load_model_and_optim(args.config, args.overrides)
    plan = plan_for_model(meta_model(model_config), optim_config)
    print(format_plan(plan))
    return 0
