"""MLA with the DSA lightning indexer as MindSpore cells (names and layouts as orthon.pretrain.attention).

One form of the attention here: expanded per-head keys and values with a boolean mask (causal, within
documents, and the indexer's top-k keys when DSA is on), the same function as the torch model's mask,
gather and absorbed paths. The top-k is the torch model's deterministic one: every fp32 score becomes
a distinct int64 key (order-preserving image of the float in the high 32 bits, reversed position in
the low 32 bits), so ties go to the lower position and both backends select the same keys.
"""
from __future__ import annotations

import numpy as np

from orthon.backends.mindspore.layers import LayerNorm, Linear, RMSNorm, apply_rope
from orthon.backends.mindspore.runtime import ms
from orthon.pretrain.config import ModelConfig, RuntimeOptions

ops, nn = ms.ops, ms.nn

_LOW = 1 << 32
_MAGNITUDE = 0x7FFFFFFF


# ---------------------------------------------------------------- pure functions
def ordered_key(scores):
    """int64 keys strictly monotone in (score, -position) along the last dim (torch: pretrain.topk)."""
    s = ops.stop_gradient(scores).astype(ms.float32) + 0.0  # -0.0 -> +0.0: the two zeros tie
    bits = s.view(ms.int32).astype(ms.int64)
    # Negative floats order backwards as signed ints: flip their magnitude bits.
    key = ops.where(bits < 0, ops.bitwise_xor(bits, ms.Tensor(_MAGNITUDE, ms.int64)), bits)
    positions = ms.Tensor(np.arange(scores.shape[-1], dtype=np.int64))
    return key * _LOW + (_LOW - 1 - positions)


def deterministic_topk(scores, k: int):
    """Indices of the k largest scores along the last dim, ties to the lower position, largest first."""
    k = min(k, scores.shape[-1])
    return ops.topk(ordered_key(scores), k)[1]


def visible_keys(seq_len: int, doc_ids=None):
    """(B or 1, T, T) bool: key s is visible to query t when causal (s <= t) and, with doc_ids (B, T),
    in the same document."""
    allowed = ms.Tensor(np.tril(np.ones((1, seq_len, seq_len), bool)))
    if doc_ids is None:
        return allowed
    return ops.logical_and(allowed, doc_ids[:, :, None] == doc_ids[:, None, :])


def index_scores(q, w, k, scale: float):
    """I[t, s] = sum_j w[t, j] * ReLU(scale * q[t, j] . k[s]). q (B, T, n, d), w (B, T, n), k (B, S, d)
    -> (B, T, S)."""
    B, T, n, d = q.shape
    logits = ops.matmul(q.reshape(B, T * n, d), k.transpose(0, 2, 1)).reshape(B, T, n, -1) * scale
    return (w.expand_dims(-1) * ops.relu(logits)).sum(2)


def select_topk(scores, visible, k: int):
    """Top-k visible keys per query: (B, T, S) scores -> (B, T, k) indices. Rows with fewer than k visible
    keys also return invisible ones; the attention mask drops those."""
    return deterministic_topk(ops.masked_fill(scores, ops.logical_not(visible), float("-inf")), k)


def chosen_mask(indices, num_keys: int):
    """(B, T, S) bool: the keys named by indices (B, T, k)."""
    B, T, k = indices.shape
    zeros = ops.zeros((B, T, num_keys), ms.int32)
    return ops.tensor_scatter_elements(zeros, indices.astype(ms.int32), ops.ones((B, T, k), ms.int32), 2) > 0


