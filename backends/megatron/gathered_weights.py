"""A megatron model whose ranks hold parts of it (tensor, expert, pipeline parallelism) in parts of about a
given size, each gathered to one rank: ``final/`` written a safetensors shard at a time, and RL's weight
syncs streamed to the engines a part at a time or as each rank's delta of the parts it keeps
(orthon.rl.weight_sync), as the torch backend's ``pretrain.gathered_weights`` does for FSDP2's shards.

A part is a run of ``convert.model_parts``' tensor maps (the embedding, each decoder layer's tensors, the
final norm with the head) of at most the size asked for; a routed-expert stack larger than that comes as
windows of whole experts, each under its row piece's name (``hf_io.row_piece_name``: experts a..b-1 of
orthon's stack), which ``hf_io.experts_to_hf`` turns into those experts' HF tensors. Loading a part, every
rank sends the pieces it holds of the part's megatron tensors to the part's owner (the first of the ranks
holding the same piece: data-parallel replicas send nothing twice), which joins them (``parallel.merge``)
and converts them to orthon's names. No process holds more than a part of the whole model (GLM-5's 744B
parameters in fp32 would be 3 TB; one of its MoE layers 39 GB)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist

from orthon.backends.megatron.convert import _Map, megatron_shapes, megatron_to_orthon, model_parts
from orthon.backends.megatron.model import rank_key, stage_sizes
from orthon.backends.megatron.parallel import global_expert_name, global_layer_name, layer_of, merge
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


@dataclass(frozen=True)
class _Window:
    """Experts ``first`` .. ``last - 1`` of an "experts" map (``map``: those experts' megatron tensors)."""

    map: _Map
    first: int
    last: int


def pipeline_rank_of(mp: _Map, model) -> int:
    """The pipeline rank holding the tensors of map ``mp``: the embedding the first, the final norm and head
    the last, a decoder layer the rank of its stage (with a virtual pipeline, stage s on rank s mod PP)."""
    pp = model.options.pipeline_parallel
    layer = layer_of(mp.megatron[0])
    if layer is None:
        return 0 if mp.megatron[0].startswith("embedding.") else pp - 1
    return layer // model.layers_per_stage % pp


def plan(model, part_bytes: int, pipeline_rank: int | None = None) -> list[list]:
    """The model's tensor maps (and expert windows) in parts of at most ``part_bytes`` (a larger map alone);
    ``pipeline_rank``: only those that rank holds."""
    config, layout = model.config, model.gpt.orthon_layout
    shapes = megatron_shapes(config, model.runtime, layout)
    itemsize = next(model.parameters()).element_size()
    sizes = {}
    for mp in (mp for part in model_parts(config, layout) for mp in part):
        if pipeline_rank is not None and pipeline_rank_of(mp, model) != pipeline_rank:
            continue
        nbytes = sum(shapes[n].numel() for n in mp.megatron) * itemsize
        if mp.kind != "experts" or nbytes <= part_bytes:
            sizes[mp] = nbytes
            continue
        experts = len(mp.megatron)
        step = max(1, part_bytes // (nbytes // experts))
        for first in range(0, experts, step):
            last = min(first + step, experts)
            sizes[_Window(replace(mp, megatron=mp.megatron[first:last]), first, last)] = nbytes // experts * (last - first)
    return hf_io.plan_shards(sizes, part_bytes)


def _first_holder() -> bool:
    """Whether this rank is the first (lowest) of the ranks holding its piece of the model."""
    keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(keys, rank_key())
    return keys.index(rank_key()) == dist.get_rank()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class _Pieces:
    """This rank's tensors of the model by their megatron names in the whole model: {name: (chunk's
    ``rank_key``, name on the chunk, tensor)}."""

    def __init__(self, model):
        sizes = stage_sizes(model.options)
        per_ep = model.config.n_routed_experts // sizes.ep if model.config.has_moe else 0
        self.by_name = {}
        for key, state in model.local_states().items():
            for local, tensor in state.items():
                name = global_expert_name(local, key[2], per_ep, model.gpt.orthon_layout) or local
                self.by_name[global_layer_name(name, key[0], model.layers_per_stage)] = (key, local, tensor)

    def of(self, names) -> dict:
        """{chunk key: {name on the chunk: CPU copy}} of the tensors of ``names`` this rank holds."""
        out: dict = {}
        for name in names:
            if name in self.by_name:
                key, local, tensor = self.by_name[name]
                out.setdefault(key, {})[local] = tensor.detach().cpu()
        return out


def _merged(model, pieces: _Pieces, names: list[str], owner: int, sends: bool, group=None) -> dict | None:
    """megatron's whole tensors ``names`` on rank ``owner`` (None elsewhere): the pieces of the ranks of
    ``group`` (default: all) gathered there."""
    if not model.model_parallel:  # every rank holds the whole model: the owner reads its own
        return {name: tensor for state in pieces.of(names).values() for name, tensor in state.items()} \
            if _rank() == owner else None
    mine = pieces.of(names) if sends else {}
    gathered = [None] * dist.get_world_size(group) if _rank() == owner else None
    dist.gather_object(mine, gathered, dst=owner, group=group)
    if gathered is None:
        return None
    sizes = stage_sizes(model.options)
    shards: dict = {(s, t, e): {} for s in range(sizes.pp) for t in range(sizes.tp) for e in range(sizes.ep)}
    for states in gathered:  # one holder's pieces each (the first of its replicas)
        for key, state in states.items():
            shards[key].update(state)
    return merge(shards, model.config, sizes, model.gpt.orthon_layout)


def _load(model, pieces: _Pieces, items: list, owner: int, sends: bool, expected: dict, group=None) -> dict | None:
    """One part in orthon's names on rank ``owner`` (expert windows as row pieces of their stacks)."""
    merged = _merged(model, pieces, [n for item in items for n in _map(item).megatron], owner, sends, group)
    if merged is None:
        return None
    out = {}
    for item in items:
        mp = _map(item)
        for name, tensor in megatron_to_orthon({n: merged[n] for n in mp.megatron if n in merged}, model.config,
                                               model.gpt.orthon_layout, maps=[mp]).items():
            want = expected[name]
            if isinstance(item, _Window):
                want = (item.last - item.first, *want[1:])
                name = hf_io.row_piece_name(name, item.first, item.last)
            if tuple(tensor.shape) != tuple(want):
                raise CheckpointError(f"tensor {name}: shape {tuple(tensor.shape)} does not match the config's {tuple(want)}")
            out[name] = tensor
    return out


def _map(item) -> _Map:
    return item.map if isinstance(item, _Window) else item


def weight_parts(model, part_bytes: int, owner=lambda i: 0, pipeline_rank: int | None = None, group=None) -> list:
    """The model (a MegatronCausalLM) in parts of about ``part_bytes`` as loaders: calling the i-th, on every
    rank in the same order (a collective where the ranks hold parts of the model), returns on rank
    ``owner(i)`` that part, {orthon name or expert window's row piece: CPU tensor}, elsewhere None.
    ``pipeline_rank``: only the parts that pipeline rank holds, gathered over ``group`` (its ranks)."""
    sends = _first_holder() if model.model_parallel else True
    pieces = _Pieces(model)
    expected = {k: v.shape for k, v in meta_model(model.config, model.runtime).state_dict().items()}
    return [partial(_load, model, pieces, items, owner(i), sends, expected, group)
            for i, items in enumerate(plan(model, part_bytes, pipeline_rank))]


def whole_state(model, owner: int = 0) -> dict | None:
    """The whole model in orthon's names on rank ``owner`` (None elsewhere), gathered as one part: for an
    in-process engine or a test, never for what must scale (``weight_parts``)."""
    (load,) = weight_parts(model, WHOLE, owner=lambda i: owner)
    return load()


WHOLE = 1 << 62  # a part size no model reaches: the whole model in one part


@dataclass
class StageLoaders:
    """This rank's pipeline ``stage``'s parts as loaders (called by the stage's ranks together, each part
    gathered within the stage to its ``leader``, its lowest rank) and whether this rank leads it."""

    stage: int
    stages: int
    loaders: list
    leader: bool


def stage_parts(model, part_bytes: int) -> StageLoaders | None:
    """With pipeline stages (None without), this rank's stage's parts of about ``part_bytes``: the stages
    gather side by side, each over a process group of its own ranks (formed once, every rank together)."""
    from megatron.core import parallel_state

    if model.options.pipeline_parallel == 1 or not dist.is_initialized():
        return None
    stage = parallel_state.get_pipeline_model_parallel_rank()
    if getattr(model, "_stage_groups", None) is None:  # new_group is a collective of every rank, in one order
        model._stage_groups = [(ranks, dist.new_group(ranks)) for ranks in _stage_ranks(stage)]
    ranks, group = model._stage_groups[stage]
    loaders = weight_parts(model, part_bytes, owner=lambda i: ranks[0], pipeline_rank=stage, group=group)
    return StageLoaders(stage, len(model._stage_groups), loaders, _rank() == ranks[0])


def _stage_ranks(stage: int) -> list[list[int]]:
    """The ranks of each pipeline stage, in stage order (every rank says its own)."""
    stages: list = [None] * dist.get_world_size()
    dist.all_gather_object(stages, stage)
    return [[r for r, s in enumerate(stages) if s == k] for k in range(max(stages) + 1)]


def save_gathered(model, directory, write: bool, max_shard_bytes: int = hf_io.DEFAULT_SHARD_BYTES) -> None:
    """Write ``model`` (a MegatronCausalLM) as the weights directory ``directory``, a safetensors shard of
    about ``max_shard_bytes`` at a time. A collective where the ranks hold parts of it: every rank calls it,
    the one that ``write``s (rank 0) gathers and writes. When its writing fails, it still takes part in the
    gathers left (no rank waits in a collective), then raises."""
    loaders = weight_parts(model, max_shard_bytes)
    if not write:
        for load in loaders:  # its part of every gather (nothing where it holds the whole model)
            load()
        return

    def write_all(parts):
        with writing_weights_dir(directory, model.runtime) as tmp:
            hf_io.write_hf_shards(tmp, [lambda load=load: hf_io.to_hf(load()) for load in parts],
                                  hf_io.config_with_dtype(model.config, next(model.parameters()).dtype))
    drain_on_error(loaders, write_all)
