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
