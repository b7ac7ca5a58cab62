"""A megatron-backend checkpoint resumed at another layout: other tensor, pipeline (virtual too), expert or
expert-tensor parallel sizes, on as many ranks as the new layout needs, the optimizer state carried (what
megatron's own distributed checkpoints do).

A checkpoint names each rank's piece of a tensor by the whole model (``MegatronCausalLM.checkpoint_names``:
layers and experts by their number in the model, a tensor-parallel piece as ``name@tp<r>``). So a rank of the
new layout finds, for each tensor it holds (a weight, or a parameter's optimizer state: Muon's momentum,
AdamW's moments), the pieces the old layout wrote, joins them (``parallel.join``) and cuts its own piece by
the new layout (``parallel.split``); a scalar (AdamW's step) is the same on every piece. Each rank reads
only the tensors it holds, a batch of about ``BATCH_BYTES`` at a time and on its own (DCP without
collectives: the ranks need different numbers of batches), so no rank holds more than its share of the
model and one batch. The param groups stay this run's (the schedule sets their rates every step)."""
from __future__ import annotations

import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from orthon.backends.megatron.checkpoint_export import PREFIX, carried_names, stored_keys
from orthon.backends.megatron.convert import megatron_shapes
from orthon.backends.megatron.model import sizes_of
from orthon.backends.megatron.parallel import _expert_key, join, split, split_rule
from orthon.core.errors import CheckpointError

BATCH_BYTES = 1 << 30
_PIECE = re.compile(r"^(.*)@tp(\d+)$")


def _canonical(name: str, carried_keys: dict[str, str]) -> tuple[str, int | None]:
    """(megatron's whole-model name, tensor-parallel piece or None) of a checkpoint name of this rank's
    (``gpt.<name>[@tp<r>]``, ``carried.<name>``, or a one-stage run's ``carried.t<i>``: ``carried_keys``)."""
    if name.startswith("carried."):
        key = name.removeprefix("carried.")
        return carried_keys.get(key, key), None
    m = _PIECE.match(name.removeprefix("gpt."))
    return (m[1], int(m[2])) if m else (name.removeprefix("gpt."), None)


def _parse(key: str) -> tuple[str, str, str]:
    """(prefix, checkpoint name, suffix) of a flattened key: ``model.<name>`` or ``optim.state.<name>.<entry>``."""
    if key.startswith("optim.state."):
        name, entry = key.removeprefix("optim.state.").rsplit(".", 1)
        return "optim.state.", name, "." + entry
    return PREFIX, key.removeprefix(PREFIX), ""


def rebuild(model, targets: dict[str, torch.Tensor], path, stored) -> None:
    """Fill ``targets`` ({flattened checkpoint key of this rank's, as the new layout names it: its tensor}) in
    place from the pieces the checkpoint at ``path`` holds of each (``stored``: its metadata's
    ``state_dict_metadata``); ``model``: the MegatronCausalLM."""
    layout = model.gpt.orthon_layout
    carried = carried_names(stored, megatron_shapes(model.config, model.runtime, layout))
    carried_keys = model.carried_by_key
    sizes = sizes_of(model.options)
    plans = []  # (target, whole-model name, piece, stored keys)
    for key, target in targets.items():
        prefix, name, suffix = _parse(key)
        whole, piece = _canonical(name, carried_keys)
        plans.append((target, whole, piece, stored_keys(whole, stored, carried, prefix, suffix)))
    batch, size = [], 0
    for plan in plans:
        batch.append(plan)
        size += sum(stored[k].size.numel() * stored[k].properties.dtype.itemsize for k in plan[3])
        if size >= BATCH_BYTES or plan is plans[-1]:
            _fill(batch, stored, path, layout, sizes)
            batch, size = [], 0


def _fill(batch: list, stored, path, layout, sizes) -> None:
    read = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for plan in batch for k in plan[3]}
    dcp.load(read, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    for target, whole, piece, keys in batch:
        pieces = [read[k] for k in keys]
        rule = split_rule(whole, layout)
        full = pieces[0] if pieces[0].dim() == 0 else join(pieces, rule, whole)
        mine = full if piece is None or full.dim() == 0 else split(
            full, rule, sizes.expert_tp if _expert_key(whole) else sizes.tp)[piece]
        if mine.shape != target.shape:
            raise CheckpointError(f"{path}: {whole} rebuilt as {tuple(mine.shape)}, this rank holds {tuple(target.shape)}")
        target.copy_(mine)
