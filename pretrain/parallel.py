"""Data parallelism for the model: DDP or FSDP2 wrapping and gradient-sync control (the process group
and collectives are ``orthon.core.distributed``)."""
from __future__ import annotations

import inspect
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from orthon.core.distributed import is_distributed
from orthon.core.errors import ConfigError
from orthon.optim.muon import shard_placements
from orthon.pretrain.expert_parallel import shard_over_replicas


HSDP_MESH_DIMS = ("fsdp_replicas", "fsdp_shards")


def check_shard_ranks(shard_ranks: int, world: int) -> None:
    """HSDP's groups (train.fsdp_shard_ranks; 0: none) must divide the world size."""
    if shard_ranks and world % shard_ranks:
        raise ConfigError(f"train.fsdp_shard_ranks = {shard_ranks} does not divide the {world} ranks")


def wrap(model: nn.Module, mode: str, expert_mesh=None, shard_ranks: int = 0,
         param_dtype: torch.dtype | None = None, group=None) -> nn.Module:
    """DDP, or FSDP2 (fully_shard each DSA indexer, each decoder layer, then the root); the model itself when alone.
    ``expert_mesh``: the model is expert-parallel (orthon.pretrain.expert_parallel): DDP leaves the expert
    stacks alone, FSDP2 shards each Experts module over its mesh column first. ``shard_ranks``: FSDP2 as
    HSDP, sharded within groups of that many consecutive ranks, replicated across them (0: all ranks).
    ``param_dtype``: FSDP2 gathers the parameters in it and reduces the gradients in fp32 (None: as stored).
    ``group``: the process group DDP averages over (None: the world; a tensor-parallel model's data-parallel
    replicas)."""
    if not is_distributed():
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # Expert weights the ranks hold apart are reduced by the expert-parallel code, not averaged here:
        # orthon's expert stacks (DTensors) and megatron-core's experts (marked allreduce False).
        apart = [name for name, p in model.named_parameters()
                 if isinstance(p, DTensor) or getattr(p, "allreduce", True) is False]
        if apart:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, apart)

        # No buffer sync before a forward: each rank's MoE expert_load counts its own tokens until the step
        # all-reduces them (rank 0's buffers broadcast before every forward would overwrite them mid-step).
        # torch 2.13 names this forward_sync_buffers (broadcast_buffers warns); it still syncs once at
        # init, which is harmless here: every rank builds or loads the same buffers.
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
            return DistributedDataParallel(model, forward_sync_buffers=False, process_group=group)
        return DistributedDataParallel(model, broadcast_buffers=False, process_group=group)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    # Layer inputs stay as they come (cast_forward_inputs off): the residual stream keeps its dtype, and
    # autocast casts what a matmul takes.
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False) \
        if param_dtype is not None else MixedPrecisionPolicy()
    if expert_mesh is not None:
        shard_over_replicas(model, expert_mesh, policy)  # the layers' fully_shard then leaves the experts to it
    mesh = None
    world = dist.get_world_size()
    if 0 < shard_ranks < world:
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, (world // shard_ranks, shard_ranks), mesh_dim_names=HSDP_MESH_DIMS)
    for layer in model.model.layers:
        indexer = layer.self_attn.indexer
        if indexer is not None:
            # Its own unit, gathered by the methods the model calls: mid-training's indexer KL differentiates
            # the indexer outside its layer's forward and backward (orthon.midtrain.indexer_objective), and
            # its own unit lets FSDP2 gather it alone there, not the whole layer.
            # Gathered as stored: a unit that some steps never run (the indexer outside DSA) trips FSDP2's
            # fp32 gradient reduction of a bf16 gather (torch 2.13: it reads the gathered parameter that
            # was never made); the indexer is about 1% of the parameters and its matmuls run under autocast.
            fully_shard(indexer, mesh=mesh)
            for method in ("queries", "keys"):
                register_fsdp_forward_method(indexer, method)
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def grad_norm(params) -> torch.Tensor:
    """The global 2-norm of the parameters' gradients, each element counted once: a DTensor's squared sum is
    added over the mesh dimensions it is sharded along (not over its copies along replicated ones); a plain
    tensor is the same on every rank (DDP), counted as this rank's. Collective: every rank calls it with
    the same parameters in the same order."""
    sums: dict[tuple, torch.Tensor] = {}
    for p in params:
        grad, groups = p.grad, ()
        if isinstance(grad, DTensor):
            groups = tuple(grad.device_mesh.get_group(mesh_dim) for mesh_dim, _ in shard_placements(grad))
            grad = grad.to_local()
        square = grad.detach().float().pow(2).sum()
        sums[groups] = sums[groups] + square if groups in sums else square
    total = torch.zeros((), dtype=torch.float32)
    for groups, square in sums.items():
        for group in groups:
            dist.all_reduce(square, group=group)
        total = total + square.cpu()
    return total.sqrt()


@torch.no_grad()
def clip_grads(params, max_norm: float) -> float:
    """torch's clip_grad_norm_ (the same coefficient) over ``grad_norm``: for parameters of several layouts
    at once (plain, FSDP2's and expert-parallel DTensors), which torch's cannot stack. Returns the norm."""
    params = list(params)
    norm = grad_norm(params)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if coefficient < 1:
        for p in params:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(coefficient.to(grad.device, grad.dtype))
    return float(norm)


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def no_sync(model: nn.Module, last: bool):
    """Skip the gradient reduction on all but the last micro-batch of a step."""
    if last or not is_distributed():
        return nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
    return _resync(model)


class _resync:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)


def fill_shard(tensor: torch.Tensor, draw) -> None:
    """``draw`` (an in-place fill: ``normal_``, ``copy_`` of a loaded value, ...) on ``tensor``. A DTensor
    (an FSDP2 shard) keeps its part of the full tensor drawn on the CPU: every rank draws the same
    numbers from the same generator state (or copies the same value), and holds one full parameter at
    a time, never the whole model."""
    from torch.distributed.tensor import DTensor
    # DCP's own helper for where a shard lies in the full tensor (private, but the one DCP plans with).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(tensor, DTensor):
        full = draw(torch.empty(tensor.shape, dtype=tensor.dtype))
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        # Cut on the CPU: only this rank's piece goes to the device.
        tensor.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
    else:
        draw(tensor)
