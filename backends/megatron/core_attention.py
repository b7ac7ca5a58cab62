"""MLA's core attention for megatron-core's local (no transformer-engine) layer spec.

megatron-core's own local ``DotProductAttention`` takes no ``k_channels`` / ``v_channels``, so its MLA
builds only with transformer-engine's attention (MLA's query-key heads are wider than its value heads).
This module has the interface MLASelfAttention builds its core attention with and runs torch's fused
scaled-dot-product attention (causal) on [seq, batch, heads, dim] tensors. With ``track_max_logit`` it also
keeps its largest attention logit (orthon's ``train.track_max_logit``: what Muon Split bounds), computed
as orthon's attention computes it."""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from orthon.pretrain.attention import max_attention_logit


class SDPACoreAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("SDPACoreAttention: context parallelism needs transformer-engine's attention")
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.track_max_logit, self.max_logit = False, None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query / key: [sq, b, heads, qk_dim]; value: [sk, b, heads, v_dim] -> [sq, b, heads * v_dim]."""
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences need transformer-engine's attention")
        if self.track_max_logit:  # [b, s, heads, dim], as orthon's attention holds them
            scale = self.softmax_scale or query.shape[-1] ** -0.5
            self.max_logit = max_attention_logit(query.transpose(0, 1), key.transpose(0, 1), None, scale)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             dropout_p=self.dropout if self.training else 0.0)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
