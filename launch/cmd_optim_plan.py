"""`orthon optim-plan -c recipe.yaml`: which optimizer updates each parameter, with its Muon Split blocks.

The model is built on the meta device (no weights allocated), so the full
GLM-5 plan prints in seconds. The routing options come from the recipe's
``optim`` section (orthon.optim.OptimConfig), overridable as usual:
``orthon optim-plan -c configs/glm5.yaml optim.head_to_muon=true``.
"""
from __future__ import annotations

from orthon.launch.args import add_recipe_args
from orthon.optim.hybrid import plan_for_model
from orthon.optim.routing import format_plan
from orthon.pretrain.model_info import meta_model
from orthon.pretrain.recipe import load_recipe


def register(parser, name):
    add_recipe_args(parser)


def run(args, name):
    recipe = load_recipe(args.config, args.overrides)
    print(format_plan(plan_for_model(meta_model(recipe.model), recipe.optim)))
    return 0
