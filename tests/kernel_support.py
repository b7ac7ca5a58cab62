"""A small DSA + MoE model and its loss and gradients, for tests that compare a kernel path with the torch path."""
from __future__ import annotations

import torch

from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.model import GLMForCausalLM


def tiny_dsa_model(seed=0):
    """3 layers (dense, then MoE), DSA with index_topk 16, IndexShare on the last layer."""
    config = ModelConfig(vocab_size=64, hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
                         q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                         index_n_heads=2, index_head_dim=16, index_topk=16, indexer_types=["full", "full", "shared"])
    torch.manual_seed(seed)
    return GLMForCausalLM(config, runtime=RuntimeOptions(sparse_attention=True))


def loss_and_grads(model, ids, docs=None):
    """The mean next-token loss of ids (B, T + 1) and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, :-1], labels=ids[:, 1:], doc_ids=docs, return_logits=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
