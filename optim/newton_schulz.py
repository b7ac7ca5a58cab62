"""Newton-Schulz orthogonalisation of a batch of matrices (the core of Muon).

``newton_schulz(G)`` maps every matrix of a stack ``(..., rows, cols)`` to
approximately ``U V^T`` (its orthogonal polar factor, with singular values
spread around 1) using the quintic iteration

    X <- a X + b (X X^T) X + c (X X^T)^2 X

on the Frobenius-normalised matrix, transposed first when rows > cols so the
Gram matrix is the small side. The arithmetic follows
``torch.optim._muon._zeropower_via_newtonschulz`` (same eps, same addmm
forms, same bf16 rounding points) so that Muon can be checked against
``torch.optim.Muon``.

bf16 on CPUs without a bf16 GEMM: PyTorch then falls back to a scalar bf16
matmul (about 1-2 GFLOP/s, against ~100 GFLOP/s for fp32). A bf16 GEMM
multiplies bf16 inputs exactly and accumulates in fp32, so running the fp32
kernel on bf16-valued inputs and rounding each product back to bf16 gives
the same numbers up to summation order. ``emulate_bf16`` does that; by
default it is on exactly where bf16 GEMM is not native. In fp32 (that form,
or ``dtype="fp32"``) X X^T and b R + c R^2, symmetric, are computed as their
upper part and mirrored (orthon.optim.symmetric_products: on such CPUs an
AVX2 kernel at 0.5 of the fp32 GEMM's time at n = 256), P X in full.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from orthon.optim.symmetric_products import symmetric_matmul, symmetric_panels, symmetric_product_flops

DEFAULT_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_STEPS = 5
DEFAULT_EPS = 1e-7

# Matrix elements per batched Newton-Schulz call: larger stacks go in pieces so one piece's X (and
# its products) stays in the CPU's cache; a whole 24 x 1024 x 4096 stack at once runs the bf16 GEMMs
# ~20% slower than one matrix at a time. 1M against 4M (gram, fused passes, one thread): 24 square
# 1024^2 blocks 604 against 623 ms (one at a time, and Gram Newton-Schulz folds a lone matrix's
# normalisation), the tiny model's set 73.6 against 75.7 ms. Batching is per matrix, so pieces change
# no result.
NS_BATCH_ELEMENTS = 1 << 20
# On a GPU the cache argument is gone and launches are the cost: a 1024 x 4096 block's products take
# microseconds, so one block a call left an H200 at 0.21 of its bf16 GEMM rate (bench/muon_step.py,
# 24 x 1024^2 + 24 x 1024 x 4096). There a piece holds many blocks (64M elements: 128 MB in bf16).
NS_BATCH_ELEMENTS_GPU = 1 << 26


def ns_batch_elements(device: torch.device | str) -> int:
    """Matrix elements per batched Newton-Schulz call on ``device``."""
    return NS_BATCH_ELEMENTS if torch.device(device).type == "cpu" else NS_BATCH_ELEMENTS_GPU

NS_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ns_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a Newton-Schulz compute dtype name ("bf16" or "fp32")."""
    if isinstance(name, torch.dtype):
        if name not in NS_DTYPES.values():
            raise ValueError(f"Newton-Schulz dtype must be bf16 or fp32, got {name}")
        return name
    if name not in NS_DTYPES:
        raise ValueError(f"Newton-Schulz dtype must be one of {list(NS_DTYPES)}, got {name!r}")
    return NS_DTYPES[name]


@functools.lru_cache(maxsize=None)
def _cpu_has_bf16_gemm() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def bf16_gemm_is_native(device: torch.device | str) -> bool:
    """Whether bf16 matmul on ``device`` runs a real bf16 kernel (GPUs, AVX512-BF16/AMX CPUs)."""
    device = torch.device(device)
    return device.type != "cpu" or _cpu_has_bf16_gemm()


def emulates_bf16(bf16_matmul: str, device: torch.device | str) -> bool:
    """Whether bf16 Newton-Schulz runs its emulated form under Muon's ``bf16_matmul`` ("auto": where bf16 GEMM
    is not native; "native"; "emulated") on ``device``."""
    if bf16_matmul == "auto":
        return not bf16_gemm_is_native(device)
    return bf16_matmul == "emulated"


