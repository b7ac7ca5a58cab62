"""DP scheduling balance on a heavy-tailed length distribution.

Packs 1024 samples (32 prompts x G = 32) with lognormal lengths (median 1500
tokens, sigma 1.1, clipped to [16, 32768]) into 32768-token micro-batches and
spreads them over DP ranks with each strategy. The reference is first-fit +
strided round-robin; the figure is max / mean of the ranks' FLOPs (the step
waits for the slowest rank, so this is the step time over the ideal), averaged
over seeds. Also: how often Karmarkar-Karp finds the brute-force optimum on
small instances, and whether it is ever worse than round-robin.

first_fit / flops fill micro-batches by the sum of lengths (packed sequences);
``padded`` (orthon's RL and SFT default: its step right-pads a micro-batch) by
samples x the longest, and its loads are those padded FLOPs, so its rows are
balanced against its own round-robin; the padding it leaves is printed too.

    python bench/dp_schedule.py [--seeds 5] [--samples 1024]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from orthon.rl.dp_schedule import (
    distribute_karmarkar_karp,
    distribute_round_robin,
    optimal_partition_bruteforce,
    padded_cost,
    rank_loads,
    schedule,
)

STRATEGIES = [
    ("first_fit", "round_robin"),  # the reference
    ("first_fit", "karmarkar_karp"),
    ("flops", "round_robin"),
    ("flops", "karmarkar_karp"),
    ("padded", "round_robin"),
    ("padded", "karmarkar_karp"),
]
CAPACITY = 32768


def lengths_for(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(1500), 1.1, size=n), 16, CAPACITY).astype(int)


def small_instances(trials: int, equal_count: bool, seed: int = 7) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    optimal = optimal_plain = worse_than_rr = 0
    for _ in range(trials):
        k = int(rng.integers(2, 5))
        n = k * int(rng.integers(2, 12 // k + 1)) if equal_count else int(rng.integers(k + 1, 11))
        w = rng.lognormal(0, 1, size=n)
        kk = rank_loads(distribute_karmarkar_karp(w, k, equal_count=equal_count), w).max()
        plain = rank_loads(distribute_karmarkar_karp(w, k, equal_count=equal_count, refine=False), w).max()
        rr = rank_loads(distribute_round_robin(n, k), w).max()
        _, best = optimal_partition_bruteforce(w, k, equal_count=equal_count)
        optimal += bool(np.isclose(kk, best))
        optimal_plain += bool(np.isclose(plain, best))
        worse_than_rr += bool(kk > rr * (1 + 1e-12))
    return {"optimal_share": optimal / trials, "optimal_share_plain": optimal_plain / trials,
            "worse_than_rr": worse_than_rr}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--trials", type=int, default=300, help="small instances for the brute-force check")
    args = parser.parse_args()

    figures: dict[str, float] = {}
    ratios: dict[str, float] = {}
    print(f"{args.samples} samples, lognormal lengths (median 1500, sigma 1.1), capacity {CAPACITY}, "
          f"{args.seeds} seeds; max/mean rank FLOPs (1.0 = perfect)")
    print(f"{'dp':>4} {'packing':>10} {'distribution':>15} {'max/mean':>9} {'worst':>7} {'ms':>7}")
    for dp in (8, 16, 32):
        means = {}
        for packing, distribution in STRATEGIES:
            balances, padding, elapsed = [], [], 0.0
            for seed in range(args.seeds):
                lengths = lengths_for(seed, args.samples)
                start = time.perf_counter()
                s = schedule(lengths, dp, CAPACITY, packing=packing, distribution=distribution)
                elapsed += time.perf_counter() - start
                balances.append(s.balance)
                padded = padded_cost(s.micro_batches, lengths).sum()
                padding.append(1 - lengths.sum() / padded)
            mean = float(np.mean(balances))
            means[(packing, distribution)] = mean
            figures[f"max_mean_{packing}_{distribution}_dp{dp}"] = round(mean, 4)
            note = f"  padding {np.mean(padding):.3f}" if packing == "padded" else ""
            print(f"{dp:>4} {packing:>10} {distribution:>15} {mean:>9.4f} {max(balances):>7.4f} "
                  f"{1000 * elapsed / args.seeds:>7.1f}{note}")
            if packing == "padded":
                figures[f"padding_fraction_{distribution}_dp{dp}"] = round(float(np.mean(padding)), 4)
        for packing, distribution in STRATEGIES[1:]:
            reference = means[(packing if packing == "padded" else "first_fit", "round_robin")]
            if (packing, distribution) == ("padded", "round_robin"):
                continue
            key = f"max_mean_{packing}_{distribution}_vs_{'padded' if packing == 'padded' else 'first_fit'}_round_robin_dp{dp}"
            ratios[key] = round(means[(packing, distribution)] / reference, 4)

    print("\nKarmarkar-Karp (+ local refinement) on small instances vs brute-force optimum:")
    for equal_count in (False, True):
        r = small_instances(args.trials, equal_count)
        tag = "equal_count" if equal_count else "free_count"
        print(f"  {tag:>11}: optimal {r['optimal_share']:.2f} (plain differencing {r['optimal_share_plain']:.2f}), "
              f"worse than round-robin {r['worse_than_rr']} of {args.trials}")
        figures[f"kk_optimal_share_{tag}"] = round(r["optimal_share"], 3)
        figures[f"kk_plain_optimal_share_{tag}"] = round(r["optimal_share_plain"], 3)
        figures[f"kk_worse_than_rr_{tag}"] = r["worse_than_rr"]
    print(json.dumps({"bench": "dp_schedule", "figures": figures, "ratios": ratios}))


if __name__ == "__main__":
    main()
