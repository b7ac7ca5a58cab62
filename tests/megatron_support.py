"""megatron-core on the CPU for tests: its MoE router state and RoPE frequencies go to
``torch.cuda.current_device()``, pointed here at the CPU; torch.distributed (gloo, one process, an
in-process store) and megatron's parallel groups are set up by orthon's builder and torn down after."""
from __future__ import annotations

import contextlib

import pytest
import torch


@contextlib.contextmanager
def megatron_on_cpu():
    from megatron.core import parallel_state

    patch = pytest.MonkeyPatch()
    import megatron.core.tensor_parallel.random as megatron_random

    patch.setattr(torch.cuda, "current_device", lambda: "cpu")  # undone after, whatever the code under test sets
    patch.setattr(torch.cuda, "synchronize", torch.cuda.synchronize)  # the builder's no-op, undone after
    import megatron.core.pipeline_parallel.schedules as schedules

    patch.setattr(schedules, "torch", schedules.torch)  # the builder's CPU counters, undone after
    for name in ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED",  # the builder's CPU tracker too
                 "_get_cuda_rng_state", "_set_cuda_rng_state"):
        patch.setattr(megatron_random, name, getattr(megatron_random, name))
    try:
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        patch.undo()
