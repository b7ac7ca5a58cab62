"""megatron-core 0.16 without transformer-engine: two of its modules believe TE is there.

``megatron.core.extensions.transformer_engine`` imports without TE (it puts mock objects in TE's place),
so ``multi_latent_attention`` sets its HAVE_TE to True and then calls ``isinstance`` with a mock (a
TypeError while building MLA), and the MoE router's gating calls ``te_general_gemm``, a name that module
only defines when TE imports (a NameError in the forward). ``apply()`` corrects both flags when TE is
truly absent, and lets MLA take orthon's replicated down-projection (local_spec.ReplicatedLinear); with TE
installed it changes nothing. Without CUDA, ``point_cuda_device_at_cpu`` and ``use_cpu_rng_tracker``
let megatron-core run on the CPU."""
from __future__ import annotations

import importlib.util
import types

import torch


def have_transformer_engine() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # installed without a usable build (no CUDA libraries): as good as absent
        return False
    return True


def apply() -> None:
    if have_transformer_engine():
        return
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # MLA builds a replicated down-projection only for a module it takes for transformer-engine's
    # TELinear (see local_spec.ReplicatedLinear): orthon's stands in that name while TE is absent.
    from orthon.backends.megatron.local_spec import ReplicatedLinear

    mla.TELinear = ReplicatedLinear


def _cpu_device() -> str:
    return "cpu"


def point_cuda_device_at_cpu() -> bool:
    """On a machine without CUDA, make ``torch.cuda.current_device()`` answer "cpu" in this process, so that
    megatron-core (which places its router state, RoPE frequencies and tensor-parallel buffers there, in
    its forward and backward too) runs on the CPU, and ``torch.cuda.synchronize()`` (megatron's pipeline
    exchange calls it) do nothing. Without CUDA both calls raise, so nothing that worked before is changed:
    only code that would have failed now gets the CPU. Returns whether it is pointed there; with CUDA it
    does nothing and returns False. megatron's pipeline schedules get their CUDA counters on the CPU
    (``_TorchWithCPUFactories``)."""
    if torch.cuda.is_available():
        return False
    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _nothing_to_synchronize
    import megatron.core.pipeline_parallel.schedules as schedules

    schedules.torch = _TorchWithCPUFactories("torch")
    return True


def _nothing_to_synchronize(device=None) -> None:
    """Without CUDA there is no device work to wait for."""


class _TorchWithCPUFactories(types.ModuleType):
    """torch as megatron's pipeline schedules see it without CUDA: each schedule makes its token counter
    with ``torch.zeros(..., device="cuda")``; here that counter is made on the CPU. Everything else is
    torch's own (no cost in the forward and backward the schedules run)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


class _CPURNGTracker:
    """megatron-core's model-parallel RNG tracker without CUDA. megatron forks the CUDA generator around
    the dropout of sequence-parallel regions (and its GPU weight init); on the CPU, where orthon builds
    megatron's weights on the CPU path and trains with dropout 0, a fork has no state to switch: each is
    a no-op context."""

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        pass

    def add(self, name, seed) -> None:
        pass

    def get_states(self) -> dict:
        return {}

    def set_states(self, states) -> None:
        pass

    def fork(self, name=None):
        import contextlib

        return contextlib.nullcontext()


def use_cpu_rng_tracker() -> None:
    """Install _CPURNGTracker as megatron-core's tracker (a machine without CUDA: its own would call the
    CUDA generator), and let megatron's activation recompute, which saves the CUDA generator's state with
    the CPU's before a layer and restores both before recomputing it, find no CUDA state to keep."""
    import megatron.core.tensor_parallel.random as megatron_random

    megatron_random._CUDA_RNG_STATE_TRACKER = _CPURNGTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    megatron_random._get_cuda_rng_state = _no_cuda_rng_state
    megatron_random._set_cuda_rng_state = _no_cuda_rng_state


def _no_cuda_rng_state(*args, **kwargs) -> None:
    """Without CUDA there is no CUDA generator: nothing to read or set."""
