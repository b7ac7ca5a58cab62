"""Expert parallelism (``train.expert_parallel``): each MoE layer's routed experts spread over ranks.

With ``ep`` > 1 the world is a (world / ep, ep) mesh: along "experts" the ep ranks of a row hold E / ep
experts each (rank j of the row experts j*E/ep ... (j+1)*E/ep - 1), and along "expert_replicas" the ranks
of a column hold the same experts. The expert stacks become DTensors [Replicate(), Shard(0)] on that mesh,
so checkpoints (DCP), the full state dict and ``orthon export`` see the whole (E, ...) tensors and a
checkpoint reshards to any other expert-parallel degree or none. Everything else stays data-parallel
over the whole world (DDP or FSDP2, which leave the expert stacks alone).

A forward exchanges each token's rows with the ranks holding its experts (moe.exchanged_experts), so the
expert weights' gradients arriving on a rank come from every rank of its row; adding them over the
column and dividing by the world size gives what DDP's average would (``reduce_expert_grads``). Muon
orthogonalises each expert where it lies (a stack split by expert holds whole matrices), no gathering.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

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


def shard_experts(model: nn.Module, ep: int, device: torch.device) -> int:
    """Turn every Experts module's stacks into DTensors sharded by expert over the (world / ep, ep) mesh.
    Each rank keeps its slice of the stacks it holds (same values on every rank: the same seed or the same
    loaded weights; a meta model stays meta), with no communication. Returns how many stacks."""
    mesh = init_device_mesh(device.type, (dist.get_world_size() // ep, ep), mesh_dim_names=EXPERT_MESH_DIMS)
    placements = [Replicate(), Shard(0)]
    count = 0
    for module in model.modules():
        if isinstance(module, Experts):
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(module, name)
                local = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
                setattr(module, name, nn.Parameter(local, requires_grad=param.requires_grad))
                count += 1
    return count


def expert_params(model: nn.Module) -> list[DTensor]:
    """The expert-parallel stacks (empty when the model is not expert-parallel)."""
    return [p for m in model.modules() if isinstance(m, Experts)
            for p in (m.gate_up_proj, m.down_proj) if isinstance(p, DTensor)]


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, world: int) -> None:
    """The expert stacks' gradients as data parallelism's average: summed over the ranks holding the same
    experts, divided by the world size (each rank's loss is scaled for an average over all ranks; its
    experts' gradients already hold the contributions of every rank of its row, through the exchange)."""
    for param in expert_params(model):
        if param.grad is None:
            continue
        grad = param.grad.to_local()
        mesh = param.device_mesh
        if mesh.size(0) > 1:
            dist.all_reduce(grad, group=mesh.get_group(EXPERT_MESH_DIMS[0]))
        grad.div_(world)