def newton_schulz(
    matrices: Tensor,
    steps: int = DEFAULT_STEPS,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    dtype: torch.dtype | str = torch.bfloat16,
    eps: float = DEFAULT_EPS,
    emulate_bf16: bool | None = None,
) -> Tensor:
    """Orthogonalise each matrix of ``matrices`` (shape ``(..., rows, cols)``).

    Returns a tensor of the same shape in ``dtype`` (the compute dtype, as
    torch.optim.Muon returns it). ``emulate_bf16=None`` chooses emulation
    where bf16 GEMM is not native (see the module docstring). The input is
    never modified.
    """
    check_arguments("newton_schulz", matrices, steps, coefficients)
    dtype = ns_dtype(dtype)
    a, b, c = (float(x) for x in coefficients)
    shape = matrices.shape
    rows, cols = shape[-2], shape[-1]
    x = matrices.reshape(-1, rows, cols).to(dtype)
    transposed = rows > cols
    if transposed:
        x = x.mT
    # Frobenius norm >= spectral norm, so every singular value lands in [0, 1].
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)

    if emulate_bf16 is None:
        emulate_bf16 = dtype == torch.bfloat16 and not bf16_gemm_is_native(x.device)
    if emulate_bf16 and dtype == torch.bfloat16:
        x = _iterate(x.float(), steps, a, b, c, _round_bf16_).to(torch.bfloat16)
    else:
        x = _iterate(x, steps, a, b, c)

    if transposed:
        x = x.mT
    return x.reshape(shape)


def check_arguments(name: str, matrices: Tensor, steps: int, coefficients: tuple[float, ...]) -> None:
    """Errors naming what is wrong with a Newton-Schulz call's arguments (``name``: the function)."""
    if matrices.ndim < 2:
        raise ValueError(f"{name} needs matrices (..., rows, cols), got shape {tuple(matrices.shape)}")
    if not 0 <= steps < 100:
        raise ValueError(f"{name} steps must be in [0, 100), got {steps}")
    if len(coefficients) != 3:
        raise ValueError(f"{name} needs 3 coefficients (a, b, c), got {coefficients}")


def _round_bf16_(t: Tensor) -> Tensor:
    """Round an fp32 tensor to bf16 precision in place (what a bf16 GEMM's output store does)."""
    return t.copy_(t.to(torch.bfloat16))


def _iterate(x: Tensor, steps: int, a: float, b: float, c: float, round_=None) -> Tensor:
    """The iteration in torch.optim.Muon's forms (X X^T; b R + c R^2 by baddbmm; a X + P X by baddbmm), each
    product passed through ``round_`` (the emulated bf16 GEMM's output rounding). In fp32 (the emulated form
    included) X X^T and b R + c R^2 are computed by halves (``symmetric_matmul``); bf16 keeps torch's full
    products, bit for bit."""
    panels = symmetric_panels(x.shape[-2], x.device, x.dtype) if x.dtype == torch.float32 else 1
    round_ = round_ or (lambda t: t)
    for _ in range(steps):
        gram = round_(symmetric_matmul(x, x.mT, panels))
        poly = round_(symmetric_matmul(gram, gram, panels, alpha=c, addend=gram, beta=b, v_symmetric=True))
        x = round_(torch.baddbmm(x, poly, x, beta=a))
    return x


def newton_schulz_flops(rows: int, cols: int, steps: int = DEFAULT_STEPS, panels: int = 1) -> int:
    """Matmul FLOPs of ``steps`` iterations on one rows x cols matrix (2 per multiply-add); ``panels``: the
    symmetric products' (X X^T, b R + c R^2) row panels (``symmetric_panels``; 1, torch.optim.Muon's: full)."""
    small, large = min(rows, cols), max(rows, cols)
    per_step = (symmetric_product_flops(small, large, panels) + symmetric_product_flops(small, small, panels)
                + 2 * small * small * large)
    return steps * per_step
