"""Causal attention of query runs over key ranges on CPU, without a mask: torch's fused CPU kernel
(flash) on each run's own keys (causal) and on the keys before them (all visible), merged by their
log-sum-exps (``PieceAttention``). Two uses (orthon.pretrain.attention's ``_run_attention``): a
context-parallel rank's runs of a longer sequence over every key before them, and packed documents
(``document_pieces``): each document's queries see only its own keys, so the pieces skip every
cross-document block instead of masking it, and no (T, S) mask is built or kept for backward.
(B, H, L, D) tensors of one dtype."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def piece_forward(q, k, v, scale):
    """(out, lse) of n queries at the last n of b keys, bottom-right causal."""
    a = k.shape[2] - q.shape[2]
    out, lse = _cpu_flash(q, k[:, :, a:], v[:, :, a:], 0.0, True, scale=scale)
    if a:
        out_prefix, lse_prefix = _cpu_flash(q, k[:, :, :a], v[:, :, :a], 0.0, False, scale=scale)
        total = torch.logaddexp(lse_prefix, lse)
        out = (out_prefix.float() * (lse_prefix - total).exp()[..., None]
               + out.float() * (lse - total).exp()[..., None]).to(q.dtype)
        lse = total
    return out, lse


def piece_backward(grad, q, k, v, out, lse, scale):
    """(dq, dk, dv) of ``piece_forward``: the kernel's backward on each part with the merged output and
    log-sum-exp (those of the softmax over all b keys, so each part's gradients are its share)."""
    a = k.shape[2] - q.shape[2]
    dq, dk, dv = _cpu_flash_backward(grad, q, k[:, :, a:], v[:, :, a:], out, lse, 0.0, True, scale=scale)
    if a:
        dq_prefix, dk_prefix, dv_prefix = _cpu_flash_backward(grad, q, k[:, :, :a], v[:, :, :a], out, lse, 0.0,
                                                              False, scale=scale)
        dq, dk, dv = dq + dq_prefix, torch.cat([dk_prefix, dk], 2), torch.cat([dv_prefix, dv], 2)
    return dq, dk, dv


class PieceAttention(torch.autograd.Function):
    """Attention of ``pieces`` (row, q_start, q_end, k_start, k_end): queries [q_start, q_end) of batch row
    ``row`` (None: every row) at the last positions of keys [k_start, k_end), bottom-right causal; every
    query in exactly one piece (a key may serve several). Without a mask: a materialised (n, b) mask would
    be kept for backward and at long lengths outweigh the layer's activations. (B, H, L, D) tensors of
    one dtype."""

    @staticmethod
    def forward(ctx, q, k, v, pieces, scale):
        with torch.autocast("cpu", enabled=False):
            out = q.new_zeros(q.shape)
            lse = q.new_zeros(q.shape[:3], dtype=torch.float32)
            for row, qa, qb, ka, kb in pieces:
                r = slice(None) if row is None else slice(row, row + 1)
                o, l = piece_forward(q[r, :, qa:qb], k[r, :, ka:kb], v[r, :, ka:kb], scale)
                out[r, :, qa:qb], lse[r, :, qa:qb] = o, l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pieces, ctx.scale = pieces, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            grad = grad.to(q.dtype)
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            for row, qa, qb, ka, kb in ctx.pieces:
                r = slice(None) if row is None else slice(row, row + 1)
                g = piece_backward(grad[r, :, qa:qb].contiguous(), q[r, :, qa:qb], k[r, :, ka:kb], v[r, :, ka:kb],
                                   out[r, :, qa:qb], lse[r, :, qa:qb].contiguous(), ctx.scale)
                dq[r, :, qa:qb] = g[0]
                dk[r, :, ka:kb] += g[1]
                dv[r, :, ka:kb] += g[2]
        return dq, dk, dv, None, None


def document_pieces(runs: list[tuple[int, int]], k_docs: torch.Tensor) -> list[tuple] | None:
    """The pieces of query ``runs`` (positions [a, b), in the queries' order) over packed documents:
    ``k_docs`` (B, S) the document of every key position, each document one contiguous span of a row.
    None when a row's documents are not contiguous (the mask then says what each query sees)."""
    pieces = []
    for row, docs in enumerate(k_docs):
        starts = torch.cat([docs.new_zeros(1), torch.nonzero(docs[1:] != docs[:-1]).flatten() + 1])
        if torch.unique(docs[starts]).numel() != starts.numel():
            return None
        starts = starts.tolist()
        spans = list(zip(starts, starts[1:] + [docs.numel()]))
        at = 0  # the run's first query row
        for a, b in runs:
            for s, e in spans:
                lo, hi = max(a, s), min(b, e)
                if lo < hi:
                    pieces.append((row, at + lo - a, at + hi - a, s, hi))
            at += b - a
    return pieces
