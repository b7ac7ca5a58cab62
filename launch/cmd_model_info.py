"""`orthon model-info -c recipe.yaml`: parameter counts without allocating weights."""
from __future__ import annotations

from orthon.launch.args import add_recipe_args
from orthon.pretrain.recipe import load_recipe
from orthon.pretrain.model_info import format_counts, parameter_counts


def register(parser, name):
    add_recipe_args(parser)


def run(args, name):
    recipe = load_recipe(args.config, args.overrides)
    print(format_counts(parameter_counts(recipe.model)))
    return 0
