"""Data parallelism for the model: DDP or FSDP2 wrapping and gradient-sync control (the process group
and collectives are ``orthon.core.distributed``)."""
from __future__ import annotations

import inspect
from contextlib import nullcontext

import torch
from torch import nn

from orthon.core.distributed import is_distributed


def wrap(model: nn.Module, mode: str) -> nn.Module:
    """DDP, or FSDP2 (fully_shard each decoder layer, then the root); the model itself when alone."""
    if not is_distributed():
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # No buffer sync before a forward: each rank's MoE expert_load counts its own tokens until the step
        # all-reduces them (rank 0's buffers broadcast before every forward would overwrite them mid-step).
        # torch 2.13 names this forward_sync_buffers (broadcast_buffers warns); it still syncs once at
        # init, which is harmless here: every rank builds or loads the same buffers.
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
            return DistributedDataParallel(model, forward_sync_buffers=False)
        return DistributedDataParallel(model, broadcast_buffers=False)
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
