"""`orthon model-info -c recipe.yaml [--ranks N]`: parameter counts without allocating weights, the
training FLOPs a token at the recipe's sequence length (orthon.pretrain.flops: dense and, where DSA
selects, sparse), and with ``--ranks`` one rank's share of the training state under the recipe's train.parallel,
train.fsdp_shard_ranks and train.expert_parallel (what the memory check weighs against a GPU's memory)."""
from __future__ import annotations

from orthon.launch.args import add_recipe_args
from orthon.pretrain.recipe import load_recipe
from orthon.pretrain.flops import ModelFlops
from orthon.pretrain.model_info import format_counts, format_rank_share, parameter_counts


def register(parser, name):
    add_recipe_args(parser)
    parser.add_argument("--ranks", type=int, default=0,
                        help="also print one rank's share of the training state when training on this many ranks")


def run(args, name):
    recipe = load_recipe(args.config, args.overrides)
    counts = parameter_counts(recipe.model)
    print(format_counts(counts))
    n = recipe.data.seq_len
    flops = ModelFlops.of(recipe.model)
    sparse = f", {flops.per_token(n, sparse=True) / 1e9:,.3f} with DSA" if n > recipe.model.index_topk else ""
    print(f"training FLOPs a token at {n:,} tokens (data.seq_len): {flops.per_token(n) / 1e9:,.3f} GFLOP dense{sparse} "
          f"(6 per active matrix parameter: {6 * flops.matmul_parameters / 1e9:,.3f}; the rest attention)")
    if args.ranks:
        from orthon.pretrain.expert_parallel import check_degree

        check_degree(recipe.train.expert_parallel, args.ranks, recipe.model.n_routed_experts)
        print(format_rank_share(counts, args.ranks, recipe.train))
    return 0
