"""Shared bits of the benchmarks: timing and the closing JSON line."""
from __future__ import annotations

import json
import statistics
import time


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_kind() -> str:
    """Which kind of CPU a figure comes from: speed claims must hold on both."""
    from orthon.optim.newton_schulz import bf16_gemm_is_native

    return "native bf16 GEMM (AMX / AVX512-BF16)" if bf16_gemm_is_native("cpu") else "emulated bf16 GEMM"


def report(name: str, figures: dict, ratios: dict) -> None:
    print(json.dumps({"bench": name, "figures": figures, "ratios": ratios}))


def tiny_pair(overrides=()):
    """orthon's tiny model (configs/tiny.yaml with DSA on) and transformers' GlmMoeDsaForCausalLM holding
    the same weights (written by orthon's HF exporter, read by transformers)."""
    import tempfile
    from pathlib import Path

    import torch
    from transformers import GlmMoeDsaForCausalLM

    from orthon.pretrain.weights import save_weights
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.config import RuntimeOptions
    from orthon.pretrain.model import GLMForCausalLM

    root = Path(__file__).resolve().parents[1]
    config = load_recipe(root / "configs/tiny.yaml", list(overrides)).model
    torch.manual_seed(0)
    ours = GLMForCausalLM(config, runtime=RuntimeOptions(sparse_attention=True))
    with tempfile.TemporaryDirectory() as d:
        save_weights(ours, d)
        theirs = GlmMoeDsaForCausalLM.from_pretrained(d, dtype=torch.float32)
    return ours, theirs
