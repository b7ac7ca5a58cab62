"""Context parallelism against data parallelism on two gloo ranks: peak memory a rank and step time.

The tiny recipe (configs/tiny.yaml, built-in corpus) at a long sequence length, two sequences a step,
one a micro-batch, two ranks of one thread. Data parallel, each rank runs one whole sequence; with
``train.context_parallel=2`` both ranks run both sequences, each half of every sequence's positions (the
attention's keys gathered from the other). The tokens a rank computes a step are the same; what a rank
holds at once is not: a whole sequence's activations against half of one. Reported: the largest
resident memory of any rank over the run (the model, its optimizer state and the corpus alike in both,
so the difference is activations and what the heap keeps), the median step time after the first
two, and the ratios. ``--glibc-heap`` runs both under glibc's default heap settings instead of orthon's
(freed memory retained for reuse, orthon.core.allocator), which keeps the high-water mark of a heap that
a rank's two micro-batches and the gathers' buffers fragment.

    python bench/context_parallel.py [--seq-len 8192] [--steps 5] [--rounds 2] [--glibc-heap]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

from orthon.core.net import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Runs the command and prints the largest resident set of any process it waited for (the ranks), in KiB:
# a fresh interpreter for each run, so one run's peak is not another's.
PEAK = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def run(seq_len: int, cp: int, steps: int, run_dir: Path, glibc_heap: bool) -> tuple[float, list[float]]:
    """(peak resident GB of a rank, step times after the first two)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "orthon.launch.cli", "pretrain", "-c", "configs/tiny.yaml", f"data.seq_len={seq_len}",
           f"model.max_position_embeddings={seq_len}", "train.micro_batch_size=1",
           f"train.context_parallel={cp}", f"batch.start_batch_tokens={2 * seq_len}",
           f"batch.end_batch_tokens={2 * seq_len}", f"train.max_steps={steps}", f"train.run_dir={run_dir}",
           "train.checkpoint_interval=0", "train.eval_interval=0", "train.progress=false", "train.eval_samples=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two ranks on two cores
    if glibc_heap:
        env["ORTHON_RETAIN_FREED_MEMORY"] = "0"
    proc = subprocess.run([sys.executable, "-c", PEAK, *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    peak_gb = int(proc.stdout.split()[-1]) * 1024 / 1e9
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return peak_gb, [r["step_time_s"] for r in records if "step_time_s" in r][2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--glibc-heap", action="store_true", help="glibc's default heap settings for both runs")
    args = parser.parse_args()
    print(cpu_kind())
    heap = "glibc's defaults" if args.glibc_heap else "freed memory retained (orthon's default)"
    print(f"tiny recipe, sequences of {args.seq_len} tokens, 2 a step (1 a micro-batch), 2 gloo ranks x 1 thread; "
          f"heap: {heap}")
    peaks, times = {1: [], 2: []}, {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for cp in (1, 2) if r % 2 == 0 else (2, 1):
                peak, steps = run(args.seq_len, cp, args.steps, Path(tmp) / f"run_{cp}_{r}", args.glibc_heap)
                peaks[cp].append(peak)
                times[cp] += steps
    dp_peak, cp_peak = max(peaks[1]), max(peaks[2])
    dp_time, cp_time = statistics.median(times[1]), statistics.median(times[2])
    print(f"data parallel (a whole sequence a rank):      peak {dp_peak:6.2f} GB a rank, {dp_time:7.2f} s a step")
    print(f"context_parallel=2 (half of each, keys gathered): peak {cp_peak:6.2f} GB a rank, {cp_time:7.2f} s a step")
    print(f"context parallel / data parallel: memory {cp_peak / dp_peak:.2f}, time {cp_time / dp_time:.2f}")
    report("context_parallel", {"seq_len": args.seq_len, "glibc_heap": args.glibc_heap, "dp_peak_gb": dp_peak, "cp_peak_gb": cp_peak,
                                "dp_step_s": dp_time, "cp_step_s": cp_time},
           {"memory_cp_over_dp": cp_peak / dp_peak, "time_cp_over_dp": cp_time / dp_time})


if __name__ == "__main__":
    main()
