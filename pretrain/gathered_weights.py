"""A weights directory written from the ranks' shards, one safetensors shard gathered at a time.

Where no rank holds the whole model (FSDP2, expert parallelism), gathering the full state dict on rank 0
puts the whole model in one process's memory, which GLM-5 (about 3 TB in fp32) does not fit. Here every
rank walks the model's tensors in the same order, a safetensors shard's worth at a time
(``max_shard_bytes`` of what is written): each sharded tensor (a DTensor) is all-gathered, every rank
taking part, rank 0 keeps a CPU copy, and the shard is written before the next one is gathered. Rank 0
holds one shard (an expert stack larger than that comes a few experts at a time: FSDP2 and expert
parallelism split it by expert rows); the other ranks one tensor at a time. The directory is the one ``save_weights`` writes
(the HF layout and the sidecar, swapped in whole), as ``orthon export --step`` writes it from a DCP
checkpoint. RL's weight sync streams the same parts to the engines (``gathered_parts``,
orthon.rl.weight_sync).
"""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

import orthon.pretrain.hf_io as hf_io
from orthon.pretrain.model import GLMForCausalLM
from orthon.pretrain.weights import writing_weights_dir


def gathered_parts(model: GLMForCausalLM, rank: int, part_bytes: int, dtype: torch.dtype | None = None,
                   split_experts: bool = False) -> list:
    """The model's persistent tensors in parts of about ``part_bytes`` (as written in ``dtype``; a larger
    tensor alone), as loaders: calling the i-th, on every rank in the same order (each all-gathers its
    sharded tensors), returns on rank 0 its {name: whole CPU tensor} in the model's names, elsewhere None.
    ``split_experts``: a routed-expert stack larger than a part, sharded by expert rows (FSDP2, expert
    parallelism, both, HSDP), comes in parts of whole experts under the HF layout's per-expert names,
    gathered a part at a time (``_expert_rows``); where there are such stacks, planning the parts is itself
    a collective (which rank holds which rows, once a stack)."""
    live = model.state_dict()  # FSDP2's and expert parallelism's parameters as DTensors: no communication
    sizes = {}
    for name in hf_io.persistent_names(model):
        tensor = live[name]
        nbytes = tensor.numel() * hf_io.written_dtype(name, tensor.dtype, dtype).itemsize
        if split_experts and nbytes > part_bytes and hf_io.is_expert_stack(name) and split_by_rows(tensor):
            holders = row_holders(tensor)
            windows = hf_io.expert_windows(name, tensor.shape[0], nbytes, part_bytes)
            sizes.update({(*window, holders): size for window, size in windows.items()})
        else:
            sizes[name] = nbytes
    # Whole source tensors otherwise: an expert stack that cannot be split stays in one part.
    return [partial(_gather, live, group, rank == 0) for group in hf_io.plan_shards(sizes, part_bytes)]


def drain_on_error(loaders: list, consume) -> None:
    """``consume(loaders)`` on rank 0, which calls them in order; when it fails, the loaders it did not
    reach are still called (the other ranks wait in their gathers), then the error is raised."""
    started = []

    def counted(load):
        started.append(load)
        return load()

    try:
        consume([partial(counted, load) for load in loaders])
    except BaseException:
        for load in loaders[len(started):]:
            load()
        raise


def save_gathered(model: GLMForCausalLM, directory, rank: int, *, dtype: torch.dtype | None = None,
                  max_shard_bytes: int = hf_io.DEFAULT_SHARD_BYTES, tokenizer=None) -> Path | None:
    """Write ``model`` (its parameters DTensors or plain, the same on every rank) as the weights directory
    ``directory``. A collective: every rank calls it; rank 0 writes and returns the path, the others
    return None. When rank 0's writing fails (a full disk, a foreign directory), rank 0 still takes part
    in the gathers left, so no rank waits in a collective, then raises."""
    loaders = gathered_parts(model, rank, max_shard_bytes, dtype, split_experts=True)
    if rank != 0:
        for load in loaders:
            load()
        return None
    head = hf_io.head_name(model.config)
    head_dtype = hf_io.written_dtype(head, model.get_parameter(head).dtype, dtype)

    def write(parts):
        with writing_weights_dir(directory, model.runtime, tokenizer) as tmp:
            hf_io.write_hf_shards(tmp, [lambda load=load: hf_io.to_hf(load(), dtype) for load in parts],
                                  hf_io.config_with_dtype(model.config, head_dtype))

    drain_on_error(loaders, write)
    return Path(os.path.abspath(directory))


def _gather(live: dict, items: list, keep: bool) -> dict[str, torch.Tensor] | None:
    """The tensors ``items`` (names, or (stack name, first, last, holders) expert windows) whole (a
    DTensor's all-gather is collective), CPU copies on the rank that ``keep``s them; None elsewhere."""
    out = {}
    for item in items:
        if isinstance(item, tuple):
            name, first, last, holders = item
            rows = _expert_rows(live[name].detach(), first, last, holders, keep)
            if keep:
                out.update(hf_io.stack_to_hf(name, rows, first))
            continue
        tensor = live[item].detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if keep:
            out[item] = tensor.cpu()
    return out if keep else None


def split_by_rows(tensor) -> bool:
    """A DTensor split by dim-0 rows only (each placement a shard of dim 0, FSDP2's strided shard of expert
    parallelism's among them, or Replicate): its rows can be gathered a window at a time."""
    # Read by their dim: FSDP2's shard of an already sharded tensor is a _StridedShard, not a Shard.
    return isinstance(tensor, DTensor) and tensor.dim() > 0 and all(
        p.is_replicate() or getattr(p, "dim", None) == 0 for p in tensor.placements)


def row_holders(tensor: DTensor) -> tuple[tuple[int, ...], ...]:
    """The global rows of ``tensor`` (``split_by_rows``) each rank holds, in its local order, by global rank (a
    collective): DTensor's own split of the row numbers, so any dim-0 placements."""
    ids = distribute_tensor(torch.arange(tensor.shape[0]), tensor.device_mesh, tensor.placements, src_data_rank=None)
    holders = [None] * dist.get_world_size()
    dist.all_gather_object(holders, tuple(ids.to_local().tolist()))
    return tuple(holders)


def _expert_rows(tensor: DTensor, first: int, last: int, holders, keep: bool) -> torch.Tensor | None:
    """Rows [first, last) of ``tensor`` (``split_by_rows``; ``holders``: ``row_holders``) whole on the rank
    that ``keep``s them (rank 0): each row from the lowest rank holding it (replicas: HSDP's, DDP's under
    expert parallelism, send nothing twice); point to point, every rank in the same order."""
    local = tensor.to_local()
    out = torch.empty((last - first, *tensor.shape[1:]), dtype=tensor.dtype) if keep else None
    me, sent = dist.get_rank(), set()
    for rank, rows in enumerate(holders):
        mine = [i for i, row in enumerate(rows) if first <= row < last and row not in sent]
        if not mine:
            continue
        sent.update(rows[i] for i in mine)
        where = [rows[i] - first for i in mine]
        if rank == me:
            if keep:
                out[where] = local[mine].cpu()
            else:
                dist.send(local[mine].contiguous(), dst=0)
        elif keep:
            received = torch.empty((len(mine), *tensor.shape[1:]), dtype=tensor.dtype, device=local.device)
            dist.recv(received, src=rank)
            out[where] = received.cpu()
    return out
