"""A megatron model whose ranks hold parts of it (tensor, expert, pipeline parallelism) written as an orthon
weights directory one part of the model at a time (the embedding, each decoder layer, the final norm
with the head: ``convert.model_parts``): each part's pieces are gathered to rank 0, joined
(``parallel.merge``), converted and written as one safetensors file before the next part is gathered.
No process holds more than one part of the whole model (GLM-5's 744B parameters in fp32 would be 3 TB;
its largest part, a MoE layer, 39 GB), as the torch backend's ``pretrain.gathered_weights`` does for
FSDP2. Of the ranks holding the same piece (data-parallel replicas) the first sends it, the others
nothing."""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from orthon.backends.megatron.convert import megatron_to_orthon, model_parts
from orthon.backends.megatron.model import rank_key, stage_sizes
from orthon.backends.megatron.parallel import global_layer_name, layer_of, merge
from orthon.core.errors import CheckpointError
from orthon.pretrain import hf_io
from orthon.pretrain.gathered_weights import drain_on_error
from orthon.pretrain.model_info import meta_model
from orthon.pretrain.weights import writing_weights_dir


def part_index(name: str, layers: int) -> int:
    """The part (``convert.model_parts``' order) megatron's tensor ``name`` belongs to."""
    if name == "embedding.word_embeddings.weight":
        return 0
    layer = layer_of(name)
    return layers + 1 if layer is None else layer + 1


def _first_holder() -> bool:
    """Whether this rank is the first (lowest) of the ranks holding its piece of the model."""
    keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(keys, rank_key())
    return keys.index(rank_key()) == dist.get_rank()


def _all_keys(model) -> list[tuple[int, int, int]]:
    """Every (stage, tp, ep) shard key of the model's layout."""
    sizes = stage_sizes(model.options)
    return [(s, t, e) for s in range(sizes.pp) for t in range(sizes.tp) for e in range(sizes.ep)]


def save_gathered(model, directory, write: bool) -> None:
    """Write ``model`` (a MegatronCausalLM) as the weights directory ``directory``. A collective where the
    ranks hold parts of it: every rank calls it, the one that ``write``s (rank 0) gathers and writes. When
    its writing fails, it still takes part in the gathers left (no rank waits in a collective), then raises."""
    config, layout = model.config, model.gpt.orthon_layout
    parts = model_parts(config, layout)
    sends = _first_holder() if model.model_parallel else True
    by_part: list[dict] = [{} for _ in parts]  # {chunk's rank_key: {name: tensor}} of each part
    for key, state in model.local_states().items():
        stage = key[0]
        for name, tensor in state.items():
            index = part_index(global_layer_name(name, stage, model.layers_per_stage), config.num_hidden_layers)
            by_part[index].setdefault(key, {})[name] = tensor

    def load(index: int) -> dict[str, torch.Tensor] | None:
        mine = {key: {k: v.detach().cpu() for k, v in state.items()} for key, state in by_part[index].items()} if sends else {}
        if not model.model_parallel:
            return megatron_to_orthon(next(iter(mine.values()), {}), config, layout, maps=parts[index])
        gathered = [None] * dist.get_world_size() if write else None
        dist.gather_object(mine, gathered, dst=0)
        if not write:
            return None
        shards: dict = {}
        for states in gathered:  # the first holder's pieces (ranks in order)
            for key, state in states.items():
                shards.setdefault(key, state)
        for key in _all_keys(model):  # the chunks holding nothing of this part
            shards.setdefault(key, {})
        return megatron_to_orthon(merge(shards, config, stage_sizes(model.options), layout), config, layout,
                                  maps=parts[index])

    loaders = [partial(load, index) for index in range(len(parts))]
    if not write:
        if model.model_parallel:  # its part of every gather
            for load_part in loaders:
                load_part()
        return
    expected = {k: v.shape for k, v in meta_model(config, model.runtime).state_dict().items()}
    written: set[str] = set()

    def checked(load_part) -> dict[str, torch.Tensor]:
        part = load_part()
        for name, tensor in part.items():
            if name not in expected:
                raise CheckpointError(f"tensor {name}: not a tensor of the model")
            if tuple(tensor.shape) != tuple(expected[name]):
                raise CheckpointError(f"tensor {name}: shape {tuple(tensor.shape)} does not match the config's "
                                      f"{tuple(expected[name])}")
        written.update(part)
        return hf_io.to_hf(part)

    def write_all(parts_to_write):
        with writing_weights_dir(directory, model.runtime) as tmp:
            hf_io.write_hf_shards(tmp, [partial(checked, load_part) for load_part in parts_to_write],
                                  hf_io.config_with_dtype(config, next(model.parameters()).dtype))
            missing = sorted(set(expected) - written)
            if missing:
                raise CheckpointError(f"missing tensors ({len(missing)}): {missing[:8]}")
    drain_on_error(loaders, write_all)
