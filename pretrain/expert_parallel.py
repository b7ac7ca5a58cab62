"""Expert parallelism (``train.expert_parallel``): each MoE layer's routed experts spread over ranks.

With ``ep`` > 1 the world is a (world / ep, ep) mesh: along "experts" the ep ranks of a row hold E / ep
experts each (rank j of the row experts j*E/ep ... (j+1)*E/ep - 1), and along "expert_replicas" the ranks
of a column hold the same experts. The expert stacks become DTensors sharded by expert (Shard(0)) over the
row, so checkpoints (DCP), the full state dict and ``orthon export`` see the whole (E, ...) tensors and a
checkpoint reshards to any other expert-parallel degree or none. Everything else stays data-parallel
over the whole world. Under DDP the column's copies are whole and their gradients are summed over the
column here (``reduce_expert_grads``); under FSDP2 each Experts module is sharded over its column (FSDP2
composes with the expert sharding as with tensor parallelism), so no rank holds more than 1 / world of
any stack, as FSDP2 alone would, without gathering a layer's experts at every forward.

A forward exchanges each token's rows with the ranks holding its experts (moe.exchanged_experts), so the
expert weights' gradients arriving on a rank come from every rank of its row; summed over the column and
divided by the world size they are what data parallelism's average gives. Muon orthogonalises each
expert where it lies (a stack split by expert holds whole matrices), no gathering.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from orthon.core.errors import ConfigError
from orthon.pretrain.moe import EXPERT_MESH_DIMS, Experts


def check_degree(ep: int, world: int, n_experts: int) -> None:
    """ConfigError unless ``ep`` ranks can share the experts: it divides the world and the expert count."""
    if ep < 1:
        raise ConfigError(f"train.expert_parallel: must be at least 1, got {ep}")
    if world % ep:
        raise ConfigError(f"train.expert_parallel = {ep} does not divide the {world} ranks of this run")
    if n_experts % ep:
        raise ConfigError(f"train.expert_parallel = {ep} does not divide model.n_routed_experts = {n_experts}")


def shard_experts(model: nn.Module, ep: int, device: torch.device) -> DeviceMesh:
    """Turn every Experts module's stacks into DTensors sharded by expert over the rows of the
    (world / ep, ep) mesh, which it returns. Each rank keeps its slice of the stacks (the same values on
    every rank: the same seed or the same loaded weights; a meta model stays meta), no communication."""
    mesh = init_device_mesh(device.type, (dist.get_world_size() // ep, ep), mesh_dim_names=EXPERT_MESH_DIMS)
    # Gathering a stack FSDP2 shards over its column (final/'s full state dict) takes two all-gathers in
    # a row, which DTensor warns of on every rank; an all-gather is exact, so nothing can differ.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for module in experts_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(module, name)
            local = distribute_tensor(param.detach(), mesh[EXPERT_MESH_DIMS[1]], [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(local, requires_grad=param.requires_grad))
    return mesh


def experts_modules(model: nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def shard_over_replicas(model: nn.Module, mesh: DeviceMesh, mp_policy) -> None:
    """FSDP2 over each Experts module's column of ``mesh`` (gathered under ``mp_policy``, the layers'
    MixedPrecisionPolicy): before the layers' own fully_shard, which then leaves these parameters to it."""
    from torch.distributed.fsdp import fully_shard

    for module in experts_modules(model):
        fully_shard(module, mesh=mesh[EXPERT_MESH_DIMS[0]], mp_policy=mp_policy)


def expert_params(model: nn.Module) -> list[DTensor]:
    """The expert-parallel stacks (empty when the model is not expert-parallel)."""
    return [p for m in experts_modules(model) for p in (m.gate_up_proj, m.down_proj) if isinstance(p, DTensor)]


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, mesh: DeviceMesh, fsdp: bool) -> None:
    """The expert stacks' gradients as data parallelism's average over the world: each rank's loss is
    scaled for that average and its experts' gradients already hold the contributions of every rank of
    its row (through the exchange). Under DDP they are summed over the column here and divided by the
    world size; under FSDP2 its reduce-scatter has averaged them over the column, which leaves the
    division by the row's size."""
    replicas, ep = mesh.size(0), mesh.size(1)
    for param in expert_params(model):
        if param.grad is None:
            continue
        grad = param.grad.to_local()
        if not fsdp and replicas > 1:
            dist.all_reduce(grad, group=mesh.get_group(EXPERT_MESH_DIMS[0]))
        grad.div_(ep if fsdp else replicas * ep)
