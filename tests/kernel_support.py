"""A small DSA + MoE model and its loss and gradients, for tests that compare a kernel path with the torch path;
the check that a library switched off falls back with one message."""
from __future__ import annotations

import os
import subprocess
import sys

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


def assert_falls_back_with_one_message(code: str, switch: str, what: str) -> None:
    """``code`` run with the library's switch at 0 prints "None None" (both kernels declined) and logs one
    line naming ``what``, the switch and the torch ops that run instead."""
    out = subprocess.run([sys.executable, "-c", "import logging, torch; logging.basicConfig(level=logging.INFO);" + code],
                         env={**os.environ, switch: "0"}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None None"
    lines = [line for line in out.stderr.splitlines() if f"{what} unavailable" in line]
    assert len(lines) == 1 and f"{switch}=0" in lines[0] and "torch ops" in lines[0]
