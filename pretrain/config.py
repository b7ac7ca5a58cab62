"""ModelConfig: the one config class every layer of the GLM-5 model reads, and RuntimeOptions.

ModelConfig is the architecture only: its field names are the config.json keys of transformers'
``glm_moe_dsa``, so HF import/export is a rename-free copy, and nothing changes it during a run.
Defaults are the published GLM-5 numbers. How the model runs (sparse attention on or off, the sparse
kernel, chunk sizes, activation checkpointing) is RuntimeOptions: the recipe's ``runtime`` section,
changed by mid-training's phases, saved beside the weights in orthon's sidecar.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal

from orthon.core.errors import ConfigError

INDEXER_TYPES = ("full", "shared")
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class ModelConfig:
    vocab_size: int = 154880
    hidden_size: int = 6144
    num_hidden_layers: int = 78
    intermediate_size: int = 12288
    # MLA
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    rope_theta: float = 10000.0
    attention_bias: bool = False
    # MoE
    first_k_dense_replace: int = 3
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    # DSA lightning indexer
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    indexer_types: list[str] | None = None  # per layer "full" | "shared"; None: all full
    # misc
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    # Not the architecture: what the model's tokenizer calls them (a pretraining run sets them from
    # data.tokenizer); train.init_from does not compare them.
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    pad_token_id: int | None = None

    def __post_init__(self):
        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "moe_intermediate_size", "n_group", "topk_group", "index_n_heads", "index_head_dim", "index_topk",
            "max_position_embeddings",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta: must be positive, got {self.rope_theta}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim: must be even for RoPE pairs, got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace: {self.first_k_dense_replace} is outside 0..num_hidden_layers "
                f"({self.num_hidden_layers})"
            )
        if self.has_moe:
            if self.n_routed_experts <= 0:
                raise ConfigError(f"n_routed_experts: must be positive with MoE layers, got {self.n_routed_experts}")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ConfigError(
                    f"num_experts_per_tok: {self.num_experts_per_tok} must be in 1..n_routed_experts "
                    f"({self.n_routed_experts})"
                )
            if self.n_routed_experts % self.n_group:
                raise ConfigError(f"n_group: {self.n_group} does not divide n_routed_experts ({self.n_routed_experts})")
            if self.topk_group > self.n_group:
                raise ConfigError(f"topk_group: {self.topk_group} exceeds n_group ({self.n_group})")
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                raise ConfigError("n_group: each expert group needs at least 2 experts (group score = top-2 sum)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(
                f"index_head_dim: {self.index_head_dim} is smaller than qk_rope_head_dim ({self.qk_rope_head_dim}); "
                "the indexer applies RoPE to its first qk_rope_head_dim dims"
            )
        if self.indexer_types is not None:
            if len(self.indexer_types) != self.num_hidden_layers:
                raise ConfigError(
                    f"indexer_types: has {len(self.indexer_types)} entries for {self.num_hidden_layers} layers"
                )
            for i, kind in enumerate(self.indexer_types):
                if kind not in INDEXER_TYPES:
                    raise ConfigError(f"indexer_types[{i}]: {kind!r} is not one of {list(INDEXER_TYPES)}")
            if self.indexer_types and self.indexer_types[0] != "full":
                raise ConfigError("indexer_types[0]: the first layer must be 'full' (a shared layer reuses an earlier one)")
        for name in TOKEN_ID_FIELDS:
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}: {value} is outside the vocabulary (0..{self.vocab_size - 1})")

    # ---- derived ----
    @property
    def has_moe(self) -> bool:
        return self.first_k_dense_replace < self.num_hidden_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def indexer_type(self, layer: int) -> str:
        return "full" if self.indexer_types is None else self.indexer_types[layer]

    # ---- Hugging Face config.json ----
    def to_hf_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        theta = data.pop("rope_theta")
        n = self.num_hidden_layers
        data.update(
            model_type="glm_moe_dsa",
            architectures=["GlmMoeDsaForCausalLM"],
            num_key_value_heads=self.num_attention_heads,
            head_dim=self.qk_rope_head_dim,
            hidden_act="silu",
            rope_parameters={"rope_theta": theta, "rope_type": "default"},
            mlp_layer_types=["dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)],
            indexer_types=[self.indexer_type(i) for i in range(n)],
            attention_dropout=0.0,
            mlp_bias=False,
            dtype="float32",
        )
        return data

    @classmethod
    def from_hf_dict(cls, data: dict) -> "ModelConfig":
        """Read a glm_moe_dsa config.json; settings orthon does not implement are rejected by name."""
        if data.get("model_type") != "glm_moe_dsa":
            raise ConfigError(f"model_type: expected 'glm_moe_dsa', got {data.get('model_type')!r}")
        rope = data.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.rope_type: only 'default' RoPE is supported, got {rope.get('rope_type')!r}")
        if data.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: only 'silu' is supported, got {data['hidden_act']!r}")
        heads = data.get("num_attention_heads")
        if data.get("num_key_value_heads", heads) != heads:
            raise ConfigError("num_key_value_heads: MLA uses one KV latent for all heads; must equal num_attention_heads")
        if data.get("mlp_bias"):
            raise ConfigError("mlp_bias: MLP biases are not supported")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if "rope_theta" in rope:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        elif "rope_theta" in data:
            kwargs["rope_theta"] = float(data["rope_theta"])
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        config = cls(**kwargs)
        layer_types = data.get("mlp_layer_types")
        if layer_types is not None:
            expected = ["dense" if i < config.first_k_dense_replace else "sparse" for i in range(config.num_hidden_layers)]
            if list(layer_types) != expected:
                raise ConfigError("mlp_layer_types: only the first_k_dense_replace pattern (dense then sparse) is supported")
        return config

    def replace(self, **changes) -> "ModelConfig":
        return type(self)(**{**asdict(self), **changes})


@dataclass
class RuntimeOptions:
    """How the model runs, not what it is. One instance is shared by every layer of a model
    (``model.runtime``), so a change (mid-training's DSA phase) reaches them all."""

    # False: plain causal MLA, the indexer is not consulted (pretraining before DSA adaptation).
    sparse_attention: bool = True
    # How top-k sparse attention runs in a full forward: "mask" (dense SDPA with a top-k mask; fastest
    # for short T on GPU), "gather" (absorbed MQA form over the gathered top-k latents; memory linear in
    # T), "auto" (gather once T >= gather_min_len, and on CPU wherever orthon.pretrain.sparse_kernels
    # is built: its kernels read k latents a query where the mask path scores all T).
    sparse_impl: Literal["auto", "mask", "gather"] = "auto"
    gather_min_len: int = 2048
    # Queries per chunk for the indexer and gathered attention: memory stays chunk x keys.
    query_chunk: int = 1024
    # Recompute each decoder layer in backward instead of storing its activations (long sequences).
    activation_checkpointing: bool = False

    def __post_init__(self):
        for name in ("gather_min_len", "query_chunk"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
