"""GLM-5 (glm_moe_dsa) as a MindSpore cell, built from the same ModelConfig as the torch model.

Parameter names are the torch model's (the HF names), so a weights directory maps onto either
backend name for name, and the optimizer routing comes from the torch model's ``param_specs`` for
the same config (built on the meta device: shapes only, no memory). Calling the cell on int32 token
ids (B, T) returns float32 logits (B, T, V).
"""
from __future__ import annotations

import functools

import numpy as np

from orthon.backends.mindspore.attention import Indexer, MLAttention
from orthon.backends.mindspore.layers import MLP, Embedding, Linear, RMSNorm, linear, rope_cos_sin
from orthon.backends.mindspore.moe import Experts, MoE
from orthon.backends.mindspore.runtime import ms
from orthon.optim.param_spec import ParamSpec
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.loss import IGNORE_INDEX
from orthon.pretrain.model_info import meta_model

ops, nn = ms.ops, ms.nn


class DecoderLayer(nn.Cell):
    def __init__(self, config: ModelConfig, layer: int, runtime: RuntimeOptions):
        super().__init__()
        self.self_attn = MLAttention(config, layer, runtime)
        self.is_moe = config.is_moe_layer(layer)
        self.mlp = MoE(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def construct(self, x, cos, sin, prev_topk=None, doc_ids=None):
        attn, topk = self.self_attn(self.input_layernorm(x), cos, sin, prev_topk, doc_ids)
        x = x + attn
        load = None
        if self.is_moe:
            out, load = self.mlp(self.post_attention_layernorm(x))
        else:
            out = self.mlp(self.post_attention_layernorm(x))
        return x + out, topk, load


class Backbone(nn.Cell):
    def __init__(self, config: ModelConfig, runtime: RuntimeOptions):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.CellList([DecoderLayer(config, i, runtime) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GLMForCausalLM(nn.Cell):
    def __init__(self, config: ModelConfig, runtime: RuntimeOptions | None = None):
        super().__init__()
        self.config = config
        self.runtime = runtime or RuntimeOptions()
        self.model = Backbone(config, self.runtime)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)

    # ------------------------------------------------------------ what the parameters are
    def param_specs(self) -> dict[str, ParamSpec]:
        """The torch model's ParamSpecs for this config (Muon Split on W_QB / W_KVB per head, AdamW for
        embedding, head, norms), keyed by this cell's parameter names, which are the same. Covers every
        parameter, frozen ones too (the routers' selection bias is a buffer, not a parameter)."""
        specs = meta_model(self.config).param_specs()
        # The routers' selection bias: a parameter here, a persistent buffer (saved, never trained) in torch.
        names = [p.name for p in self.get_parameters() if p.name.rsplit(".", 1)[-1] != "e_score_correction_bias"]
        if set(names) != set(specs):
            raise RuntimeError(f"mindspore backend: parameter names differ from the torch model's: "
                               f"{sorted(set(names) ^ set(specs))[:6]}")
        return {name: specs[name] for name in names}

    def indexers(self) -> list:
        return [cell for _, cell in self.cells_and_names() if isinstance(cell, Indexer)]

    def moe_routers(self) -> list:
        return [layer.mlp.gate for layer in self.model.layers if layer.is_moe]

    def set_indexers_trainable(self, trainable: bool) -> None:
        """As the torch model's: the LM loss never reaches the indexers (top-k selection is discrete)."""
        for indexer in self.indexers():
            for p in indexer.get_parameters():
                p.requires_grad = trainable

    def set_grouped_experts(self, grouped: bool) -> None:
        """Grouped experts (dynamic shapes, PyNative) or dense ones (static shapes, graph mode)."""
        for _, cell in self.cells_and_names():
            if isinstance(cell, Experts):
                cell.grouped = grouped

    # ------------------------------------------------------------ forward
    def rope(self, seq_len: int):
        """(cos, sin) of positions 0..seq_len-1: host constants, computed once per length."""
        return _rope_table(seq_len, self.config.qk_rope_head_dim, self.config.rope_theta)

    def hidden_states(self, input_ids, cos, sin, doc_ids=None):
        """Final-norm hidden states (B, T, hidden) and the MoE layers' expert loads (n_moe, E)."""
        x = self.model.embed_tokens(input_ids)
        topk, loads = None, []
        for layer in self.model.layers:
            x, topk, load = layer(x, cos, sin, topk, doc_ids)
            if load is not None:
                loads.append(load)
        return self.model.norm(x), (ops.stack(loads) if loads else None)

    def head(self, hidden):
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight)

    def __call__(self, input_ids, doc_ids=None):
        """int32 token ids (B, T) -> float32 logits (B, T, V); doc_ids (B, T) keep attention inside
        each document of a packed sequence. The ids are checked and the RoPE table made here, on the
        host; ``construct`` is what graph mode compiles."""
        input_ids = self.check_ids(input_ids)
        self.set_grouped_experts(ms.get_context("mode") == ms.PYNATIVE_MODE)
        cos, sin = self.rope(input_ids.shape[1])
        return super().__call__(input_ids, cos, sin, doc_ids)

    def construct(self, input_ids, cos, sin, doc_ids=None):
        return self.head(self.hidden_states(input_ids, cos, sin, doc_ids)[0])

    def loss_and_loads(self, input_ids, labels, cos, sin, doc_ids=None):
        """(summed next-token cross-entropy over labels != -100, expert loads): what a training step
        differentiates. labels are already shifted (aligned with input_ids)."""
        hidden, loads = self.hidden_states(input_ids, cos, sin, doc_ids)
        logits = self.head(hidden)
        loss = ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, loads

    def check_ids(self, input_ids):
        """input_ids as an int32 Tensor, after the torch model's checks (shape, integer, in vocabulary)."""
        ids = input_ids.asnumpy() if isinstance(input_ids, ms.Tensor) else np.asarray(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids: expected shape (batch, seq), got {tuple(ids.shape)}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids: expected an integer tensor, got {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(f"input_ids: token id {bad} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        return ms.Tensor(ids.astype(np.int32))


@functools.lru_cache(maxsize=16)
def _rope_table(seq_len: int, dim: int, theta: float):
    return rope_cos_sin(np.arange(seq_len), dim, theta)

