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


def report(name: str, figures: dict, ratios: dict) -> None:
    print(json.dumps({"bench": name, "figures": figures, "ratios": ratios}))
