"""FSDP2 alone against FSDP2 with expert parallelism, on two gloo ranks: the training step's time.

The tiny recipe (configs/tiny.yaml, built-in corpus) with many routed experts, as GLM-5 has (256 of
them, 2048 wide against a 6144 hidden size). Under FSDP2 alone each rank holds half of every expert and
gathers all of a layer's experts before its forward (and again for its backward), then reduce-scatters
their gradients: a layer's whole expert stacks cross the wire twice and back once a step, whatever the
batch. With ``train.expert_parallel=2`` each rank holds its own half of the experts whole and sends the
rows of the tokens routed to the other half there and back instead (a few rows of hidden size a token).
Both runs take the same data and schedule; the runs alternate, ``--rounds`` times each; reported: the
median step time over the steps after the first two (which build kernels), and the ratio.

    python bench/expert_parallel.py [--experts 64] [--steps 10] [--rounds 2]
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


def step_times(experts: int, ep: int, steps: int, run_dir: Path) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "orthon.launch.cli", "pretrain", "-c", "configs/tiny.yaml", f"model.n_routed_experts={experts}",
           "train.parallel=fsdp", f"train.expert_parallel={ep}", f"train.max_steps={steps}", f"train.run_dir={run_dir}",
           "train.checkpoint_interval=0", "train.eval_interval=0", "train.progress=false", "train.eval_samples=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two ranks on two cores
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records if "step_time_s" in r][2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(cpu_kind())
    print(f"tiny recipe with {args.experts} routed experts a MoE layer, 2 gloo ranks x 1 thread, FSDP2")
    times = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for ep in (1, 2) if r % 2 == 0 else (2, 1):
                times[ep] += step_times(args.experts, ep, args.steps, Path(tmp) / f"run_{ep}_{r}")
    fsdp, ep = statistics.median(times[1]), statistics.median(times[2])
    print(f"FSDP2 alone (all experts gathered a layer): {fsdp * 1e3:8.1f} ms a step")
    print(f"FSDP2 + expert_parallel=2 (tokens sent):    {ep * 1e3:8.1f} ms a step")
    print(f"expert parallel / FSDP2 alone: {ep / fsdp:.2f}")
    report("expert_parallel", {"experts": args.experts, "fsdp_ms": fsdp * 1e3, "expert_parallel_ms": ep * 1e3},
           {"expert_parallel_over_fsdp": ep / fsdp})


if __name__ == "__main__":
    main()
