"""The engine's model runner: the one-token decode step with fused weights, the same function as
``GLMForCausalLM.hidden_states`` on a cached single token, in far fewer and cheaper operations.

At decode batch sizes (a few rows) every matmul is a thin GEMM that streams its weights, and the
step's time is that streaming plus the per-op overhead of a few hundred small ops. ``DecodeWeights``
folds, once per weight version, what a cached token multiplies by:

- per layer, one input matmul for everything that reads the normed hidden state: q_a, kv_a and the
  indexer's key and head-weight projections;
- one query matmul from the q_a residual: the absorbed-attention queries (W_UK folded into the
  no-rope half of W_QB, per head), the rope half, and the indexer's queries;
- one output matmul: W_UV folded into o_proj;
- MoE layers: one matmul for the router and the shared expert's gate/up; the routed experts run
  only on the rows that chose them;
- the RMSNorms that feed a matmul (input, q_a, a dense layer's post-attention norm): their scale
  folded into its weight, the normalisation done inside the matmul's call.

Every piece of the step is a kernel of ``orthon.engine.decode_kernels`` where one applies (fp32 on a
CPU with AVX2, up to 256 rows for the matmuls, norms and MoE block): the thin matmuls on pre-packed
weights, RMSNorm, RoPE, the indexer's top-k, the attention over the cached latents, and an MoE
block's routing, experts and shared expert in one call. Elsewhere the same step runs in torch ops,
through the model's own absorbed-MLA functions (orthon.pretrain.attention: ``head_matmul``,
``latent_attention``, ``gather_rows``). The kernels are an inference engine's own implementation of
that math, as SGLang's are beside Megatron's: each is tested equal to the torch function it replaces
(tests/test_decode_kernels.py), and the whole step equal to the model's forward
(tests/test_engine_fused_decode.py).

The folded products sum in another order than the layer-by-layer forward, so logits agree to float
round-off (about 1e-6 relative), not bit for bit; the engine's ``logprobs: rescore`` mode records the
trainer's own log-probs whatever the decode path computed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orthon.pretrain.attention import MLAttention, gather_rows, head_matmul, latent_attention
from orthon.pretrain.cache import KVCache
from orthon.pretrain.layers import MLP, rope_cos_sin, rotate
from orthon.pretrain.model import GLMForCausalLM
from orthon.pretrain.moe import MoE, combine_experts, route, sort_by_expert
from orthon.engine.decode_kernels import (PackedMoE, PackedLinear, index_topk, latent_attention_step, rms_norm,
                                       rope_rows)
from orthon.pretrain.topk import deterministic_topk


class _Rotation:
    """RoPE at one decode step's positions: cos, sin (B or 1, rope/2). ``rotation(x, rope_dim)`` rotates
    the first rope_dim numbers (default all) of each vector of x (B, dim) or (B, n, dim) and passes the
    rest (the indexer's layout): one kernel call, or the complex multiply where the kernel does not apply."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin
        self._complex = None

    def __call__(self, x: torch.Tensor, rope_dim: int | None = None) -> torch.Tensor:
        y = rope_rows(x, self.cos, self.sin, rope_dim)
        if y is not None:
            return y
        if self._complex is None:
            self._complex = torch.complex(self.cos, self.sin)
        rotation = self._complex if x.dim() == 2 else self._complex[:, None]
        if rope_dim is None or rope_dim == x.shape[-1]:
            return rotate(x, rotation)
        rope, rest = x.split([rope_dim, x.shape[-1] - rope_dim], dim=-1)
        return torch.cat([rotate(rope, rotation), rest], dim=-1)


def weights_fingerprint(model) -> tuple:
    """Changes whenever a parameter does: every in-place change (optimizer step, copy_,
    load_state_dict) bumps its version, and a move or cast gives it new storage."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up output (gate half first)."""
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


@dataclass
class _Layer:
    w_in: PackedLinear  # (q_lora + rank + rope [+ idx_dim + idx_heads], hidden), input_layernorm folded in
    w_q: PackedLinear  # (H * rank + H * rope [+ idx_heads * idx_dim], q_lora), q_a_layernorm folded in
    w_out: PackedLinear  # (hidden, H * rank)
    norms: dict  # name -> the norm module ("kv_a", "post"), for the norms that run on their own
    indexer: object | None  # the Indexer module (k_norm, scale), None without DSA or on a shared layer
    mlp_in: PackedLinear  # dense: gate and up (2I, hidden), post_attention_layernorm folded in; MoE: router
    #                       and shared gate/up (E + 2Is, hidden), on the normed input the experts read too
    mlp_down: PackedLinear | None  # dense: (hidden, I); MoE: the shared expert's (hidden, Is)
    moe: MoE | None
    packed_moe: PackedMoE | None = None  # MoE: routing, the routed experts and the shared expert, for the kernel


class DecodeWeights:
    """Fused decode weights of one model, built from its current parameters; ``stale()`` tells when
    they changed since, ``refresh()`` rebuilds. Supports attention without biases."""

    def __init__(self, model: GLMForCausalLM):
        if model.config.attention_bias:
            raise ValueError("DecodeWeights: attention biases are not folded; use the model's forward")
        self.model = model
        self.layers: list[_Layer] = []
        self.refresh()

    def stale(self) -> bool:
        """True when a parameter changed since the last refresh."""
        return weights_fingerprint(self.model) != self._built_from

    @torch.no_grad()
    def refresh(self) -> None:
        c = self.model.config
        H, nope, rope, rank, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        layers = []
        for block in self.model.model.layers:
            attn: MLAttention = block.self_attn
            idx = attn.indexer if self.model.runtime.sparse_attention else None
            ins = [attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight]
            if idx is not None:
                ins += [idx.wk.weight, idx.weights_proj.weight]
            qb = attn.q_b_proj.weight.view(H, nope + rope, -1)
            w_uk, w_uv = attn.kv_b_halves()
            # q_lat[h] = W_UK[h]^T q_nope[h] = (W_UK[h]^T W_QB_nope[h]) q_resid: the absorbed query's
            # map applied to each column of W_QB's no-rope half.
            q_lat = head_matmul(qb[:, :nope].permute(2, 0, 1), w_uk).permute(1, 2, 0).reshape(H * rank, -1)
            qs = [q_lat, qb[:, nope:].reshape(H * rope, -1)]
            if idx is not None:
                qs.append(idx.wq_b.weight)
            # o_proj(W_UV[h] o_lat[h] for all h) = sum_h (W_O[:, h] W_UV[h]) o_lat[h]
            w_out = head_matmul(attn.o_proj.weight.view(-1, H, v), w_uv).reshape(-1, H * rank)
            mlp, packed_moe = block.mlp, None
            if isinstance(mlp, MLP):
                mlp_in = PackedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), block.post_attention_layernorm)
                mlp_down, moe = PackedLinear(mlp.down_proj.weight), None
            else:
                shared, mlp_down = [], None
                if mlp.shared_experts is not None:
                    shared = [mlp.shared_experts.gate_proj.weight, mlp.shared_experts.up_proj.weight]
                    mlp_down = PackedLinear(mlp.shared_experts.down_proj.weight)
                mlp_in, moe = PackedLinear(torch.cat([mlp.gate.weight, *shared])), mlp
                routing = dict(top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
                               norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)
                packed_moe = PackedMoE(mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp_down, routing)
            norms = {"post": block.post_attention_layernorm, "kv_a": attn.kv_a_layernorm}
            layers.append(_Layer(PackedLinear(torch.cat(ins), block.input_layernorm),
                                 PackedLinear(torch.cat(qs), attn.q_a_layernorm), PackedLinear(w_out), norms,
                                 idx, mlp_in, mlp_down, moe, packed_moe))
        self.layers = layers
        self.lm_head = PackedLinear(self.model.lm_head.weight)
        self._built_from = weights_fingerprint(self.model)

    # ------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, hidden) of one new token per row. tokens: (B,) or (B, 1);
        positions: (B, 1) RoPE positions (default: the cache slot)."""
        model, c = self.model, self.model.config
        tokens = tokens.reshape(-1, 1)
        model._check_ids(tokens)
        positions = cache.slots(1, tokens.device) if positions is None else positions
        x = model.model.embed_tokens(tokens)[:, 0]  # (B, hidden)
        # RoPE's cos and sin (B or 1, rope/2), made once for every rotation of the step.
        cos, sin = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta,
                                torch.float64 if x.dtype == torch.float64 else torch.float32)
        rotation = _Rotation(cos[:, 0].contiguous(), sin[:, 0].contiguous())
        q_doc = cache.write_docs(None, 1)
        S = cache.length + 1
        visible = None
        if q_doc is not None:
            visible = cache.docs[:, :S] == q_doc  # left padding is document -1
        chosen = None  # the last full indexer's top-k, which IndexShare's shared layers reuse
        for i, layer in enumerate(self.layers):
            attn, chosen = self._attention(i, layer, x, rotation, cache, S, visible, chosen)
            x = x + attn
            x = x + (self._moe(layer, rms_norm(x, layer.norms["post"])) if layer.moe is not None else self._mlp(layer, x))
        cache.advance(1)
        return rms_norm(x, model.model.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head of the step's hidden states, fp32 (B, vocab)."""
        return self.lm_head(hidden).float()

    def _attention(self, i, layer: _Layer, x, rotation, cache: KVCache, S: int, visible, chosen):
        """The layer's attention output (B, hidden) for its input x (before input_layernorm, which w_in
        applies) and the top-k it attended (None: every key). rotation: the step's RoPE."""
        c = self.model.config
        B = x.shape[0]
        H, rope, rank, ql = c.num_attention_heads, c.qk_rope_head_dim, c.kv_lora_rank, c.q_lora_rank
        idx = layer.indexer
        sizes = [ql, rank, rope] + ([idx.head_dim, idx.n_heads] if idx is not None else [])
        parts = layer.w_in(x).split(sizes, dim=-1)
        latent = torch.cat([rms_norm(parts[1], layer.norms["kv_a"]), rotation(parts[2])], dim=-1)
        index_key = None
        if idx is not None:
            index_key = rotation(idx.k_norm(parts[3]), idx.rope_dim)
        latents, index_keys = cache.append(i, latent[:, None], None if index_key is None else index_key[:, None])
        qsizes = [H * rank, H * rope] + ([idx.n_heads * idx.head_dim] if idx is not None else [])
        qparts = layer.w_q(parts[0]).split(qsizes, dim=-1)
        q = torch.cat([qparts[0].view(B, H, rank), rotation(qparts[1].view(B, H, rope))], dim=-1)
        sparse = self.model.runtime.sparse_attention and S > c.index_topk
        if sparse and idx is not None:
            iq = rotation(qparts[2].view(B, idx.n_heads, idx.head_dim), idx.rope_dim)
            w = parts[4] * idx.n_heads**-0.5
            chosen = index_topk(cache.index_keys[i], S, iq, w, idx.scale, c.index_topk, visible)
            if chosen is None:  # no kernel: the same selection in torch ops
                logits = torch.relu(torch.bmm(index_keys, iq.transpose(1, 2)) * idx.scale)  # (B, S, n)
                scores = torch.bmm(logits, w[:, :, None]).squeeze(-1)  # (B, S)
                if visible is not None:
                    scores = scores.masked_fill(~visible, float("-inf"))
                chosen = deterministic_topk(scores, c.index_topk)  # (B, k)
        scale = c.qk_head_dim**-0.5
        o = latent_attention_step(q, cache.latent[i], S, scale, rank, chosen if sparse else None, visible)
        if o is None:
            keys, mask = latents, visible  # (B, S, D)
            if sparse:  # the selected latents, read from the whole cache buffer (no copy of the live prefix)
                keys = gather_rows(cache.latent[i], chosen)
                mask = None if visible is None else visible.gather(1, chosen)
            o = latent_attention(q, keys, scale, rank, None if mask is None else mask[:, None])  # (B, H, rank)
        return layer.w_out(o.reshape(B, H * rank)), (chosen if sparse else None)

    @staticmethod
    def _mlp(layer: _Layer, x):
        """The dense MLP of x before post_attention_layernorm (mlp_in applies it)."""
        return layer.mlp_down(_swiglu(layer.mlp_in(x)))

    def _moe(self, layer: _Layer, x):
        """The MoE block of x (after post_attention_layernorm)."""
        c = self.model.config
        E = c.n_routed_experts
        logits, shared_in = layer.mlp_in(x).split([E, layer.mlp_in.out_features - E], dim=-1)
        bias = layer.moe.gate.e_score_correction_bias
        moe = layer.packed_moe
        if moe.applies(x) and logits.dtype == torch.float32:
            return moe(x, logits, bias, shared_in if layer.mlp_down is not None else None)[0]
        weights, chosen = route(logits.float(), bias.float(), c.num_experts_per_tok, c.n_group, c.topk_group,
                                c.norm_topk_prob, c.routed_scaling_factor)
        # Rows grouped by expert; only the chosen experts' weights are read.
        order, token, counts = sort_by_expert(chosen, E)
        pieces = []
        for (gate_up, down), part in zip(zip(moe.gate_up, moe.down), x.index_select(0, token).split(counts.tolist())):
            if part.shape[0]:
                pieces.append(down(_swiglu(gate_up(part))))
        y = combine_experts(x, token, order, weights, torch.cat(pieces))
        if layer.mlp_down is not None:
            y = y + layer.mlp_down(_swiglu(shared_in))
        return y
