"""Distributed Muon: the ranks of a data-parallel group share the Newton-Schulz work.

Every rank holds the same gradients (DDP all-reduces them; FSDP2
reduce-scatters them into shards), so every rank could orthogonalise every
matrix, and with plain DDP each one would. Instead each parameter gets one
owner rank, balanced by Newton-Schulz FLOPs (longest job first onto the
least loaded rank), and the step runs in three phases:

1. gather: for FSDP2-sharded (DTensor ``Shard(dim)``) parameters, every rank
   sends its shard of the update to the owner, which assembles the full
   matrix (replicated DDP parameters need nothing: the owner has it all);
2. compute: each rank orthogonalises the parameters it owns, same-shaped
   blocks batched, all ranks at once;
3. return: the owner broadcasts a replicated parameter's result, and
   scatters a sharded one's back so each rank gets the slice of its shard.

A parameter whose piece on each rank is whole matrices (an expert stack split by expert: expert
parallelism, or FSDP2's Shard(0) of an expert stack) needs none of this: each rank
orthogonalises its own piece.

Updates travel in the Newton-Schulz dtype (bf16 by default) both ways:
Newton-Schulz casts to it first anyway, so the input is the same as on one
rank, and the traffic is halved; results come back rounded to it on every
rank, the owner included, so the ranks' weights stay equal. Collectives are
plain torch.distributed (gloo on CPU, NCCL on GPU); every rank must step the
same parameters in the same order, which DDP and FSDP2 guarantee.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from orthon.optim.muon import MatrixWork, orthogonalise_local
from orthon.optim.gram_newton_schulz import block_flops


def assign_owners(costs: list[float], world_size: int) -> list[int]:
    """Owner rank per job: longest first, each onto the least loaded rank (ties: lower index, lower rank)."""
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk(length, parts)`` padded with zeros to ``parts`` entries (DTensor Shard layout)."""
    step = math.ceil(length / parts)
    return [max(0, min(step, length - k * step)) for k in range(parts)]


@dataclasses.dataclass
class _Shards:
    """How a sharded parameter's rows (along ``dim``) are split among the ranks."""

    dim: int
    shapes: list[tuple[int, ...]]  # each rank's local shape

    def numel(self, rank: int) -> int:
        return math.prod(self.shapes[rank])


def _is_hybrid(param: Tensor) -> bool:
    """A DTensor of HSDP's (replicas, shards) mesh: copies along the first dim, sharded along the second."""
    return (isinstance(param, DTensor) and param.device_mesh.ndim == 2 and param.placements[0].is_replicate()
            and param.placements[1].is_shard())


def hybrid_shard_group(params) -> dist.ProcessGroup | None:
    """The shard group of HSDP parameters among ``params`` (None: none are): the orthogonaliser's group,
    within which the owners gather and return the matrices; each replica group does the same work."""
    for param in params:
        if _is_hybrid(param):
            return param.device_mesh.get_group(1)
    return None


def _shard_layout(item: MatrixWork, world: int, name: str) -> _Shards:
    param = item.param
    assert isinstance(param, DTensor)
    mesh = param.device_mesh
    hybrid = _is_hybrid(param)
    if (mesh.ndim != 1 and not hybrid) or mesh.size(mesh.ndim - 1) != world:
        raise RuntimeError(
            f"distributed Muon: {name} is sharded over a {tuple(mesh.shape)} mesh; only a 1-D mesh over the "
            f"data-parallel group ({world} ranks) or HSDP's (replicas, {world}) mesh is supported"
        )
    placement = param.placements[-1]
    if not placement.is_shard():
        raise RuntimeError(f"distributed Muon: {name} has placement {placement}, expected Shard(dim)")
    dim = placement.dim % len(item.global_shape)
    shapes = []
    for size in chunk_sizes(item.global_shape[dim], world):
        shape = list(item.global_shape)
        shape[dim] = size
        shapes.append(tuple(shape))
    mesh_rank = mesh.get_local_rank(mesh.ndim - 1)
    if tuple(item.update.shape) != shapes[mesh_rank]:
        raise RuntimeError(
            f"distributed Muon: {name} has local shard {tuple(item.update.shape)}, "
            f"expected {shapes[mesh_rank]} for Shard({dim}) over {world} ranks"
        )
    return _Shards(dim, shapes)


