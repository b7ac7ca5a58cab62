"""The engine's CPU kernels for a decode step: the few fp32 rows of every matmul and the small ops
around them, each one C call (decode_kernels.c) where torch would run several ops, whose dispatch
costs more than their arithmetic at these sizes.

- ``PackedLinear``: a weight packed once (panels of 16 output columns, contiguous along K) times 1 to
  256 rows, the rows' accumulators in registers (AVX-512 where the CPU has it, else AVX2), so the weight
  streams once per call, its panels split across threads when the product is large; optionally with
  the RMSNorm that feeds it folded in (``norm``).
- ``rms_norm``, ``rope_rows``: RMSNorm and RoPE of a step's vectors.
- ``index_topk``: the DSA indexer's scores over the cached keys and their deterministic top-k.
- ``latent_attention_step``: absorbed-MLA attention over the cached latents (all, or the top-k).
- ``PackedMoE``: an MoE block's routing, routed experts (rows grouped by expert) and shared expert.

Each equals the torch function it replaces up to float summation order (tests/test_decode_kernels.py).
Built on first use with the system C compiler into a per-user cache and loaded with ctypes
(``orthon.core.native``, as the training-side sparse kernels are). Where it cannot be built or run (no
compiler, a CPU without AVX2 / FMA, ORTHON_DECODE_KERNELS=0) every caller takes the torch path (ORTHON_DECODE_AVX512=0 keeps the kernels
but runs their AVX2 form): the same values up to summation order.
The fallback is logged once per process with its reason (logger ``orthon.engine.decode_kernels``; a
warning, or info when ORTHON_DECODE_KERNELS=0 asked for it).
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from orthon.core.native import NativeLibrary

log = logging.getLogger(__name__)

# Rows per call the kernels take. Measured on the AMD EPYC (Zen 3), one thread: the packed matmul at
# 83-98 GFLOP/s on the tiny model's shapes (16-512 rows, hot caches), MKL's F.linear at 57-93; on
# 2048-8192 x 512-4096 weights at 8 / 64 / 256 rows, 62-71 / 87-89 / 90-96 against MKL's 25-32 / 61-73 /
# 77-88, and with two threads (a product above 2 MFLOP splits its panels) 166-172 / 176-181 / 177-191
# against 34-41 / 103-126 / 138-170. Decode at batch 64 / 128 runs 1.4x / 1.1x faster than on MKL's
# GEMMs (one thread), 1.5x / 1.3x (two). Larger batches are left to the BLAS (not measured there).
MAX_ROWS = 256
PANEL = 16


def _declare(lib: ctypes.CDLL) -> None:
    lib.thin_pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    lib.thin_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.thin_use_avx512.argtypes = [ctypes.c_int]
    lib.thin_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_float]
    lib.thin_norm_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_float, ctypes.c_int]
    lib.thin_moe.argtypes = ([ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
                             + [ctypes.c_long] * 4 + [ctypes.c_float] + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
                             + [ctypes.c_void_p] * 5 + [ctypes.c_int])
    lib.thin_rope.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 6 + [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p]
    lib.thin_index_topk.argtypes = ([ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 4
                                    + [ctypes.c_float, ctypes.c_long] + [ctypes.c_void_p] * 3)
    lib.thin_latent_attention.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_long] + [ctypes.c_void_p] * 2
                                          + [ctypes.c_long] * 6 + [ctypes.c_float] + [ctypes.c_void_p] * 2)
    if os.environ.get("ORTHON_DECODE_AVX512") == "0":  # AVX2 kernels on an AVX-512 CPU
        lib.thin_use_avx512(0)


native = NativeLibrary(Path(__file__).with_name("decode_kernels.c"), "ORTHON_DECODE_KERNELS", "decode kernels",
                       "decoding uses torch ops (same values, slower at small batches)", log, _declare, openmp=True)


def library() -> ctypes.CDLL | None:
    """The built kernel, or None (``native.why_unavailable`` says why)."""
    return native.load()


class PackedLinear:
    """A weight (N, K) as ``F.linear`` takes it, plus its panel-packed copy when the kernel applies.

    ``norm``: the RMSNorm whose output this linear reads (its ``weight`` and ``eps``). Its scale is
    folded into the weight's columns, and the call normalises x itself: ``W (w * x * rstd(x))`` is
    ``(W diag(w)) x`` times each row's rstd, so the norm costs one pass over x inside the kernel call.
    """

    def __init__(self, weight: torch.Tensor, norm: torch.nn.Module | None = None):
        weight = weight.detach()
        self.eps = None
        if norm is not None:
            weight = weight * norm.weight.detach()[None, :]
            self.eps = float(norm.eps)
        self.weight = weight.contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.panels = None
        lib = library()
        if lib is not None and self.weight.dtype == torch.float32 and self.weight.device.type == "cpu":
            N, K = self.weight.shape
            self.panels = torch.empty((N + PANEL - 1) // PANEL * K * PANEL, dtype=torch.float32)
            lib.thin_pack(self.weight.data_ptr(), self.panels.data_ptr(), N, K)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N) = x @ weight^T (of rms_norm(x) without its scale, with ``norm``)."""
        rows = x.numel() // self.in_features if x.numel() else 0
        if self.panels is None or not 0 < rows <= MAX_ROWS or x.dtype != torch.float32 or x.requires_grad:
            if self.eps is not None:  # normalised in fp32 whatever x's dtype, as the model's RMSNorm does
                x = F.rms_norm(x.float(), (self.in_features,), None, self.eps).to(x.dtype)
            return F.linear(x, self.weight)
        flat = x.reshape(rows, self.in_features).contiguous()
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if self.eps is None:
            native.lib.thin_linear(flat.data_ptr(), self.panels.data_ptr(), y.data_ptr(), rows, self.out_features,
                                    self.in_features, torch.get_num_threads())
        else:
            native.lib.thin_norm_linear(flat.data_ptr(), self.panels.data_ptr(), y.data_ptr(), rows, self.out_features,
                                         self.in_features, self.eps, torch.get_num_threads())
        return y.view(*x.shape[:-1], self.out_features)


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """``norm(x)`` for an RMSNorm module in inference: one kernel call for the few fp32 rows of a decode
    step (torch's CPU rms_norm runs about ten ops), the module otherwise. Rows of x may lie apart
    (a split of a wider tensor), as long as each row is contiguous."""
    K = x.shape[-1]
    rows = x.numel() // K if x.numel() else 0
    strided_rows = x.dim() == 2 and x.stride(-1) == 1
    lib = library()
    if (lib is None or not 0 < rows <= MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
            or norm.weight.dtype != torch.float32 or torch.is_grad_enabled()
            or not (strided_rows or x.is_contiguous())):
        return norm(x)
    y = torch.empty(x.shape, dtype=torch.float32)
    lib.thin_rms_norm(x.data_ptr(), norm.weight.data_ptr(), y.data_ptr(), rows, K,
                       x.stride(0) if strided_rows else K, float(norm.eps))
    return y


