"""Small random glm_moe_dsa configurations and the transformers reference model for them."""
from __future__ import annotations

import dataclasses

import torch

from orthon.pretrain.config import ModelConfig, RuntimeOptions

SMALL = dict(
    vocab_size=257, hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
    q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, index_n_heads=4, index_head_dim=16, index_topk=512,
    max_position_embeddings=4096, initializer_range=0.1,
)

CASES = {
    "dense": dict(first_k_dense_replace=3),
    "moe": dict(),
    "moe_groups": dict(n_group=4, topk_group=2),
    "dsa": dict(index_topk=8, index_n_heads=16),
    "indexshare": dict(index_topk=8, index_n_heads=16, num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"]),
}


RUNTIME_KEYS = {f.name for f in dataclasses.fields(RuntimeOptions)}


def small_config(case: str = "moe", **overrides) -> ModelConfig:
    return ModelConfig(**{**SMALL, **CASES[case], **overrides})


def small_model(case: str = "moe", **overrides):
    """The model of ``small_config``; keys of RuntimeOptions (sparse_impl, query_chunk, ...) go to its runtime."""
    from orthon.pretrain.model import GLMForCausalLM

    runtime = {k: overrides.pop(k) for k in list(overrides) if k in RUNTIME_KEYS}
    return GLMForCausalLM(small_config(case, **overrides), runtime=RuntimeOptions(**runtime))


def hf_model_from_dir(directory):
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(str(directory), attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def randomize_router_bias(model, seed=0):
    """Non-zero e_score_correction_bias so tests see it take part in selection."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in model.moe_routers():
            router.e_score_correction_bias.copy_(torch.randn(router.e_score_correction_bias.shape, generator=g) * 0.05)
