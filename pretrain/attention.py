"""Multi-head latent attention (MLA) with the DSA lightning indexer.

Parameters are laid out as transformers' ``GlmMoeDsaAttention`` (q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, indexer.*). Three ways to compute the
attention itself, all the same function of the weights:

- expanded: per-head keys/values from W_KVB, fused SDPA, causal or with a top-k mask. Fastest for
  short sequences (T near index_topk).
- absorbed (MQA form): keys and values are the per-token latent [c_kv; k_rope] shared by all heads;
  W_KVB's key half is folded into the queries, its value half applied after attention. With top-k
  indices, each query gathers only its k latents, in query chunks, so memory is chunk x k x latent.
  This is also the decode path: the KV cache holds exactly that latent.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

import orthon.pretrain.sparse_kernels as sparse_kernels
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.layers import RMSNorm, apply_rope, compute_dtype
from orthon.pretrain.run_attention import PieceAttention, document_pieces
from orthon.pretrain.topk import deterministic_topk

# Queries per chunk when only the top-k indices are needed: small enough that the causal triangle
# saves most of the (T, T) scoring work, large enough that each chunk's matmuls stay efficient.
SELECT_CHUNK = 128


# ---------------------------------------------------------------- pure functions
def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Lightning-indexer scores I[t, s] = sum_j w[t, j] * ReLU(scale * q[t, j] . k[s]).

    q: (B, C, n, d) indexer queries; w: (B, C, n) head weights; k: (B, S, d) keys -> (B, C, S), fp32.
    """
    logits = torch.einsum("bcnd,bsd->bcns", q.float(), k.float())
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        logits = F.relu(logits * scale)
    else:
        logits = logits.mul_(scale).relu_()  # selection only: the same values, no copies kept for backward
    return torch.einsum("bcn,bcns->bcs", w.float(), logits)


def causal_mask(q_slots: torch.Tensor, num_keys: int) -> torch.Tensor:
    """(C, S) bool: key slot s is visible to the query at slot q_slots[c]."""
    return torch.arange(num_keys, device=q_slots.device) <= q_slots[:, None]


def select_topk(scores: torch.Tensor, q_slots: torch.Tensor, k: int, visible: torch.Tensor | None = None,
                ordered: bool = True) -> torch.Tensor:
    """Top-k key indices per query among visible keys (ties to the lower position). (B, C, S) -> (B, C, k),
    from the highest score down unless ``ordered`` is False (the same set, in any order).

    visible: (B, C, S) bool, default causal. Rows with fewer than k visible keys also return some
    invisible keys; attention masks those out.
    """
    if visible is None:
        visible = causal_mask(q_slots, scores.shape[-1])
    return deterministic_topk(scores.masked_fill(~visible, float("-inf")), k, ordered)


def document_mask(q_docs: torch.Tensor, k_docs: torch.Tensor, q_slots: torch.Tensor) -> torch.Tensor:
    """(B, C, S) bool: causal and within the same document (packed sequences)."""
    return causal_mask(q_slots, k_docs.shape[1])[None] & (q_docs[:, :, None] == k_docs[:, None, :])