class PackedMoE:
    """An MoE block's routed experts (gate_up (E, 2I, H), down (E, H, I)) and shared expert's down
    projection packed for ``thin_moe``: a decode step's routing, routed experts and shared expert in one
    kernel call. ``gate_up`` / ``down`` keep each routed expert's PackedLinear for callers that run the
    experts themselves; ``available`` is False where the kernel is not."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, shared_down: PackedLinear | None, routing: dict):
        self.gate_up = [PackedLinear(w) for w in gate_up.unbind(0)]
        self.down = [PackedLinear(w) for w in down.unbind(0)]
        self.shared_down = shared_down
        self.num_experts, self.hidden, self.intermediate = gate_up.shape[0], gate_up.shape[2], down.shape[2]
        self.routing = routing  # top_k, n_group, topk_group, norm_topk_prob, scaling
        packed = self.gate_up + self.down + ([self.shared_down] if self.shared_down is not None else [])
        self.available = self.num_experts <= 256 and all(p.panels is not None for p in packed)
        if self.available:
            pointers = ctypes.c_void_p * self.num_experts
            self._gate_up_ptrs = pointers(*(p.panels.data_ptr() for p in self.gate_up))
            self._down_ptrs = pointers(*(p.panels.data_ptr() for p in self.down))

    def applies(self, x: torch.Tensor) -> bool:
        return self.available and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.float32

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor,
                 shared_in: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (M, H) the normed rows (``applies(x)``), logits (M, E) their router logits and bias (E,) the
        router's score-correction bias, fp32, rows contiguous; shared_in (M, 2 Is) the shared expert's
        gate/up outputs (None without one). Returns the block's output (M, H) and the routing:
        chosen experts (M, k) and their weights (M, k)."""
        r = self.routing
        M, k = x.shape[0], r["top_k"]
        x, bias = x.contiguous(), bias.float().contiguous()
        y = torch.empty(M, self.hidden, dtype=torch.float32)
        chosen = torch.empty(M, k, dtype=torch.long)
        weights = torch.empty(M, k, dtype=torch.float32)
        Is = 0 if self.shared_down is None else self.shared_down.in_features
        scratch = torch.empty(M * (2 * self.hidden + 3 * self.intermediate + Is), dtype=torch.float32)
        native.lib.thin_moe(x.data_ptr(), M, self.hidden, self.intermediate, self.num_experts, logits.data_ptr(),
                             logits.stride(0), bias.data_ptr(), k, r["n_group"], r["topk_group"], int(r["norm_topk_prob"]),
                             float(r["scaling"]), self._gate_up_ptrs, self._down_ptrs,
                             None if shared_in is None else shared_in.data_ptr(), 0 if shared_in is None else shared_in.stride(0),
                             Is, None if self.shared_down is None else self.shared_down.panels.data_ptr(),
                             y.data_ptr(), chosen.data_ptr(), weights.data_ptr(), scratch.data_ptr(),
                             torch.get_num_threads())
        return y, chosen, weights


