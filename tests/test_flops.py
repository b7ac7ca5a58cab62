"""Model FLOPs (orthon.pretrain.flops), the devices' peaks and the step metrics built on them (and the step's
wait for its data)."""
import subprocess
import sys
import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from orthon.core.device_stats import bf16_peak_flops, peak_flops
from orthon.pretrain.recipe import load_recipe
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.flops import ModelFlops
from orthon.pretrain.model import GLMForCausalLM
from orthon.pretrain.trainer import Trainer
from pretrain_support import MODEL, make_stores, write_recipe

# configs/tiny.yaml's model
TINY = ModelConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
                   q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                   first_k_dense_replace=1, moe_intermediate_size=256, n_routed_experts=8, n_shared_experts=1,
                   num_experts_per_tok=2, index_n_heads=4, index_head_dim=32, index_topk=64)


@pytest.mark.parametrize("T", [24, 40])
def test_dense_training_flops_are_what_torch_counts(T):
    """Forward and backward of the dense model under torch's FlopCounterMode (attention through SDPA's math
    path, whose products torch counts over every key, as the formula charges): the same number. Values
    wider than the query-key heads, so that the two attention dimensions cannot stand in for each other."""
    config = ModelConfig(**{**MODEL, "v_head_dim": 40})
    model = GLMForCausalLM(config, runtime=RuntimeOptions(sparse_attention=False))
    ids = torch.randint(0, config.vocab_size, (3, T + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(ids[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert counter.get_total_flops() == ModelFlops.of(config).sequences([T] * 3)


def test_the_tiny_model_by_hand():
    # Active matrix parameters a token: attention (q_a 256x128, q_b 128x4x48, kv_a 256x80, kv_b 64x4x64,
    # o 128x256) x 4 layers; the dense layer's MLP 3x256x768; 3 routers 256x8; 3 layers of 2 routed experts
    # and 1 shared, 3x256x256 each; the head 256x4096.
    matmul = 4 * 126_976 + 589_824 + 3 * 2048 + 3 * 2 * 196_608 + 3 * 196_608 + 1_048_576
    assert matmul == 3_921_920
    flops = ModelFlops.of(TINY)
    assert flops.matmul_parameters == matmul
    per_key = 2 * 4 * (48 + 32)  # a layer's scores (qk 48) and values (v 32), 4 heads
    dense = 3 * (2 * matmul + 4 * per_key * 1024)
    assert flops.per_token(1024) == dense == 31_395_840
    # DSA: 64 keys a query, and the indexer's forward: wq_b 128x4x32, wk 256x32, weights_proj 256x4, and its
    # scores, 2x4x32 a key over all 1024.
    indexer = 4 * (2 * (16_384 + 8192 + 1024) + 256 * 1024)
    assert flops.per_token(1024, sparse=True) == 3 * (2 * matmul + 4 * per_key * 64) + indexer == 25_276_416
    assert flops.per_token(1024, sparse=True, indexer_trains=True) == 25_276_416 + 2 * indexer
    # No longer than index_topk: every causal key is attended, nothing selected.
    assert flops.per_token(64, sparse=True) == flops.per_token(64) == 3 * (2 * matmul + 4 * per_key * 64)
    assert flops.sequences([64, 1024], sparse=True) == 64 * flops.per_token(64) + 1024 * 25_276_416


def test_glm5_is_40b_active():
    """GLM-5's published size: 744B parameters, about 40B active a token."""
    flops = ModelFlops.of(ModelConfig())
    assert 39.5e9 < flops.matmul_parameters < 40.5e9
    assert flops.per_token(4096) == 6 * flops.matmul_parameters + 3 * 78 * 2 * 64 * (256 + 256) * 4096


def test_peaks_of_known_devices():
    assert bf16_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert bf16_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert bf16_peak_flops("NVIDIA H100 NVL") == 835e12
    assert bf16_peak_flops("NVIDIA H200") == 989e12
    assert bf16_peak_flops("NVIDIA H20") == 148e12  # not H200's
    assert bf16_peak_flops("NVIDIA GB200") == 2.5e15 and bf16_peak_flops("NVIDIA B200") == 2.25e15
    assert bf16_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert bf16_peak_flops("NVIDIA GeForce RTX 4090") is None
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), override_tflops=1.5) == 1.5e12


def test_a_steps_metrics_hold_its_model_flops(tmp_path):
    stores = make_stores(tmp_path / "data")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stores, tmp_path / "run", train={"peak_tflops": 0.5}), [])
    trainer = Trainer(recipe, tmp_path / "run", log=lambda *_: None)
    metrics = trainer.train_step()
    sequences = metrics["batch_tokens"] // recipe.data.seq_len
    flops = ModelFlops.of(recipe.model).sequences([recipe.data.seq_len] * sequences)
    assert metrics["tflops_per_device"] * 1e12 * metrics["step_time_s"] == pytest.approx(flops, rel=1e-9)
    assert metrics["mfu_pct"] == pytest.approx(100 * metrics["tflops_per_device"] / 0.5, rel=1e-12)
    assert metrics["memory_peak_gib"] > 0.1  # torch alone holds more
    # The wait for the batch: a data pipeline slowed by 0.3 s shows it, inside the step's time.
    next_batch = trainer.data.next_batch
    trainer.data.next_batch = lambda n: (time.sleep(0.3), next_batch(n))[1]
    slow = trainer.train_step()
    assert slow["step_time_s"] > slow["data_time_s"] >= 0.3
    assert metrics["data_time_s"] < 0.3
    # Mid-training's indexer stage: sparse attention on, the indexers trained (longer than index_topk).
    trainer.model.runtime.sparse_attention = True
    trainer.model.set_indexers_trainable(True)
    n = recipe.model.index_topk * 2
    assert trainer._model_flops([n]) == ModelFlops.of(recipe.model).sequences([n], sparse=True, indexer_trains=True)


def test_cpu_memory_is_the_peak_resident_set():
    """A 768 MiB tensor made and freed: the peak after it is the resident set before it plus the tensor
    (the peak before may lie higher, from memory freed earlier)."""
    code = ("import os, torch; from orthon.core.device_stats import step_memory; cpu = torch.device('cpu');"
            "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**30;"
            "now, before = rss(), step_memory(cpu)['memory_peak_gib']; x = torch.ones(3 * 2**26); del x;"
            "print(now, before, step_memory(cpu)['memory_peak_gib'])")
    now, before, after = map(float, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert before >= now
    assert max(before, now + 0.75) <= after < max(before, now + 0.75) + 0.02
