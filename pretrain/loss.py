"""The LM loss: next-token cross-entropy, optionally over chunks of positions so that neither forward
nor backward holds the full (positions x vocab) logits (long-context training)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

import orthon.pretrain.fused_kernels as fused_kernels
from orthon.data.loader import IGNORE_INDEX
from orthon.pretrain.layers import compute_dtype

# Logits per chunk of the fused output-head loss when the caller sets none: 512 rows of a 4k vocabulary,
# 8 MB of fp32, so that the passes over them (log-sum-exp, softmax, the two gradient matmuls) run from
# cache rather than memory. Measured on the AMD EPYC (Zen 3, 1 MB of L2, 32 MB of L3): the training step
# at 8 x 256 is 2-5% faster than with 256-row chunks (the logits GEMM at 512 rows runs at 96 against 70
# GFLOP/s, and the head's gradient is accumulated half as often).
DEFAULT_LOSS_ROWS = 1 << 21


def default_loss_chunk(vocab_size: int) -> int:
    return max(16, DEFAULT_LOSS_ROWS // vocab_size)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy in fp32 of (..., V) logits against (...) labels (-100 ignored)."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def _onednn_linear_applies(h: torch.Tensor, w_t: torch.Tensor) -> bool:
    """Whether the chunks' logits of h @ w_t come from oneDNN's fp32 linear rather than MKL's GEMM: a (rows x D) by
    (D x V) product with V in the thousands and D in the hundreds is the one shape of the step where
    oneDNN is much faster on CPU (126 against 96 GFLOP/s at 512 x 256 x 4096 on the AMD EPYC, 109 against
    70 at 256 rows; the gradient products run as fast on either). The op is the one torch.compile's CPU
    backend calls for fp32 linears; a torch built without oneDNN takes MKL."""
    return (h.device.type == "cpu" and h.dtype == w_t.dtype == torch.float32 and h.is_contiguous()
            and w_t.t().is_contiguous() and _HAS_ONEDNN_LINEAR
            and not (torch.is_grad_enabled() and (h.requires_grad or w_t.requires_grad)))  # it has no backward


_HAS_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _chunk_logits(h: torch.Tensor, w_t: torch.Tensor, buffer: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """A chunk's fp32 logits h @ w_t (w_t: the output head transposed, (D, V)): from oneDNN's linear where
    ``onednn``, else written into ``buffer`` (one for every chunk, so that it stays in cache) in fp32."""
    if onednn:
        return torch.ops.mkldnn._linear_pointwise(h, w_t.t(), None, "none", [], "")
    if buffer is not None and h.dtype == torch.float32:
        return torch.mm(h, w_t, out=buffer[: h.shape[0]])
    return (h @ w_t).float()


def _chunk_loss_and_logit_grad(logits: torch.Tensor, y: torch.Tensor, want_grad: bool):
    """Summed CE of one chunk's fp32 logits and, if wanted, d(sum)/d(logits) = softmax - onehot (zero on
    ignored rows), computed in place over the logits."""
    if want_grad:
        loss = fused_kernels.cross_entropy_grad_(logits, y, IGNORE_INDEX)
        if loss is not None:
            return loss, logits
    logprobs = torch.log_softmax(logits, dim=-1)  # one fused pass (max, sum of exp, write)
    counted = y != IGNORE_INDEX
    target = y.clamp(min=0)[:, None]
    loss = -(logprobs.gather(1, target).squeeze(1) * counted).sum()
    if not want_grad:
        return loss, None
    probs = logprobs.exp_()
    probs.scatter_add_(1, target, -counted[:, None].to(probs.dtype))
    ignored = (~counted).nonzero().squeeze(1)
    if ignored.numel():  # zero the ignored rows alone, not a pass over the whole chunk
        probs.index_fill_(0, ignored, 0.0)
    return loss, probs


def _summed_loss(hidden, weight, labels, chunk, need_h, need_w):
    """(sum of CE, d/dhidden or None, d/dweight or None), chunk rows at a time; the gradients in fp32."""
    dtype = compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        # The transposed view, not a contiguous copy: the GEMM reads it as fast, and the copy's strided
        # reads of the whole head cost 1-5 ms a step at 8 x 256 (measured on the native-bf16 Xeon).
        w_t = w.t()
        total = hidden.new_zeros((), dtype=torch.float32)
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        # One fp32 logits buffer for every chunk (a new one each chunk lands on memory out of cache); oneDNN
        # writes its own (the allocator hands each chunk the block the last one freed).
        onednn = _onednn_linear_applies(hidden, w_t)
        buffer = None if onednn else hidden.new_empty((min(chunk, hidden.shape[0]), weight.shape[0]),
                                                      dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk].to(dtype)
            logits = _chunk_logits(h, w_t, buffer, onednn)
            loss, probs = _chunk_loss_and_logit_grad(logits, labels[start : start + chunk], need_h or need_w)
            total += loss
            if probs is None:
                continue
            probs = probs.to(dtype)
            if need_h:
                if dtype == torch.float32:  # written in place, not into a new tensor then copied
                    torch.mm(probs, w, out=grad_h[start : start + chunk])
                else:
                    grad_h[start : start + chunk] = probs @ w
            if need_w:
                if dtype == torch.float32:
                    grad_w.addmm_(probs.t(), h)
                else:
                    grad_w += (probs.t() @ h).float()
    return total, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    """sum CE(hidden @ weight.T, labels), both gradients computed during the forward chunk by chunk
    (the logits of a chunk are its gradient once softmaxed), so backward is two scalings: no logits kept,
    none recomputed."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):
        total, grad_h, grad_w = _summed_loss(hidden, weight, labels, chunk, *ctx.needs_input_grad[:2])
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        gh = None if grad_h is None else (grad_h * grad_out).to(h_dtype)
        gw = None if grad_w is None else (grad_w * grad_out).to(w_dtype)
        return gh, gw, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum of next-token cross-entropies of ``hidden @ weight.T`` against ``labels`` (-100 ignored).

    hidden: (..., D) final hidden states; weight: (V, D) output head; labels: (...) targets. Positions
    are processed ``chunk`` at a time, so at most chunk x V logits exist at once, in forward and
    backward. Equals F.cross_entropy(hidden @ weight.T, labels, reduction="sum") in value and gradient
    (first order only). Under autocast the matmuls run in its dtype, the softmax in fp32.
    """
    if chunk < 1:
        raise ValueError(f"chunk: must be positive, got {chunk}")
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(flat_h, weight, flat_y, chunk)
    return _summed_loss(flat_h, weight, flat_y, chunk, False, False)[0]  # evaluation: no gradient work
