"""What the one Trainer cannot yet run on megatron-core, refused by name before anything is built, and the
check that megatron's parallel groups tile the ranks."""
from __future__ import annotations

import math

import torch.distributed as dist

from orthon.backends.megatron.model import sizes_of
from orthon.core.errors import ConfigError


def check_recipe(recipe) -> None:
    """What the Trainer cannot yet run on megatron-core, refused before anything is built."""
    options, train = recipe.megatron, recipe.train
    sizes = sizes_of(options)
    if options.virtual_pipeline_parallel > 1 and sizes.pp == 1:
        raise ConfigError(f"megatron.virtual_pipeline_parallel = {options.virtual_pipeline_parallel}: model chunks "
                          f"interleave over pipeline stages; set megatron.pipeline_parallel > 1 too")
    if sizes.pp > 1 and recipe.model.tie_word_embeddings:
        raise ConfigError(f"megatron.pipeline_parallel = {sizes.pp} with model.tie_word_embeddings: the first and last "
                          f"stages' copies of the tied embedding are not kept equal yet; set megatron.pipeline_parallel=1")
    if recipe.data.seq_len % sizes.tp:
        raise ConfigError(f"data.seq_len = {recipe.data.seq_len}: sequence parallelism (megatron's, with "
                          f"megatron.tensor_parallel = {sizes.tp}) splits each sequence over the TP ranks; make it a "
                          f"multiple of {sizes.tp}")
    for name, value, plain in (("train.parallel", train.parallel, "ddp"), ("train.expert_parallel", train.expert_parallel, 1),
                               ("train.context_parallel", train.context_parallel, 1)):
        if value != plain:
            raise ConfigError(f"{name} = {value}: the megatron backend runs data parallel (DDP) with megatron's own tensor "
                              f"and expert parallelism (megatron.tensor_parallel, megatron.expert_parallel); set "
                              f"{name}={plain}")
    if recipe.runtime.sparse_attention:
        raise ConfigError("runtime.sparse_attention: the megatron backend runs dense MLA (pretraining's attention); "
                          "DSA (mid-training) runs on the torch backend")
    if recipe.data.document_mask:
        raise ConfigError("data.document_mask: megatron-core's local attention is plainly causal; packed documents "
                          "need transformer-engine's (not wired yet); set data.document_mask=false")


def check_world(sizes) -> None:
    """megatron's groups must tile the ranks: TP x PP divides the world, and so does EP x the experts' TP x PP."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    pp = ("megatron.pipeline_parallel", sizes.pp)
    for factors in ((("megatron.tensor_parallel", sizes.tp), pp),
                    (("megatron.expert_parallel", sizes.ep), ("the experts' tensor parallelism", sizes.expert_tp), pp)):
        named = [f for f in factors if f[1] > 1] or factors[:1]  # the sizes that split the model
        size = math.prod(n for _, n in named)
        if world % size:
            what = f"{' x '.join(name for name, _ in named)} = {' x '.join(str(n) for _, n in named)}"
            raise ConfigError(f"{what} does not divide the {world} rank{'s' if world > 1 else ''} (start it under "
                              f"orthon launch torchrun with a multiple of {size} processes)")
