"""Data parallelism on torch.distributed: process group set-up from torchrun's environment, DDP or
FSDP2 wrapping, and the few collectives the loop needs. gloo on CPU, NCCL on GPU."""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device). Starts the process group when launched by torchrun with WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return rank, world, device


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def wrap(model: nn.Module, mode: str) -> nn.Module:
    """DDP, or FSDP2 (fully_shard each decoder layer, then the root); the model itself when alone."""
    if not is_distributed():
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


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


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_gradients(model: nn.Module) -> None:
    """Sum every trainable parameter's gradient over the ranks, in one flat buffer per dtype: data
    parallelism for a loop whose loss is not computed through a DDP wrapper (each rank divides its
    loss by the global count, so the sum is the global mean). A missing gradient counts as zero."""
    if not is_distributed():
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for dtype in {p.grad.dtype for p in params}:
        grads = [p.grad for p in params if p.grad.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def shutdown() -> None:
    """Wait for every rank, then tear the process group down. Without it a rank that finishes first
    exits with gloo's threads still running and can be aborted by the C++ runtime ("terminate called
    without an active exception"), failing an otherwise good run."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