class DistributedOrthogonaliser:
    """Muon's ``orthogonaliser`` for data parallelism over ``group`` (default: the world; under HSDP the
    shard group, ``hybrid_shard_group``)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.last_owners: list[int] = []  # per item of the last step, for inspection and tests

    def __call__(self, work: list[MatrixWork], ns: Callable[[Tensor, MatrixWork], Tensor]) -> list[Tensor]:
        if any(item.local for item in work):  # whole matrices of this rank's own: orthogonalised here
            results: list[Tensor | None] = [None] * len(work)
            parts = ([i for i, item in enumerate(work) if item.local], [i for i, item in enumerate(work) if not item.local])
            for indices, run in zip(parts, (orthogonalise_local, self)):
                for i, out in zip(indices, run([work[i] for i in indices], ns) if indices else []):
                    results[i] = out
            return results  # type: ignore[return-value]
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        if world == 1:
            return orthogonalise_local([dataclasses.replace(w, sharded=False) for w in work], ns)
        costs = [item.num_blocks * block_flops(*item.block_shape, item.ns_key[0], item.ns_key[4], item.ns_key[5],
                                               item.update.device) for item in work]
        owners = assign_owners(costs, world)
        self.last_owners = owners
        names = [f"parameter {i} of shape {w.global_shape}" for i, w in enumerate(work)]
        layouts = {i: _shard_layout(w, world, names[i]) for i, w in enumerate(work) if w.sharded}
        comm_dtype = {i: w.ns_key[3] for i, w in enumerate(work)}

        # 1. gather full updates of sharded parameters onto their owners
        full: dict[int, Tensor] = {}
        for owner in range(world):
            mine = [i for i in range(len(work)) if owners[i] == owner and i in layouts]
            for dtype, items in _by_dtype(mine, comm_dtype).items():
                full.update(self._gather(work, items, layouts, owner, rank, world, dtype))

        # 2. orthogonalise what this rank owns
        owned = [i for i in range(len(work)) if owners[i] == rank]
        inputs = [
            dataclasses.replace(work[i], update=full[i] if i in layouts else work[i].update, sharded=False)
            for i in owned
        ]
        results: list[Tensor | None] = [None] * len(work)
        for i, out in zip(owned, orthogonalise_local(inputs, ns)):
            results[i] = out

        # 3. hand results back: broadcast replicated ones, scatter sharded ones
        for owner in range(world):
            mine = [i for i in range(len(work)) if owners[i] == owner]
            for dtype, items in _by_dtype(mine, comm_dtype).items():
                replicated = [i for i in items if i not in layouts]
                sharded = [i for i in items if i in layouts]
                if replicated:
                    self._broadcast(work, results, replicated, owner, rank, dtype)
                if sharded:
                    self._scatter(work, results, sharded, layouts, owner, rank, world, dtype)
        return results  # type: ignore[return-value]

    def _gather(self, work, items, layouts, owner, rank, world, dtype) -> dict[int, Tensor]:
        lengths = [sum(layouts[i].numel(k) for i in items) for k in range(world)]
        device = work[items[0]].update.device
        send = torch.zeros(max(lengths), dtype=dtype, device=device)
        torch.cat([work[i].update.reshape(-1).to(dtype) for i in items], out=send[: lengths[rank]])
        receive = [torch.empty_like(send) for _ in range(world)] if rank == owner else None
        dist.gather(send, receive, group=self.group, group_dst=owner)
        if rank != owner:
            return {}
        out, offsets = {}, [0] * world
        for i in items:
            pieces = []
            for k in range(world):
                n = layouts[i].numel(k)
                pieces.append(receive[k][offsets[k]: offsets[k] + n].reshape(layouts[i].shapes[k]))
                offsets[k] += n
            out[i] = torch.cat(pieces, dim=layouts[i].dim)
        return out

    def _broadcast(self, work, results, items, owner, rank, dtype) -> None:
        device = work[items[0]].update.device
        if rank == owner:
            flat = torch.cat([results[i].reshape(-1).to(dtype) for i in items])
        else:
            flat = torch.empty(sum(work[i].update.numel() for i in items), dtype=dtype, device=device)
        dist.broadcast(flat, group=self.group, group_src=owner)
        # The owner takes the rounded copy too: where Newton-Schulz computed in a wider dtype than the one
        # results travel in (Gram in fp32 on a CPU without a bf16 GEMM), every rank applies the same update.
        offset = 0
        for i in items:
            n = work[i].update.numel()
            results[i] = flat[offset: offset + n].reshape(work[i].update.shape)
            offset += n

    def _scatter(self, work, results, items, layouts, owner, rank, world, dtype) -> None:
        lengths = [sum(layouts[i].numel(k) for i in items) for k in range(world)]
        device = work[items[0]].update.device
        receive = torch.empty(max(lengths), dtype=dtype, device=device)
        chunks = None
        if rank == owner:
            chunks = []
            for k in range(world):
                buf = torch.zeros(max(lengths), dtype=dtype, device=device)
                pieces = [_slice_of(results[i], layouts[i], k).reshape(-1) for i in items]
                if pieces and lengths[k]:
                    torch.cat(pieces, out=buf[: lengths[k]])
                chunks.append(buf)
        dist.scatter(receive, chunks, group=self.group, group_src=owner)
        offset = 0
        for i in items:
            n = layouts[i].numel(rank)
            results[i] = receive[offset: offset + n].reshape(layouts[i].shapes[rank])
            offset += n


def _slice_of(full: Tensor, layout: _Shards, rank: int) -> Tensor:
    start = sum(shape[layout.dim] for shape in layout.shapes[:rank])
    return full.narrow(layout.dim, start, layout.shapes[rank][layout.dim])


def _by_dtype(items: list[int], dtypes: dict[int, torch.dtype]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i in items:
        groups.setdefault(dtypes[i], []).append(i)
    return groups
