"""bench/gpu_check.sh skips cleanly without CUDA; its comparison and timing code runs here on the CPU
(megatron's router device pointed at the CPU, as in test_megatron_model) and reports what the GPU run
checks."""
import importlib.util
import subprocess
import sys

import pytest
import torch

from pretrain_support import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script runs the check")
def test_skips_cleanly_without_cuda():
    proc = subprocess.run(["bash", str(ROOT / "bench/gpu_check.sh")], capture_output=True, text=True,
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (f"gpu_check: skipped: no CUDA device (torch {torch.__version__}: "
                           f"torch.cuda.is_available() is False)\n")


def test_the_check_runs_on_the_cpu():
    pytest.importorskip("megatron.core")
    from megatron_support import megatron_on_cpu

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    cpu = torch.device("cpu")
    with megatron_on_cpu():
        result = gpu_check.parity(cpu)
        small = dict(gpu_check.MID, vocab_size=512, hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                     num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=64)
        timing = gpu_check.time_steps(cpu, steps=1, batch=1, seq=16, shape=small, bf16=False)
    assert result["transformer_engine"] is False
    assert result["logits_max_abs_diff"] < 2e-5 and 1e-6 < result["logits_max_abs_diff_glm5_eps"] < 1e-3
    assert result["step_muon_max_abs_diff"] < 1e-6
    assert timing["tokens"] == 16 and timing["megatron_step_s"] > 0 and timing["torch_step_s"] > 0
