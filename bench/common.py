"""Shared bits of the benchmarks: timing, the machine line and the closing JSON line.

Importing it keeps freed memory in the C allocator for reuse (orthon.core.allocator), as the orthon
command does, so both sides of every comparison run under the allocator settings orthon's runs use
(ORTHON_RETAIN_FREED_MEMORY=0 measures glibc's defaults instead)."""
from __future__ import annotations

import json
import statistics
import time

from orthon.core.allocator import retain_freed_memory

RETAINED = retain_freed_memory()


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_times(fns: dict, rounds: int, warmup: int = 2) -> dict:
    """Each function's wall times over ``rounds`` rounds of one call each, the order alternating between
    rounds: the calls of a round run seconds apart, so a shared machine's drift (10-30% from minute to
    minute on these VMs) hits every side of the round alike. Returns {name: [seconds per round]}."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(slow: list, fast: list) -> float:
    """The median over rounds of slow / fast time: the speed-up, each round compared with itself."""
    return statistics.median(s / f for s, f in zip(slow, fast))


def cpu_kind() -> str:
    """The CPU model, its core count and whether bf16 GEMM is native or emulated on it: figures from
    different machines are not comparable. On a native-bf16 CPU, ``ONEDNN_MAX_CPU_ISA=AVX2`` takes
    oneDNN's bf16 kernels away (bf16 matmul at ~1 GFLOP/s, fp32 unchanged) and measures the emulated
    kind; the line then says "emulated"."""
    import os

    from orthon.optim.newton_schulz import bf16_gemm_is_native

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    bf16 = "native" if bf16_gemm_is_native("cpu") else "emulated on fp32"
    allocator = "freed memory retained" if RETAINED else "the C library's defaults"
    return f"{model} ({os.cpu_count()} cores), bf16 GEMM {bf16}; allocator: {allocator}"


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