# ---------------------------------------------------------------- absorbed (MQA) form
# The one copy of MLA's absorbed math: the model's gathered sparse path, the fused decode step
# (orthon.engine.fused_decode) and the indexer fit (orthon.midtrain.indexer_fit) all call these.
def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x[..., h, :] @ w[h] for every head h: (..., H, n) x (H, n, m) -> (..., H, m).

    With w = W_UK (W_KVB's key half, (H, nope, R)) it maps no-rope query halves into the latent space.
    It is linear in x, so applied to a weight matrix's columns it folds W_UK into the query projection,
    and applied to o_proj's per-head blocks with w = W_UV it folds the value half into o_proj."""
    return torch.einsum("...hn,hnm->...hm", x, w)


def absorbed_query(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[W_UK[h]^T q_nope[h]; q_rope[h]] per head: (..., H, nope), (..., H, rope) -> (..., H, R + rope),
    the query whose dot product with a token's latent [c_kv; k_rope] is MLA's q . k."""
    return torch.cat([head_matmul(q_nope, w_uk), q_rope], dim=-1)


def expand_values(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """W_KVB's value half applied after attention: (..., H, R) latent outputs -> (..., H, v_head_dim).
    w_uv: (H, v, R)."""
    return torch.einsum("...hr,hvr->...hv", o_lat, w_uv)


def _row_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (B, *M, X, Y) @ b per row: b (B, Y, Z) shared by the row's M groups (one bmm, b not copied) or
    b (B, *M, Y, Z) of its own per group."""
    if b.dim() == 3 and a.dim() > 3:
        B, Y = a.shape[0], a.shape[-1]
        return torch.bmm(a.reshape(B, -1, Y), b).view(*a.shape[:-1], b.shape[-1])
    return torch.matmul(a, b)


def latent_scores(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention logits q . k * scale of absorbed queries (``absorbed_query``) over latent keys
    [c_kv; k_rope] (the no-rope part meets W_UK^T q_nope, the rope part the rotated q_rope).

    q: (B, *M, H, D); keys: (B, S, D), every key of the row, or (B, *M, K, D), each query group's own
    selected keys. Returns (B, *M, H, S or K)."""
    return _row_matmul(q, keys.transpose(-1, -2)) * scale


def latent_attention(q: torch.Tensor, keys: torch.Tensor, scale: float, rank: int,
                     visible: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of absorbed queries over latent keys, the values being the keys' first
    ``rank`` numbers (c_kv): (B, *M, H, R) latent outputs, for ``expand_values`` (or a folded o_proj).

    q, keys: as ``latent_scores``; visible: bool, broadcastable to the scores (B, *M, H, S or K); the
    softmax runs in fp32."""
    scores = latent_scores(q, keys, scale).float()
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return _row_matmul(torch.softmax(scores, dim=-1).to(q.dtype), keys[..., :rank])


def gather_rows(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """rows (B, S, D), idx (B, *K) int positions < S -> (B, *K, D): each batch row's selected rows, by
    one index_select on the buffer seen flat (a gather with an expanded index is ~10x slower)."""
    B, S, D = rows.shape
    return rows.reshape(B * S, D).index_select(0, _flat_rows(idx, S)).view(*idx.shape, D)


def _flat_rows(idx: torch.Tensor, S: int) -> torch.Tensor:
    """idx (B, *K) positions < S -> (B * prod(K),) row numbers in the (B * S) rows seen flat."""
    B = idx.shape[0]
    return (idx.reshape(B, -1) + (torch.arange(B, device=idx.device) * S)[:, None]).reshape(-1)


class _GatheredLatentAttention(torch.autograd.Function):
    """``latent_attention`` over each query's own gathered latents (``gather_rows(latent, idx)``), with
    the gather inside and a hand-written backward, for training. Autograd's version casts the gathered
    (B, C, k, D) keys per use under autocast (the gather runs on the fp32 latents), copies their value
    slice per product, and in backward zero-fills a full-size gradient for that slice and adds the two
    uses' gradients in extra passes; here the latents are cast once before the gather, the products take
    the whole keys (the rope columns' share of the output is dropped), and the keys' gradient is one fp32
    tensor (its products sum over the heads only), scattered into the latents' gradient. Softmax in
    fp32, as latent_attention."""

    @staticmethod
    def forward(ctx, q, latent, idx, visible, scale, rank):
        dtype = compute_dtype(q)
        with torch.autocast(q.device.type, enabled=False):
            q_c = q.to(dtype)
            keys = gather_rows(latent.to(dtype), idx)  # (B, C, k, D)
            scores = latent_scores(q_c, keys, scale).float()  # as latent_attention rounds them
            probs = torch.softmax(scores.masked_fill_(~visible, float("-inf")), dim=-1)
            out = torch.matmul(probs.to(dtype), keys)
        ctx.save_for_backward(q_c, keys, idx, probs)
        ctx.scale, ctx.dtypes, ctx.latent_shape = scale, (q.dtype, latent.dtype), latent.shape
        return out[..., :rank]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        # The Trainer calls backward inside its autocast region: the dtypes here are chosen, not cast.
        with torch.autocast(grad.device.type, enabled=False):
            return _GatheredLatentAttention._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        q_c, keys, idx, probs = ctx.saved_tensors
        B, S, D = ctx.latent_shape
        grad = F.pad(grad.to(q_c.dtype), (0, D - grad.shape[-1]))  # the rope columns had no output
        grad_probs = torch.matmul(grad, keys.transpose(-1, -2)).float()
        # softmax backward, p * (dp - sum(p * dp)), times the logits' scale
        grad_scores = grad_probs.sub_((grad_probs * probs).sum(-1, keepdim=True)).mul_(probs).mul_(ctx.scale)
        grad_q = torch.matmul(grad_scores.to(q_c.dtype), keys)
        # Both uses of the keys in one product (the scores' and the values' gradients, stacked over the
        # heads): (B, C, k, D) in fp32, written once.
        grad_keys = torch.matmul(torch.cat([grad_scores, probs], dim=-2).transpose(-1, -2),
                                 torch.cat([q_c, grad], dim=-2).float())
        grad_latent = torch.zeros(B * S, D, dtype=torch.float32, device=keys.device)
        grad_latent.index_add_(0, _flat_rows(idx, S), grad_keys.reshape(-1, D))
        return (grad_q.to(ctx.dtypes[0]), grad_latent.view(B, S, D).to(ctx.dtypes[1]), None, None, None, None)


def absorbed_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    q_slots: torch.Tensor,
    indices: torch.Tensor | None,
    scale: float,
    chunk: int,
    rank: int,
    q_docs: torch.Tensor | None = None,
    k_docs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in the absorbed (MQA) form, in query chunks.

    q: (B, T, H, D) absorbed queries (``absorbed_query``); latent: (B, S, D) per-token keys
    [c_kv; k_rope], the values being latent[..., :rank]; q_slots: (T,) key slot of each query
    (causality); indices: (B, T, k) selected key slots or None for all causal keys; q_docs (B, T) and
    k_docs (B, S): document of each query and key, attention stays within a document (packed
    sequences; left padding is a document of its own).
    Returns (B, T, H, rank) attention-weighted latents (``expand_values`` maps them to values).
    """
    S = latent.shape[1]
    outputs = []
    for start in range(0, q.shape[1], chunk):
        qc = q[:, start : start + chunk]
        slots = q_slots[start : start + chunk]
        docs = None if k_docs is None else q_docs[:, start : start + chunk]
        if indices is None:
            keys = latent
            visible = causal_mask(slots, S)[None] if k_docs is None else document_mask(docs, k_docs, slots)
        else:
            idx = indices[:, start : start + chunk]  # (B, C, k)
            visible = idx <= slots[None, :, None]
            if k_docs is not None:
                visible = visible & (k_docs.gather(1, idx.reshape(idx.shape[0], -1)).view_as(idx) == docs[..., None])
            out = sparse_kernels.latent_attention(qc, latent, idx, visible, scale, rank)
            if out is not None:
                outputs.append(out)
                continue
            if torch.is_grad_enabled() and (q.requires_grad or latent.requires_grad):
                outputs.append(_GatheredLatentAttention.apply(qc, latent, idx, visible[:, :, None, :], scale, rank))
                continue
            keys = gather_rows(latent, idx)  # (B, C, k, D)
        outputs.append(latent_attention(qc, keys, scale, rank, visible[:, :, None, :]))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # one chunk: no copy


def attention_mask(indices, q_slots, num_keys, q_docs=None, k_docs=None, dtype=torch.float32):
    """SDPA mask, (B or 1, 1, T, S): None when plain causal attention does; with top-k indices an additive
    mask (0 on the selected keys each query may see, -inf elsewhere) in ``dtype``, built from the k
    indices alone (the fused CPU kernel takes it as it is, where a bool mask is converted first: two
    passes over (B, T, S)); else a bool mask, causal within documents."""
    if indices is None and k_docs is None:
        return None
    if indices is None:
        return document_mask(q_docs, k_docs, q_slots).unsqueeze(1)
    B, T, _ = indices.shape
    seen = indices <= q_slots[None, :, None]  # rows short of k visible keys also hold invisible ones
    if k_docs is not None:
        seen = seen & (k_docs.gather(1, indices.reshape(B, -1)).view_as(indices) == q_docs[..., None])
    blocked = torch.full((B, T, num_keys), float("-inf"), dtype=dtype, device=indices.device)
    open_ = torch.zeros((), dtype=dtype, device=indices.device)
    return blocked.scatter_(-1, indices, torch.where(seen, open_, blocked[:, :, :1])).unsqueeze(1)


# Queries per SDPA call on CPU when a causal mask is given: rows [a, b) see no key at or past b, so each
# call takes only keys [0, b) (the fused kernel cannot skip masked blocks itself). Measured on CPU: the
# attention layer's step 9% faster at T = 1024; smaller chunks, or chunking T = 256, cost more than
# they save.
CAUSAL_QUERY_CHUNK = 256


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
         scale: float) -> torch.Tensor:
    """Scaled dot-product attention of (B, T, H, D) queries, (B, S, H, D) keys and (B, S, H, Dv) values
    -> (B, T, H, Dv). causal: no query sees a later key (queries and keys the same positions, T == S);
    with a mask too, the mask must say so as well (it is then trusted, and the key range cut per query
    chunk). torch's fused CPU kernel (flash, masks included) needs Dv == D and otherwise falls back to
    the unfused math path (scores, softmax and their backward all materialised, about 1.6x slower
    here): on CPU the values are zero-padded to D and the padding sliced off the output."""
    dv = v.shape[-1]
    if q.device.type == "cpu" and dv < q.shape[-1]:
        v = torch.cat([v, v.new_zeros(()).expand(*v.shape[:-1], q.shape[-1] - dv)], dim=-1)  # one write
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    T = q.shape[2]
    if mask is None or not causal or T != k.shape[2] or T <= CAUSAL_QUERY_CHUNK or q.device.type != "cpu":
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                             scale=scale)
    else:
        out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b],
                                                        attn_mask=mask[..., a:b, :b], scale=scale)
                         for a, b in _chunks(T, CAUSAL_QUERY_CHUNK)], dim=2)
    return out.transpose(1, 2)[..., :dv]


def sdpa_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[tuple[int, int]],
              mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``sdpa`` of queries that are runs of consecutive positions [a, b) of a longer sequence (a
    context-parallel rank's part, orthon.pretrain.context_parallel) over all its S keys: each run sees keys
    [0, b), causally aligned at the bottom right, without a mask (CUDA's fused kernels take the bias; on
    CPU ``_run_attention``), or as ``mask`` (B or 1, 1, T, S) says where documents are masked."""
    outs, row = [], 0
    for a, b in runs:
        n = b - a
        rows = slice(row, row + n)
        if mask is None and q.device.type == "cpu":
            outs.append(_run_attention(q[:, rows], k[:, :b], v[:, :b], scale))
        else:
            if mask is None:
                # Here, not at the top: the module imports torch._dynamo (a second per process start).
                from torch.nn.attention.bias import causal_lower_right

                run_mask = causal_lower_right(n, b)
            else:
                run_mask = mask[..., rows, :b]
            outs.append(sdpa(q[:, rows], k[:, :b], v[:, :b], run_mask, False, scale))
        row += n
    return torch.cat(outs, dim=1)


def _run_attention(q, k, v, scale, pieces=None):
    """(B, n, H, D) queries, the last n of (B, b, H, D) keys and values (values zero-padded to D: the CPU
    kernel needs it), bottom-right causal -> (B, n, H, Dv); with ``pieces``, each piece's queries over its
    keys (orthon.pretrain.run_attention.PieceAttention)."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = torch.cat([v, v.new_zeros(()).expand(*v.shape[:-1], q.shape[-1] - dv)], dim=-1)
    dtype = compute_dtype(q)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    if pieces is None:  # every row's queries at the last of its keys
        pieces = [(None, 0, q.shape[2], 0, k.shape[2])]
    out = PieceAttention.apply(q, k, v, pieces, scale)
    return out.transpose(1, 2)[..., :dv]


def _chunks(n: int, size: int):
    return [(a, min(a + size, n)) for a in range(0, n, size)]


@torch.no_grad()
def max_attention_logit(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
               q_slots: torch.Tensor | None = None) -> torch.Tensor:
    """max over attended (query, key, head) of q.k * scale; q: (B, T, H, D), k: (B, S, H, D); without a
    mask, causal by the queries' positions ``q_slots`` (default 0 .. T - 1). By query chunks: the whole (B, H, T, S) logits
    would be the largest tensor of the step at long lengths (2 GB at T = 8192 for the tiny model)."""
    if q_slots is None:
        q_slots = torch.arange(q.shape[1], device=q.device)
    best = q.new_full((), float("-inf"), dtype=torch.float32)
    for a, b in _chunks(q.shape[1], CAUSAL_QUERY_CHUNK):
        logits = torch.einsum("bthd,bshd->bhts", q[:, a:b], k).float().mul_(scale)
        seen = causal_mask(q_slots[a:b], k.shape[1]) if mask is None else mask[..., a:b, :]
        logits = logits.add_(seen) if seen.dtype != torch.bool else logits.masked_fill_(~seen, float("-inf"))
        best = torch.maximum(best, logits.amax())
    return best


# ---------------------------------------------------------------- modules
class Indexer(nn.Module):
    """DSA lightning indexer (parameter names as transformers' GlmMoeDsaIndexer). Trainable: nothing
    here runs under no_grad, so mid-training can fit it with its KL objective."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.scale = self.head_dim**-0.5

    def rope_first(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The indexer rotates its first rope_dim numbers and passes the rest.
        rope, rest = x.split([self.rope_dim, x.shape[-1] - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(rope, cos, sin), rest], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, T, d) indexer keys of new tokens (what the cache stores)."""
        return self.rope_first(self.k_norm(self.wk(x)), cos, sin)

    def queries(self, x, q_resid, cos, sin):
        """(B, T, n, d) queries and (B, T, n) head weights."""
        B, T, _ = x.shape
        q = self.rope_first(self.wq_b(q_resid).view(B, T, self.n_heads, self.head_dim), cos, sin)
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, w


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, runtime: RuntimeOptions | None = None):
        super().__init__()
        self.config = config
        self.runtime = runtime or RuntimeOptions()
        self.layer = layer
        c = config
        self.n_heads = c.num_attention_heads
        self.nope, self.rope, self.v_dim, self.rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.scale = c.qk_head_dim**-0.5
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.n_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, self.rank + self.rope, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = nn.Linear(self.rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.indexer = Indexer(c) if c.indexer_type(layer) == "full" else None
        # When set, full forwards record the largest attention logit q.k * scale over the pairs attended
        # (the quantity Muon Split keeps bounded); read by GLMForCausalLM.max_attention_logit().
        self.track_max_logit = False
        self.max_logit: torch.Tensor | None = None

    # -- the pieces
    def project(self, x, cos, sin):
        """(q_resid, q_nope, q_rope, latent) of new tokens x (B, T, hidden): the normed q_a output, the
        per-head query halves (B, T, H, nope) and (B, T, H, rope) (RoPE applied) and the per-token
        latent [c_kv; k_rope] (B, T, R + rope) that the KV cache holds."""
        B, T, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(B, T, self.n_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), apply_rope(k_rope, cos, sin)], dim=-1)
        return q_resid, q_nope, apply_rope(q_rope, cos, sin), latent

    def _select(self, x, q_resid, cos, sin, index_keys, q_slots, prev_topk, want_scores, q_docs=None, k_docs=None,
                ordered=True):
        """Top-k indices for this layer (own indexer or the shared previous one) and, when asked, the
        differentiable index scores. ordered=False: the selected set in any order (when nothing reads the order)."""
        if self.indexer is None:
            return prev_topk, None
        if not want_scores:
            # The indices alone are discrete: nothing to differentiate, so no graph and no saved tensors.
            with torch.no_grad():
                q_idx, w_idx = self.indexer.queries(x, q_resid, cos, sin)
                return self._pick(q_idx, w_idx, index_keys, q_slots, q_docs, k_docs, ordered), None
        q_idx, w_idx = self.indexer.queries(x, q_resid, cos, sin)
        chunk = self.runtime.query_chunk
        picks, kept = [], []
        for start in range(0, x.shape[1], chunk):
            scores = index_scores(
                q_idx[:, start : start + chunk], w_idx[:, start : start + chunk], index_keys, self.indexer.scale
            )
            slots = q_slots[start : start + chunk]
            visible = None if k_docs is None else document_mask(q_docs[:, start : start + chunk], k_docs, slots)
            picks.append(select_topk(scores.detach(), slots, self.config.index_topk, visible))
            kept.append(scores)
        return torch.cat(picks, dim=1), torch.cat(kept, dim=1)

    def _pick(self, q_idx, w_idx, index_keys, q_slots, q_docs, k_docs, ordered=True):
        """The top-k indices alone, scoring each query chunk against only the keys it can see when the
        queries are the whole sequence (slots 0..T-1): causal attention leaves the keys past a chunk's
        last query invisible, so about half the scores and selection work of a full (T, T) pass is
        skipped. Keeps at least k columns, so rows with fewer visible keys pad with the same invisible
        (lowest-position) keys a full-width selection returns: the indices are identical."""
        T, S, k = q_idx.shape[1], index_keys.shape[1], self.config.index_topk
        if S == T:
            picked = sparse_kernels.causal_topk(q_idx, w_idx, index_keys, k, self.indexer.scale, q_docs, ordered)
            if picked is not None:
                return picked
        chunk = min(self.runtime.query_chunk, SELECT_CHUNK)
        picks = []
        for start in range(0, T, chunk):
            stop = min(start + chunk, T)
            width = min(S, max(stop, k)) if S == T else S
            keys = index_keys[:, :width]
            scores = index_scores(q_idx[:, start:stop], w_idx[:, start:stop], keys, self.indexer.scale)
            slots = q_slots[start:stop]
            visible = None if k_docs is None else document_mask(q_docs[:, start:stop], k_docs[:, :width], slots)
            picks.append(select_topk(scores, slots, k, visible, ordered))
        return torch.cat(picks, dim=1)

    def _expanded(self, q_nope, q_rope, latent, mask, q_slots=None, runs=None, pieces=None):
        """Attention through per-head keys and values; ``runs``: the queries are these position runs of the
        sequence (context parallelism), else the whole sequence; ``pieces``: packed documents, each
        document's queries over its own keys (CPU, no mask)."""
        B, T, H, _ = q_nope.shape
        S = latent.shape[1]
        kv = self.kv_b_proj(latent[..., : self.rank]).view(B, S, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, latent[..., None, self.rank :].expand(B, S, H, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.track_max_logit:
            self.max_logit = max_attention_logit(q, k, mask, self.scale, q_slots)
        if pieces is not None:
            return _run_attention(q, k, v, self.scale, pieces)
        if runs is not None:
            return sdpa_runs(q, k, v, runs, mask, self.scale)
        return sdpa(q, k, v, mask, True, self.scale)

    def kv_b_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK (H, nope, R), W_UV (H, v, R)): the key and value halves of kv_b_proj, per head (views)."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def absorbed_queries(self, x, cos, sin):
        """(q_abs (B, T, H, R + rope), latent (B, T, R + rope), q_resid) of new tokens x: the layer's
        attention in absorbed form, ``latent_scores(q_abs, latent, self.scale)`` being its logits."""
        q_resid, q_nope, q_rope, latent = self.project(x, cos, sin)
        return absorbed_query(q_nope, q_rope, self.kv_b_halves()[0]), latent, q_resid

    def _absorbed(self, q_nope, q_rope, latent, q_slots, indices, q_docs=None, k_docs=None):
        w_uk, w_uv = self.kv_b_halves()
        o = absorbed_attention(absorbed_query(q_nope, q_rope, w_uk), latent, q_slots, indices, self.scale,
                               self.runtime.query_chunk, self.rank, q_docs, k_docs)
        return expand_values(o, w_uv)

    # -- the layer
    def forward(self, x, cos, sin, q_slots, cache=None, prev_topk=None, want_index_scores=False, doc_ids=None,
                context=None):
        """x: (B, T, hidden); q_slots: (T,) cache slots of the new tokens; doc_ids: (B, T) document of each
        new token (packed sequences, left padding), attention stays inside documents. context: this rank's
        ContextShard of the sequence (context parallelism): x holds its positions (q_slots), and the
        keys are every rank's, gathered. Returns (out, topk, index_scores)."""
        B, T, _ = x.shape
        q_resid, q_nope, q_rope, latent = self.project(x, cos, sin)
        index_keys = None
        if self.indexer is not None and self.runtime.sparse_attention:
            with torch.set_grad_enabled(torch.is_grad_enabled() and want_index_scores):  # else selection only
                index_keys = self.indexer.keys(x, cos, sin)
        k_docs = doc_ids
        if context is not None:
            latent = context.gather(latent)
            index_keys = None if index_keys is None else context.gather(index_keys)
            k_docs = context.key_docs
        if cache is not None:
            latent, index_keys = cache.append(self.layer, latent, index_keys)
            k_docs = cache.docs_until(q_slots[-1] + 1) if doc_ids is not None else None
        S = latent.shape[1]
        topk, scores = None, None
        if self.runtime.sparse_attention and (S > self.config.index_topk or want_index_scores):
            # Without a cache nothing reads the selection's order (a KV cache's decode path does).
            topk, scores = self._select(x, q_resid, cos, sin, index_keys, q_slots, prev_topk, want_index_scores,
                                        doc_ids, k_docs, ordered=cache is not None)
            if S <= self.config.index_topk:
                topk = None  # every causal key is selected: plain causal attention
        if cache is not None or (topk is not None and self._use_gather(T, x)):
            out = self._absorbed(q_nope, q_rope, latent, q_slots, topk, doc_ids, k_docs)
        else:
            pieces = None
            if (topk is None and k_docs is not None and x.device.type == "cpu" and not self.track_max_logit
                    and (context is not None or S == T)):
                # Packed documents: each over its own keys, no (T, S) mask (orthon.pretrain.run_attention).
                pieces = document_pieces(context.runs if context is not None else [(0, T)], k_docs)
            mask = None if pieces is not None else attention_mask(topk, q_slots, S, doc_ids, k_docs, q_nope.dtype)
            # A top-k mask already holds each query's own keys; causal attention needs the runs.
            runs = context.runs if context is not None and topk is None else None
            out = self._expanded(q_nope, q_rope, latent, mask, q_slots, runs, pieces)
        return self.o_proj(out.reshape(B, T, -1)), topk, scores

    def _use_gather(self, T: int, x: torch.Tensor) -> bool:
        impl = self.runtime.sparse_impl
        if impl != "auto":
            return impl == "gather"
        # On CPU the sparse kernels make the gathered form the faster one at any length.
        return T >= self.runtime.gather_min_len or (x.device.type == "cpu" and sparse_kernels.native.load() is not None)
