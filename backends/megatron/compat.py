"""megatron-core 0.16 without transformer-engine: two of its modules believe TE is there.

``megatron.core.extensions.transformer_engine`` imports without TE (it puts mock objects in TE's place),
so ``multi_latent_attention`` sets its HAVE_TE to True and then calls ``isinstance`` with a mock (a
TypeError while building MLA), and the MoE router's gating calls ``te_general_gemm``, a name that module
only defines when TE imports (a NameError in the forward). ``apply()`` corrects both flags when TE is
truly absent; with TE installed it changes nothing."""
from __future__ import annotations

import importlib.util


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


def _cpu_device() -> str:
    return "cpu"


def point_cuda_device_at_cpu() -> bool:
    """On a machine without CUDA, make ``torch.cuda.current_device()`` answer "cpu" in this process, so that
    megatron-core (which places its router state, RoPE frequencies and tensor-parallel buffers there, in
    its forward and backward too) runs on the CPU. Without CUDA that call raises, so nothing that worked
    before is changed: only code that would have failed now gets the CPU. Returns whether it is pointed
    there; with CUDA it does nothing and returns False."""
    import torch

    if torch.cuda.is_available():
        return False
    torch.cuda.current_device = _cpu_device
    return True
