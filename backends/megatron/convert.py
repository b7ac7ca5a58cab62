"""orthon's weights <-> megatron-core GPTModel state-dict names, for GLM-5's MLA + MoE.

Both directions are pure tensor code (no megatron import, no copy of the data beyond what a fused tensor
needs), and a round trip returns every tensor bit for bit. The megatron side is the full, unsharded
state dict of ``GPTModel`` built from the MLA layer specs (``orthon.backends.megatron.parallel`` cuts it
into TP / PP / EP shards). Per decoder layer ``decoder.layers.N.``:

    input_layernorm.weight                                  <- input_layernorm.weight
    self_attention.linear_q_down_proj.weight                <- self_attn.q_a_proj.weight
    self_attention.linear_q_up_proj.layer_norm_weight (TE)  <- self_attn.q_a_layernorm.weight
      or self_attention.q_layernorm.weight (local spec)
    self_attention.linear_q_up_proj.weight                  <- self_attn.q_b_proj.weight (per head: nope | rope)
    self_attention.linear_kv_down_proj.weight               <- self_attn.kv_a_proj_with_mqa.weight (kv_lora | rope)
    self_attention.linear_kv_up_proj.layer_norm_weight (TE) <- self_attn.kv_a_layernorm.weight
      or self_attention.kv_layernorm.weight (local spec)
    self_attention.linear_kv_up_proj.weight                 <- self_attn.kv_b_proj.weight (per head: k_nope | v)
    self_attention.linear_proj.weight                       <- self_attn.o_proj.weight
    self_attention.core_attention.indexer.*                 <- self_attn.indexer.* (megatron's DSA names)
    dense layers: mlp.linear_fc1.weight = [gate_proj; up_proj], mlp.linear_fc2.weight = down_proj, and the
      norm before them mlp.linear_fc1.layer_norm_weight (TE) or pre_mlp_layernorm.weight (local spec)
    MoE layers: pre_mlp_layernorm.weight, mlp.router.weight (<- mlp.gate.weight), mlp.router.expert_bias
      (<- e_score_correction_bias), mlp.shared_experts.linear_fc1 / linear_fc2, and expert e's
      linear_fc1 = [gate; up] and linear_fc2 = down as mlp.experts.linear_fc1.weight{e} (TEGroupedMLP)
      or mlp.experts.local_experts.{e}.linear_fc1.weight (SequentialMLP)

and embedding.word_embeddings.weight, decoder.final_layernorm.weight, output_layer.weight (none when the
embedding is tied). Megatron applies RoPE to MLA the same way orthon does (interleaved pairs, the rope
slice last in each head), so the attention tensors carry over unchanged. Its DSA indexer rotates the
*last* qk_rope_head_dim numbers of each indexer head where GLM-5's rotates the first ones: the indexer's
query and key rows (and the key LayerNorm, which any permutation commutes with) are reordered so both
compute the same index scores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from orthon.core.errors import CheckpointError, ConfigError
from orthon.pretrain.config import ModelConfig
from orthon.pretrain.model_info import meta_model


@dataclass(frozen=True)
class MegatronLayout:
    """Which of megatron-core's module sets the names are for.

    te: the transformer-engine spec (each norm fused into the linear after it, ``layer_norm_weight``; the
    MLA down-projections replicated across TP); False: the local spec (separate norm modules, the down
    projections column-parallel). grouped_experts: TEGroupedMLP (``experts.linear_fc1.weight{e}``);
    False: SequentialMLP (``experts.local_experts.{e}.linear_fc1.weight``)."""

    te: bool = True
    grouped_experts: bool = True
    # MLA's q / kv down-projections split by columns across TP (megatron's local spec); False: replicated
    # (transformer-engine's spec, and the model orthon builds); None: as ``te`` says.
    column_down_proj: bool | None = None

    @property
    def splits_down_proj(self) -> bool:
        return (not self.te) if self.column_down_proj is None else self.column_down_proj


@dataclass(frozen=True)
class _Map:
    """orthon tensors <-> megatron tensors. kind: "same" (one to one), "fuse" (orthon's two halves are
    megatron's one, concatenated along rows), "experts" (orthon's (E, ...) stack is megatron's E tensors),
    "rows" (the same tensor with its rows reordered by ``rows``)."""

    orthon: tuple[str, ...]
    megatron: tuple[str, ...]
    kind: str = "same"
    rows: tuple[int, ...] = ()


def expert_name(prefix: str, fc: str, expert: int, layout: MegatronLayout) -> str:
    """Megatron's name of expert ``expert``'s ``fc`` (linear_fc1 / linear_fc2) weight under ``prefix``
    (``decoder.layers.N.mlp.experts``); ``expert`` is the index on its expert-parallel rank."""
    if layout.grouped_experts:
        return f"{prefix}.{fc}.weight{expert}"
    return f"{prefix}.local_experts.{expert}.{fc}.weight"


def _indexer_rows(config: ModelConfig, heads: int) -> tuple[int, ...]:
    """Row order that moves each indexer head's first qk_rope_head_dim rows (GLM-5 rotates them) to its end
    (where megatron's DSA indexer rotates)."""
    d, r = config.index_head_dim, config.qk_rope_head_dim
    per_head = list(range(r, d)) + list(range(r))
    return tuple(h * d + i for h in range(heads) for i in per_head)


def layer_maps(config: ModelConfig, layer: int, layout: MegatronLayout) -> list[_Map]:
    """The tensors of decoder layer ``layer``, orthon's names (as GLMForCausalLM's state_dict) against
    megatron's."""
    o, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
    attn, mattn = o + "self_attn.", m + "self_attention."
    q_norm = mattn + ("linear_q_up_proj.layer_norm_weight" if layout.te else "q_layernorm.weight")
    kv_norm = mattn + ("linear_kv_up_proj.layer_norm_weight" if layout.te else "kv_layernorm.weight")
    maps = [
        _Map((o + "input_layernorm.weight",), (m + "input_layernorm.weight",)),
        _Map((attn + "q_a_proj.weight",), (mattn + "linear_q_down_proj.weight",)),
        _Map((attn + "q_a_layernorm.weight",), (q_norm,)),
        _Map((attn + "q_b_proj.weight",), (mattn + "linear_q_up_proj.weight",)),
        _Map((attn + "kv_a_proj_with_mqa.weight",), (mattn + "linear_kv_down_proj.weight",)),
        _Map((attn + "kv_a_layernorm.weight",), (kv_norm,)),
        _Map((attn + "kv_b_proj.weight",), (mattn + "linear_kv_up_proj.weight",)),
        _Map((attn + "o_proj.weight",), (mattn + "linear_proj.weight",)),
    ]
    if config.indexer_type(layer) == "full":
        idx, midx = attn + "indexer.", mattn + "core_attention.indexer."
        one_head, all_heads = _indexer_rows(config, 1), _indexer_rows(config, config.index_n_heads)
        maps += [
            _Map((idx + "wq_b.weight",), (midx + "linear_wq_b.weight",), "rows", all_heads),
            _Map((idx + "wk.weight",), (midx + "linear_wk.weight",), "rows", one_head),
            _Map((idx + "k_norm.weight",), (midx + "k_norm.weight",), "rows", one_head),
            _Map((idx + "k_norm.bias",), (midx + "k_norm.bias",), "rows", one_head),
            _Map((idx + "weights_proj.weight",), (midx + "linear_weights_proj.weight",)),
        ]
    mlp, mmlp = o + "mlp.", m + "mlp."
    if not config.is_moe_layer(layer):
        norm = mmlp + "linear_fc1.layer_norm_weight" if layout.te else m + "pre_mlp_layernorm.weight"
        return maps + [
            _Map((o + "post_attention_layernorm.weight",), (norm,)),
            _Map((mlp + "gate_proj.weight", mlp + "up_proj.weight"), (mmlp + "linear_fc1.weight",), "fuse"),
            _Map((mlp + "down_proj.weight",), (mmlp + "linear_fc2.weight",)),
        ]
    experts = range(config.n_routed_experts)
    maps += [
        _Map((o + "post_attention_layernorm.weight",), (m + "pre_mlp_layernorm.weight",)),
        _Map((mlp + "gate.weight",), (mmlp + "router.weight",)),
        _Map((mlp + "gate.e_score_correction_bias",), (mmlp + "router.expert_bias",)),
        _Map((mlp + "experts.gate_up_proj",),
             tuple(expert_name(mmlp + "experts", "linear_fc1", e, layout) for e in experts), "experts"),
        _Map((mlp + "experts.down_proj",),
             tuple(expert_name(mmlp + "experts", "linear_fc2", e, layout) for e in experts), "experts"),
    ]
    if config.n_shared_experts:
        shared, mshared = mlp + "shared_experts.", mmlp + "shared_experts."
        maps += [
            _Map((shared + "gate_proj.weight", shared + "up_proj.weight"), (mshared + "linear_fc1.weight",), "fuse"),
            _Map((shared + "down_proj.weight",), (mshared + "linear_fc2.weight",)),
        ]
    return maps


def model_parts(config: ModelConfig, layout: MegatronLayout) -> list[list[_Map]]:
    """Every tensor of the model in parts a weights directory is written in, one at a time: the embedding,
    each decoder layer, the final norm with the output layer."""
    check_convertible(config)
    parts = [[_Map(("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",))]]
    parts += [layer_maps(config, layer, layout) for layer in range(config.num_hidden_layers)]
    end = [_Map(("model.norm.weight",), ("decoder.final_layernorm.weight",))]
    if not config.tie_word_embeddings:  # tied: megatron's output layer reads the embedding
        end.append(_Map(("lm_head.weight",), ("output_layer.weight",)))
    return parts + [end]


def model_maps(config: ModelConfig, layout: MegatronLayout) -> list[_Map]:
    """Every tensor of the model: embedding, the decoder layers, the final norm, the output layer."""
    return [mp for part in model_parts(config, layout) for mp in part]


def check_convertible(config: ModelConfig) -> None:
    """What megatron-core's MLA cannot hold: biases on the attention projections (its MLA builds them
    without)."""
    if config.attention_bias:
        raise ConfigError("attention_bias: megatron-core's MLA has no biases on its projections; a model with "
                          "attention_bias=true cannot be converted")


def _take(state: dict, name: str, side: str) -> torch.Tensor:
    try:
        return state[name]
    except KeyError:
        raise CheckpointError(f"{side} state lacks {name}") from None


def orthon_to_megatron(state: dict[str, torch.Tensor], config: ModelConfig,
                       layout: MegatronLayout = MegatronLayout()) -> dict[str, torch.Tensor]:
    """orthon's state (GLMForCausalLM's names, routed experts stacked) -> megatron's full state dict.
    A missing tensor, or one left over, is a CheckpointError naming it."""
    out, used = {}, set()
    for mp in model_maps(config, layout):
        tensors = [_take(state, name, "orthon") for name in mp.orthon]
        used.update(mp.orthon)
        if mp.kind == "same":
            out[mp.megatron[0]] = tensors[0]
        elif mp.kind == "fuse":
            out[mp.megatron[0]] = torch.cat(tensors, dim=0)
        elif mp.kind == "rows":
            out[mp.megatron[0]] = tensors[0][list(mp.rows)]
        else:  # experts: one tensor of the stack each
            for name, tensor in zip(mp.megatron, tensors[0].unbind(0)):
                out[name] = tensor
    _check_all_used(state, used, "orthon")
    return out


def megatron_shapes(config: ModelConfig, runtime, layout: MegatronLayout = MegatronLayout()) -> dict[str, torch.Size]:
    """megatron's names and shapes of the whole model (orthon's model of ``config`` on the meta device, no
    memory, converted)."""
    return {k: v.shape for k, v in orthon_to_megatron(meta_model(config, runtime).state_dict(), config, layout).items()}


def megatron_to_orthon(state: dict[str, torch.Tensor], config: ModelConfig,
                       layout: MegatronLayout = MegatronLayout(), maps: list[_Map] | None = None) -> dict[str, torch.Tensor]:
    """megatron's full state dict -> orthon's state (GLMForCausalLM's names, experts stacked). Megatron's
    non-tensor entries (transformer-engine ``_extra_state``) are left out. ``maps``: one part of the model
    (``model_parts``), whose tensors ``state`` holds (default: all)."""
    out, used = {}, set()
    for mp in maps if maps is not None else model_maps(config, layout):
        tensors = [_take(state, name, "megatron") for name in mp.megatron]
        used.update(mp.megatron)
        if mp.kind == "same":
            out[mp.orthon[0]] = tensors[0]
        elif mp.kind == "fuse":
            first, second = tensors[0].chunk(2, dim=0)
            out[mp.orthon[0]], out[mp.orthon[1]] = first, second
        elif mp.kind == "rows":
            inverse = torch.empty(len(mp.rows), dtype=torch.long)
            inverse[list(mp.rows)] = torch.arange(len(mp.rows))
            out[mp.orthon[0]] = tensors[0][inverse]
        else:
            out[mp.orthon[0]] = torch.stack(tensors)
    _check_all_used({k: v for k, v in state.items() if not k.endswith("._extra_state")}, used, "megatron")
    return out


def _check_all_used(state: dict, used: set, side: str) -> None:
    extra = sorted(set(state) - used)
    if extra:
        raise CheckpointError(f"{side} state has {len(extra)} tensors the model does not: {extra[:8]}"
                              f"{' ...' if len(extra) > 8 else ''}")


def hf_to_megatron(tensors: dict[str, torch.Tensor], config: ModelConfig,
                   layout: MegatronLayout = MegatronLayout()) -> dict[str, torch.Tensor]:
    """The tensors of orthon's weights format (HF glm_moe_dsa names, routed experts one tensor each, as
    ``orthon.pretrain.hf_io`` reads and writes them; stacked experts pass too) -> megatron's full state."""
    from orthon.pretrain.hf_io import experts_from_hf

    return orthon_to_megatron(experts_from_hf(tensors), config, layout)


def megatron_to_hf(state: dict[str, torch.Tensor], config: ModelConfig,
                   layout: MegatronLayout = MegatronLayout()) -> dict[str, torch.Tensor]:
    """megatron's full state -> the HF-layout tensors orthon's weights format holds (experts one each)."""
    from orthon.pretrain.hf_io import experts_to_hf

    return experts_to_hf(megatron_to_orthon(state, config, layout))
