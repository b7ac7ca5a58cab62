"""The GLM-5 model: the one model code that pretraining, mid-training, the rollout engine, the RL
trainer, OPD teachers and the HF exporter all build from ``ModelConfig``.

Parameter names are those of transformers' ``GlmMoeDsaForCausalLM`` (``model.layers.N...``,
``lm_head.weight``), so a state_dict is an HF checkpoint as it stands.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from orthon.pretrain.attention import Indexer, MLAttention
from orthon.pretrain.cache import KVCache
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.layers import MLP, RMSNorm, rope_cos_sin
from orthon.pretrain.loss import IGNORE_INDEX, chunked_cross_entropy, cross_entropy, default_loss_chunk
from orthon.pretrain.moe import MoE, Experts, Router
from orthon.pretrain.parallel import fill_shard
from orthon.optim.param_spec import ParamSpec


class _NoInitOnMeta(TorchFunctionMode):
    """Skips the in-place initialisation of meta tensors: they hold no values, and drawing them runs
    torch's Python decompositions, whose first use imports torch._dynamo (a second of every start)."""

    INIT = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_,
            *(getattr(nn.init, name) for name in ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_",
                                                  "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                                                  "constant_", "ones_", "zeros_"))}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.INIT:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def on_meta_device():
    """Modules built inside hold their parameters on the meta device (shapes, no memory, no values)."""
    with torch.device("meta"), _NoInitOnMeta():
        yield


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    # Per full-indexer layer, the differentiable index scores (B, T, S), when asked for.
    index_scores: dict[int, torch.Tensor] | None = None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, runtime: RuntimeOptions):
        super().__init__()
        self.self_attn = MLAttention(config, layer, runtime)
        self.mlp = MoE(config) if config.is_moe_layer(layer) else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, q_slots, cache, prev_topk, want_index_scores, doc_ids=None, context=None):
        attn, topk, scores = self.self_attn(
            self.input_layernorm(x), cos, sin, q_slots, cache, prev_topk, want_index_scores, doc_ids, context
        )
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, topk, scores


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, runtime: RuntimeOptions):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, runtime) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GLMForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, init: bool = True, runtime: RuntimeOptions | None = None):
        super().__init__()
        self.config = config
        # How the model runs (sparse attention, kernels, activation checkpointing); shared by every layer.
        self.runtime = runtime or RuntimeOptions()
        self.model = Backbone(config, self.runtime)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if init and not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    # ------------------------------------------------------------ construction
    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) for every weight matrix and embedding, ones for norm scales,
        zeros for biases and the router bias (as transformers initialises glm_moe_dsa). Parameters
        sharded by FSDP2 (DTensors) get their part of what the unsharded model would draw."""
        generator = None
        if seed is not None:
            device = "cpu" if isinstance(self.lm_head.weight, DTensor) else self.lm_head.weight.device
            generator = torch.Generator(device=device).manual_seed(seed)
        std = self.config.initializer_range

        def normal(t):
            return t.normal_(0.0, std, generator=generator)

        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                fill_shard(module.weight, normal)
                if getattr(module, "bias", None) is not None:
                    fill_shard(module.bias, torch.Tensor.zero_)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                fill_shard(module.weight, lambda t: t.fill_(1.0))
                if getattr(module, "bias", None) is not None:
                    fill_shard(module.bias, torch.Tensor.zero_)
            elif isinstance(module, Experts):
                fill_shard(module.gate_up_proj, normal)
                fill_shard(module.down_proj, normal)
            elif isinstance(module, Router):
                fill_shard(module.weight, normal)
                module.e_score_correction_bias.zero_()
                module.expert_load.zero_()

    @torch.no_grad()
    def draw_as_built(self) -> None:
        """Draw from the global generator what building this model on a real device draws before
        ``reset_parameters`` (torch's own initialisation of each nn.Linear and nn.Embedding, in the
        order they are built), without keeping it: a model built on the meta device, then given memory,
        then this and ``reset_parameters`` holds the values the same seed gives a model built directly."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                torch.empty(module.weight.shape).uniform_()  # kaiming_uniform_: one uniform draw a weight
                if module.bias is not None:
                    torch.empty(module.bias.shape).uniform_()
            elif isinstance(module, nn.Embedding):
                torch.empty(module.weight.shape).normal_()

    def param_specs(self) -> dict[str, ParamSpec]:
        """What each parameter is, for the optimizer's routing (see ParamSpec). Muon Split is declared
        here: W_QB and W_KVB split into one row block per attention head."""
        kinds: dict[int, ParamSpec] = {}
        heads = self.config.num_attention_heads
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                kinds[id(module.weight)] = ParamSpec("embedding")
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                kinds[id(module.weight)] = ParamSpec("norm")
                if getattr(module, "bias", None) is not None:
                    kinds[id(module.bias)] = ParamSpec("bias")
            elif isinstance(module, Experts):
                kinds[id(module.gate_up_proj)] = ParamSpec("expert_stack")
                kinds[id(module.down_proj)] = ParamSpec("expert_stack")
            elif isinstance(module, Router):
                kinds[id(module.weight)] = ParamSpec("matrix")
            elif isinstance(module, nn.Linear):
                if module.bias is not None:
                    kinds[id(module.bias)] = ParamSpec("bias")
                kinds.setdefault(id(module.weight), ParamSpec("matrix"))
            if isinstance(module, MLAttention):
                kinds[id(module.q_b_proj.weight)] = ParamSpec("matrix", split_rows=heads)
                kinds[id(module.kv_b_proj.weight)] = ParamSpec("matrix", split_rows=heads)
        if not self.config.tie_word_embeddings:
            kinds[id(self.lm_head.weight)] = ParamSpec("output_head")
        return {name: kinds[id(p)] for name, p in self.named_parameters()}

    # ------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        want_index_scores: bool = False,
        return_logits: bool = True,
        doc_ids: torch.Tensor | None = None,
        loss_reduction: str = "mean",
        loss_chunk: int = 0,
        logits_at: torch.Tensor | None = None,
        context=None,
    ) -> CausalLMOutput:
        """input_ids: (B, T). labels: (B, T) next-token targets aligned with input_ids (already shifted;
        -100 = ignore); with labels the output carries the cross-entropy ("mean" over counted tokens,
        or "sum"). With a cache, the new tokens continue the cached ones. position_ids (RoPE positions)
        default to the cache slots. doc_ids (B, T): documents of a packed sequence, attention stays inside
        each (RoPE positions still count from the sequence start); with a cache, left padding is given
        as document -1 (and position_ids shifted), and the cache remembers the documents. loss_chunk > 0
        sets how many positions the loss computes at a time when return_logits=False (the logits are then
        never materialised whole: the same value and gradient in a fraction of the memory and time; 0
        picks a cache-sized chunk).
        logits_at (B, R) positions: logits only there, (B, R, V) (scoring responses without the prompt's
        logits; through forward, so a data-parallel wrapper sees the call).
        context: a ContextParallel group (orthon.pretrain.context_parallel): every rank of it passes the same
        whole sequences, and each computes its own positions' hidden states, logits and loss."""
        hidden, index_scores = self.hidden_states(input_ids, cache, position_ids, want_index_scores, doc_ids, context)
        if context is not None and labels is not None:
            labels = context.local(labels)
        if logits_at is not None:
            hidden = hidden.gather(1, logits_at[..., None].expand(*logits_at.shape, hidden.shape[-1]))
        if labels is None:
            return CausalLMOutput(logits=self.lm_head(hidden), index_scores=index_scores)
        if not return_logits:
            chunk = loss_chunk if loss_chunk > 0 else default_loss_chunk(self.config.vocab_size)
            loss = chunked_cross_entropy(hidden, self.lm_head.weight, labels, chunk)
            if loss_reduction == "mean":
                loss = loss / (labels != IGNORE_INDEX).sum().clamp(min=1)
            return CausalLMOutput(logits=None, loss=loss, index_scores=index_scores)
        logits = self.lm_head(hidden)
        loss = cross_entropy(logits, labels, loss_reduction)
        return CausalLMOutput(logits=logits if return_logits else None, loss=loss, index_scores=index_scores)

    def hidden_states(self, input_ids, cache=None, position_ids=None, want_index_scores=False, doc_ids=None,
                      context=None):
        """Final-norm hidden states (B, T, hidden) and the index scores when asked for; with a
        ContextParallel ``context``, of this rank's positions of the sequences (B, T_local, hidden)."""
        self._check_ids(input_ids)
        device = input_ids.device
        shard = None
        if context is not None:
            if cache is not None or position_ids is not None:
                raise ValueError("context parallelism: the sequences must be whole, from position 0 (no cache, "
                                 "no position_ids)")
            shard = context.shard(input_ids.shape[1], device, doc_ids)
            input_ids = shard.local(input_ids)
            doc_ids = None if doc_ids is None else shard.local(doc_ids)
        B, T = input_ids.shape
        if shard is not None:
            q_slots = shard.positions
        else:
            q_slots = cache.slots(T, device) if cache is not None else torch.arange(T, device=device)
        positions = q_slots if position_ids is None else position_ids
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.qk_rope_head_dim, self.config.rope_theta, x.dtype)
        topk, all_scores = None, {}
        if cache is not None:
            doc_ids = cache.write_docs(doc_ids, T)
        for i, layer in enumerate(self.model.layers):
            if self.runtime.activation_checkpointing and self.training and torch.is_grad_enabled() and cache is None:
                x, topk, scores = torch.utils.checkpoint.checkpoint(
                    layer, x, cos, sin, q_slots, None, topk, want_index_scores, doc_ids, shard, use_reentrant=False
                )
            else:
                x, topk, scores = layer(x, cos, sin, q_slots, cache, topk, want_index_scores, doc_ids, shard)
            if scores is not None:
                all_scores[i] = scores
        if cache is not None:
            cache.advance(T)
        return self.model.norm(x), (all_scores if want_index_scores else None)

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected shape (batch, seq), got {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids: expected an integer tensor, got {input_ids.dtype}")
        if input_ids.numel():
            low, high = int(input_ids.min()), int(input_ids.max())
            if low < 0 or high >= self.config.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"input_ids: token id {bad} is outside the vocabulary (0..{self.config.vocab_size - 1})")

    # ------------------------------------------------------------ helpers
    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        p = self.lm_head.weight
        return KVCache(self.config, batch_size, capacity, device=p.device, dtype=p.dtype)

    def track_max_logit(self, on: bool = True) -> None:
        for module in self.modules():
            if isinstance(module, MLAttention):
                module.track_max_logit = on
                module.max_logit = None

    def max_attention_logit(self) -> float | None:
        """Largest attention logit of the last full forward over all layers (needs track_max_logit)."""
        value = self.attention_logit_max()
        return None if value is None else float(value)

    def attention_logit_max(self) -> torch.Tensor | None:
        """max_attention_logit as a tensor where the forward ran: reading it does not wait for the device."""
        values = [m.max_logit for m in self.modules() if isinstance(m, MLAttention) and m.max_logit is not None]
        return torch.stack(values).max() if values else None

    def moe_routers(self) -> list[Router]:
        return [m for m in self.modules() if isinstance(m, Router)]

    def indexers(self) -> list[Indexer]:
        return [m for m in self.modules() if isinstance(m, Indexer)]

    def set_indexers_trainable(self, trainable: bool) -> None:
        """The LM and policy losses never reach the indexers (top-k selection is discrete); only
        mid-training's KL objective trains them. Frozen, they get no gradient and no optimizer state,
        and DDP waits for none."""
        for indexer in self.indexers():
            indexer.requires_grad_(trainable)
