"""`orthon model-info -c recipe.yaml [--ranks N]`: parameter counts without allocating weights, and with
``--ranks`` one rank's share of the training state under the recipe's train.parallel,
train.fsdp_shard_ranks and train.expert_parallel (what the memory check weighs against a GPU's memory)."""
from __future__ import annotations

from orthon.launch.args import add_recipe_args
from orthon.pretrain.recipe import load_recipe
from orthon.pretrain.model_info import format_counts, format_rank_share, parameter_counts


def register(parser, name):
    add_recipe_args(parser)
    parser.add_argument("--ranks", type=int, default=0,
                        help="also print one rank's share of the training state when training on this many ranks")


def run(args, name):
    recipe = load_recipe(args.config, args.overrides)
    counts = parameter_counts(recipe.model)
    print(format_counts(counts))
    if args.ranks:
        from orthon.pretrain.expert_parallel import check_degree

        check_degree(recipe.train.expert_parallel, args.ranks, recipe.model.n_routed_experts)
        print(format_rank_share(counts, args.ranks, recipe.train))
    return 0