# ---------------------------------------------------------------- cells
class Indexer(nn.Cell):
    """DSA lightning indexer (parameter names as transformers' GlmMoeDsaIndexer)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(config.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(config.hidden_size, self.n_heads)
        self.scale = self.head_dim**-0.5

    def rope_first(self, x, cos, sin):
        # The indexer rotates its first rope_dim numbers and passes the rest.
        return ops.cat((apply_rope(x[..., : self.rope_dim], cos, sin), x[..., self.rope_dim :]), -1)

    def keys(self, x, cos, sin):
        return self.rope_first(self.k_norm(self.wk(x)), cos, sin)

    def queries(self, x, q_resid, cos, sin):
        B, T, _ = x.shape
        q = self.rope_first(self.wq_b(q_resid).reshape(B, T, self.n_heads, self.head_dim), cos, sin)
        return q, self.weights_proj(x) * self.n_heads**-0.5


class MLAttention(nn.Cell):
    def __init__(self, config: ModelConfig, layer: int, runtime: RuntimeOptions):
        super().__init__()
        c = config
        self.config, self.runtime = c, runtime
        self.n_heads = c.num_attention_heads
        self.nope, self.rope, self.v_dim, self.rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.scale = c.qk_head_dim**-0.5
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank)
        self.q_b_proj = Linear(c.q_lora_rank, self.n_heads * c.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, self.rank + self.rope, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = Linear(self.rank, self.n_heads * (self.nope + self.v_dim))
        self.o_proj = Linear(self.n_heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.indexer = Indexer(c) if c.indexer_type(layer) == "full" else None

    def project(self, x, cos, sin):
        """(q_resid, q_nope (B, T, H, nope), q_rope (B, T, H, rope) rotated, latent [c_kv; k_rope])."""
        B, T, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).reshape(B, T, self.n_heads, self.nope + self.rope)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]
        kv = self.kv_a_proj_with_mqa(x)
        latent = ops.cat((self.kv_a_layernorm(kv[..., : self.rank]), apply_rope(kv[..., self.rank :], cos, sin)), -1)
        return q_resid, q_nope, apply_rope(q_rope, cos, sin), latent

    def attend(self, q_nope, q_rope, latent, allowed):
        """Softmax attention (fp32) of per-head queries over expanded keys/values where ``allowed``
        (B or 1, T, S) -> (B, T, H, v)."""
        B, T, H, _ = q_nope.shape
        S = latent.shape[1]
        kv = self.kv_b_proj(latent[..., : self.rank]).reshape(B, S, H, self.nope + self.v_dim)
        k_rope = ops.broadcast_to(latent[:, :, None, self.rank :], (B, S, H, self.rope))
        k = ops.cat((kv[..., : self.nope], k_rope), -1).transpose(0, 2, 3, 1)  # (B, H, D, S)
        v = kv[..., self.nope :].transpose(0, 2, 1, 3)  # (B, H, S, v)
        q = ops.cat((q_nope, q_rope), -1).transpose(0, 2, 1, 3)  # (B, H, T, D)
        scores = ops.matmul(q, k) * self.scale
        scores = ops.masked_fill(scores, ops.logical_not(allowed.expand_dims(1)), float("-inf"))
        return ops.matmul(ops.softmax(scores, -1), v).transpose(0, 2, 1, 3)

    def construct(self, x, cos, sin, prev_topk=None, doc_ids=None):
        """x (B, T, hidden); doc_ids (B, T) or None. Returns (out, topk): the top-k key indices this
        layer attended to (for the next IndexShare "shared" layer), or None for all causal keys."""
        B, T, _ = x.shape
        q_resid, q_nope, q_rope, latent = self.project(x, cos, sin)
        allowed = visible_keys(T, doc_ids)
        topk = None
        if self.runtime.sparse_attention and T > self.config.index_topk:
            if self.indexer is None:
                topk = prev_topk
            else:
                q_idx, w_idx = self.indexer.queries(x, q_resid, cos, sin)
                scores = index_scores(q_idx, w_idx, self.indexer.keys(x, cos, sin), self.indexer.scale)
                topk = select_topk(scores, ops.broadcast_to(allowed, scores.shape), self.config.index_topk)
            if topk is not None:
                allowed = ops.logical_and(allowed, chosen_mask(topk, T))
        out = self.attend(q_nope, q_rope, latent, allowed)
        return self.o_proj(out.reshape(B, T, -1)), topk
