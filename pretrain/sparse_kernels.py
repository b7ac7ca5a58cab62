"""CPU kernels for DSA sparse attention in full forwards and backwards (sparse_kernels.c): what a GPU
runs as fused sparse-attention kernels, here in C with AVX2 and OpenMP.

- ``causal_topk``: the indexer's scores and top-k of every query of a causal sequence in one pass per
  query row (torch runs a score matmul, a ReLU, a head-weighted sum, a mask and a top-k over (T, T)).
- ``latent_attention``: absorbed-MLA attention of each query over its own k gathered latents, forward
  and backward, without the (T, k, D) gathered copy that torch needs and whose tiny batched matmuls run
  at a few GFLOP/s: the training step's sparse attention reads k latents a query instead of the T x T
  scores of masked dense attention.

Each equals the torch function it replaces up to float summation order (tests/test_sparse_kernels.py);
``None`` from a function means "does not apply here" (no library, not CPU, more than MAX_KEYS keys, a
width not a multiple of 8) and the caller runs its torch path. No result depends on the thread count.
Built like the decode kernels (orthon.core.native); ``ORTHON_SPARSE_KERNELS=0`` turns them off.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from orthon.core.native import NativeLibrary

log = logging.getLogger(__name__)

MAX_KEYS = 4096  # as sparse_kernels.c


def _declare(lib: ctypes.CDLL) -> None:
    P, L, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    lib.sparse_attention_forward.argtypes = [P, P, P, L, L, L, L, L, F, P, P, ctypes.c_int]
    lib.sparse_attention_backward.argtypes = [P, P, P, P, P, L, L, L, L, L, F, P, P, L, L, P, ctypes.c_int]
    lib.causal_index_topk.argtypes = [P, P, P, L, P, L, L, L, L, F, L, ctypes.c_int, P, ctypes.c_int]


native = NativeLibrary(Path(__file__).with_name("sparse_kernels.c"), "ORTHON_SPARSE_KERNELS", "sparse attention kernels",
                       "sparse attention runs in torch ops (same values, slower on CPU)", log, _declare, openmp=True)


def _available(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_floating_point() for t in tensors) and native.load() is not None


def causal_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, k: int, scale: float,
                docs: torch.Tensor | None = None, ordered: bool = True) -> torch.Tensor | None:
    """Top-k key positions (B, T, k), ties to the lower position, best first unless ``ordered`` is False
    (``select_topk`` of ``index_scores`` with the causal mask, or the document mask given docs (B, T)),
    of indexer queries q (B, T, n, d) with head weights w (B, T, n) over the same T tokens' keys
    (B, T, d). None where the kernel does not apply (it needs k <= T)."""
    B, T, n, d = q.shape
    if not (_available(q, w, keys) and 0 < k <= min(T, MAX_KEYS)):
        return None
    ld = -(-T // 32) * 32
    padded = keys.new_zeros((B, ld, d), dtype=torch.float32)
    padded[:, :T] = keys.detach()
    keys_t = padded.view(B, ld // 32, 32, d).transpose(2, 3).contiguous()  # tiles of 32 keys, transposed
    q32, w32 = q.detach().float().contiguous(), w.detach().float().contiguous()
    docs = None if docs is None else docs.to(torch.long).contiguous()
    out = torch.empty(B, T, k, dtype=torch.long)
    native.lib.causal_index_topk(q32.data_ptr(), w32.data_ptr(), keys_t.data_ptr(), ld,
                                 None if docs is None else docs.data_ptr(), B, T, n, d, float(scale), k, int(ordered),
                                 out.data_ptr(), torch.get_num_threads())
    return out


def _applies(q: torch.Tensor, latent: torch.Tensor, keys: int, rank: int) -> bool:
    D = q.shape[-1]
    return _available(q, latent) and D % 8 == 0 and rank % 8 == 0 and rank <= D and 0 < keys <= MAX_KEYS


class _LatentAttention(torch.autograd.Function):
    """Forward and backward of ``latent_attention`` over each query's own latents, by the kernels; the
    arithmetic in fp32 whatever the inputs' dtypes (autocast's bf16 among them), results in q's dtype."""

    @staticmethod
    def forward(ctx, q, latent, rows, scale, rank):
        B, C, H, D = q.shape
        K = rows.shape[-1]
        q32 = q.detach().float().contiguous()
        lat32 = latent.detach().float().contiguous()
        out = torch.empty(B, C, H, rank, dtype=torch.float32)
        probs = torch.empty(B, C, H, K, dtype=torch.float32)
        native.lib.sparse_attention_forward(q32.data_ptr(), lat32.data_ptr(), rows.data_ptr(), B * C, H, K, D, rank,
                                            float(scale), out.data_ptr(), probs.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(q32, lat32, rows, probs)
        ctx.scale, ctx.rank, ctx.dtypes = scale, rank, (q.dtype, latent.dtype)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q32, lat32, rows, probs = ctx.saved_tensors
        B, C, H, D = q32.shape
        g = grad.float().contiguous()
        dq = torch.empty_like(q32)
        dlat = torch.empty_like(lat32)
        n_rows = lat32.shape[0] * lat32.shape[1]
        d_logits = torch.empty_like(probs)
        native.lib.sparse_attention_backward(q32.data_ptr(), lat32.data_ptr(), rows.data_ptr(), probs.data_ptr(),
                                             g.data_ptr(), B * C, H, rows.shape[-1], D, ctx.rank, float(ctx.scale),
                                             dq.data_ptr(), dlat.data_ptr(), n_rows, B, d_logits.data_ptr(),
                                             torch.get_num_threads())
        q_dtype, lat_dtype = ctx.dtypes
        return dq.to(q_dtype), dlat.to(lat_dtype), None, None, None


def latent_attention(q: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, visible: torch.Tensor, scale: float,
                     rank: int) -> torch.Tensor | None:
    """``orthon.pretrain.attention.latent_attention`` of absorbed queries q (B, C, H, D) over their own
    latents ``gather_rows(latent, idx)``: latent (B, S, D), idx (B, C, K) positions, visible (B, C, K)
    bool. Returns (B, C, H, rank), differentiable in q and latent, or None where the kernel does not
    apply."""
    B, S, _ = latent.shape
    if not _applies(q, latent, idx.shape[-1], rank):
        return None
    offsets = (torch.arange(B, device=idx.device) * S).view(B, 1, 1)
    rows = torch.where(visible, idx + offsets, -1).contiguous()
    return _LatentAttention.apply(q, latent, rows, scale, rank)
