"""Asynchronous against synchronous RL on Ray: the same task, engines and reward latency, one run each.

    python bench/async_vs_sync.py --from runs/tiny_arith [--latency 0.2] [--engines 2] [--iterations 60]

Both runs are ``orthon rl`` on a Ray cluster (rl.cluster.enabled) from the same start, with a reward
that waits ``--latency`` seconds per sample (the cost of a sandboxed check) scored by reward worker
actors. Synchronous: the trainer waits while the iteration's groups are generated and scored, and the
engines wait while it trains. Asynchronous: generation and scoring go on while the trainer trains.
Printed per mode: samples trained per second (over the iterations, evaluation excluded), the trainer's
idle fraction (time waiting for groups over iteration time), the staleness of the trained groups
(weight versions behind the trainer) and the held-out reward at the start and end; then the ratio
async / sync of the throughput. Both sample as configs/rl_tiny.yaml does (DAPO's dynamic sampling: groups
whose rewards are all equal are dropped and up to ``--rounds`` rollout rounds refill the step), so the
samples counted are the informative ones the trainer learns from. Without it (``--rounds 0``: every
group trained, as generated) 60 iterations of 16 prompts moved the held-out reward by nothing in either
mode: most groups of this task are all right or all wrong, and their zero advantages dilute the step.
Run it alone: it measures wall time.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import cpu_kind, report  # noqa: E402


def run_mode(mode: str, source: Path, args, run_dir: Path) -> dict:
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.weights import load_config, load_runtime
    from orthon.rl import cluster
    from orthon.rl.recipe import load_rl_recipe

    overrides = [f"rl.mode={mode}", f"rl.iterations={args.iterations}", "rl.eval_interval=0",
                 f"rl.prompts_per_iteration={args.prompts}", f"rl.drop_zero_std_groups={args.rounds > 0}",
                 f"rl.max_sampling_rounds={max(args.rounds, 1)}",
                 "rl.cluster.enabled=true", f"rl.cluster.engines={args.engines}", f"rl.cluster.weight_sync={args.sync}",
                 f"rl.cluster.reward_workers={args.reward_workers}", "rl.reward.name=orthon.rl.tasks.arithmetic_reward",
                 f"rl.reward.latency_s={args.latency}", "rl.reward.concurrency=8",
                 f"rl.rollout_workers={args.rollout_workers}", f"rl.max_staleness={args.max_staleness}",
                 "rl.stale_groups=keep", f"train.run_dir={run_dir}", "train.progress=false",
                 f"rl.task_args.eval_size={args.eval_size}", "rl.eval_samples=2",
                 f"train.checkpoint_interval={args.iterations * 10}"]
    recipe = load_rl_recipe(ROOT / "configs/rl_tiny.yaml", overrides)
    policy = source / "final"
    recipe = replace(recipe, model=load_config(policy), runtime=load_runtime(policy),
                     train=replace(recipe.train, init_from=str(policy)))
    tokenizer = load_recipe(source / "config.yaml").data.tokenizer
    start = time.perf_counter()
    result = cluster.run(recipe, tokenizer, log=lambda *a: None)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    busy = sum(r["iteration_time_s"] - r.get("eval_s", 0.0) for r in steps)
    samples = sum(r["trained_samples"] for r in steps)
    staleness = collections.Counter()
    for r in steps:
        staleness.update({str(k): v for k, v in r.get("staleness_counts", {}).items()})
    return {"samples_per_s": samples / busy, "trainer_idle_fraction": sum(r["wait_s"] for r in steps) / busy,
            "trained_samples": samples, "loop_s": busy, "wall_s": wall, "staleness": dict(sorted(staleness.items())),
            "eval_start": result["eval_start"], "eval_end": result["eval_end"], "fleet": result.get("fleet", {})}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", default=str(ROOT / "runs/tiny_arith"),
                        help="a pretraining run directory (its final/ weights and config.yaml's tokenizer)")
    parser.add_argument("--latency", type=float, default=0.2, help="seconds each reward call waits")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per iteration (G = 8 samples each)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="dynamic sampling: rollout rounds to fill a step with informative groups (0: off)")
    parser.add_argument("--reward-workers", type=int, default=4, help="reward actors (each scores 8 calls at once)")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out prompts (2 samples each)")
    parser.add_argument("--rollout-workers", type=int, default=8, help="async: prompts in flight at once")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--sync", default="disk", choices=["disk", "distributed", "shared"], help="weight-sync path")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    source = Path(args.source)
    if not (source / "final").is_dir():
        raise SystemExit(f"{source}/final: no such weights directory (run orthon pretrain -c configs/tiny_arith.yaml first)")
    print(f"CPU: {cpu_kind()}; {args.engines} engine servers, reward latency {args.latency}s, "
          f"{args.iterations} iterations of {args.prompts} prompts x 8 samples")
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async"):
            figures[mode] = run_mode(mode, source, args, Path(tmp) / mode)
            f = figures[mode]
            print(f"{mode:>5}: {f['samples_per_s']:6.1f} samples/s trained, trainer idle {f['trainer_idle_fraction']:.0%}, "
                  f"staleness {f['staleness']}, held-out reward {f['eval_start']:.3f} -> {f['eval_end']:.3f} "
                  f"({f['loop_s']:.0f} s loop, {f['wall_s']:.0f} s with start-up)")
    ratio = figures["async"]["samples_per_s"] / figures["sync"]["samples_per_s"]
    print(f"async / sync throughput: {ratio:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"figures": figures, "ratio": ratio, "cpu": cpu_kind()}, indent=1))
    report("async_vs_sync", figures, {"async_over_sync": ratio})


if __name__ == "__main__":
    main()