def _decode_kernel_applies(*tensors: torch.Tensor) -> bool:
    lib = library()
    return (lib is not None and not torch.is_grad_enabled()
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors))


def index_topk(keys: torch.Tensor, length: int, q: torch.Tensor, w: torch.Tensor, scale: float, k: int,
               visible: torch.Tensor | None) -> torch.Tensor | None:
    """The DSA indexer's top-k positions (B, k), best first, ties to the lower position (as
    ``deterministic_topk`` orders them) of one decode step: keys (B, capacity, d) the cache's index-key
    buffer, of which the first ``length`` rows are live; q (B, n, d) the step's index queries; w (B, n)
    their head weights; visible (B, length) bool or None. None where the kernel does not apply."""
    B, n, d = q.shape
    if not (_decode_kernel_applies(keys, q, w) and keys.is_contiguous() and 0 < k <= length <= keys.shape[1]):
        return None
    q, w = q.contiguous(), w.contiguous()
    if visible is not None:
        visible = visible.contiguous()
    out = torch.empty(B, k, dtype=torch.long)
    scores, heap = torch.empty(length, dtype=torch.float32), torch.empty(k, dtype=torch.long)
    native.lib.thin_index_topk(keys.data_ptr(), keys.stride(0), q.data_ptr(), w.data_ptr(),
                                None if visible is None else visible.data_ptr(), B, length, n, d, float(scale), k,
                                out.data_ptr(), scores.data_ptr(), heap.data_ptr())
    return out


def latent_attention_step(q: torch.Tensor, cache: torch.Tensor, length: int, scale: float, rank: int,
                          chosen: torch.Tensor | None, visible: torch.Tensor | None) -> torch.Tensor | None:
    """Absorbed-MLA attention of one decode step (``orthon.pretrain.attention.latent_attention`` over the
    cached latents): q (B, H, D); cache (B, capacity, D) the layer's latent buffer, the first ``length``
    rows live; chosen (B, K) the positions to attend (None: all ``length``); visible (B, length) bool or
    None. Returns (B, H, rank), or None where the kernel does not apply."""
    B, H, D = q.shape
    if not (_decode_kernel_applies(q, cache) and cache.is_contiguous() and length <= cache.shape[1]):
        return None
    q = q.contiguous()
    if chosen is not None:
        chosen = chosen.to(torch.long).contiguous()
    if visible is not None:
        visible = visible.contiguous()
    keys = length if chosen is None else chosen.shape[1]
    out = torch.empty(B, H, rank, dtype=torch.float32)
    p = torch.empty(keys, dtype=torch.float32)
    native.lib.thin_latent_attention(q.data_ptr(), cache.data_ptr(), cache.stride(0),
                                      None if chosen is None else chosen.data_ptr(),
                                      None if visible is None else visible.data_ptr(), length, B, H, D, rank, keys,
                                      float(scale), out.data_ptr(), p.data_ptr())
    return out


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int | None = None) -> torch.Tensor | None:
    """``apply_rope`` of a decode step's vectors in one kernel call: x (B, dim) or (B, n, dim), each vector
    contiguous (a split or a head view of a wider tensor will do); cos / sin (B or 1, rope_dim // 2)
    contiguous. rope_dim (default dim): rotate only the first rope_dim numbers and pass the rest (the
    indexer's layout). Returns a new contiguous tensor, or None where the kernel does not apply."""
    if not (_decode_kernel_applies(x, cos, sin) and x.dim() in (2, 3) and x.stride(-1) == 1
            and cos.is_contiguous() and sin.is_contiguous()):
        return None
    squeeze = x.dim() == 2
    x3 = x[:, None] if squeeze else x
    B, n, dim = x3.shape
    pairs = (dim if rope_dim is None else rope_dim) // 2
    y = torch.empty(B, n, dim, dtype=torch.float32)
    native.lib.thin_rope(x3.data_ptr(), B, n, x3.stride(0), x3.stride(1), dim, pairs, cos.data_ptr(), sin.data_ptr(),
                          pairs if cos.shape[0] > 1 else 0, y.data_ptr())
    return y[:, 0] if squeeze else y
