"""A tiny pretraining run on each backend, same recipe, data and initial weights: both loss curves
on one PNG.

Runs `orthon pretrain -c RECIPE backend=torch` and `... backend=mindspore` (one process each, one
after the other), then plots the training loss of both (raw and a trailing mean) and their held-out
losses from the runs' metrics.jsonl. Both runs start from the same weights (the MindSpore trainer
copies the torch model's initialisation under train.seed) and read the same batches, so the curves
differ only by the backends' arithmetic.

    OMP_NUM_THREADS=1 python bench/mindspore_vs_torch_loss.py [-c configs/tiny.yaml] [--steps 110]
        [--mode graph] [--out runs/mindspore_vs_torch] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def train(recipe: str, backend: str, run_dir: Path, steps: int, mode: str, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "orthon.launch.cli", "pretrain", "-c", recipe, f"backend={backend}",
           f"mindspore.mode={mode}", f"train.run_dir={run_dir}", "train.progress=false", *extra]
    if steps:
        cmd.append(f"train.max_steps={steps}")
    cmd += ["--sample", ""]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.perf_counter() - start


def read(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def plot(curves: dict[str, list[dict]], out_png: Path, title: str, smooth: int = 10) -> None:
    from orthon.core.metrics import moving_average, pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    # torch wide and solid underneath, MindSpore thin and dotted on top: where they agree both show.
    styles = (("tab:blue", "-", 3.2, "o"), ("tab:red", ":", 1.8, "x"))
    for (name, records), (color, line, width, marker) in zip(curves.items(), styles):
        steps = [r["step"] for r in records if "loss" in r]
        losses = [r["loss"] for r in records if "loss" in r]
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=1)
        ax.plot(steps, moving_average(losses, smooth), color=color, linestyle=line, linewidth=width,
                label=f"{name} train ({smooth}-step mean)")
        held = [(r["step"], r.get("eval_loss", r.get("final_eval_loss"))) for r in records
                if r.get("eval_loss", r.get("final_eval_loss")) is not None]
        if held:
            ax.plot(*zip(*held), color=color, linestyle="--", marker=marker, markersize=5, label=f"{name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out_png)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=0, help="stop both runs after this many steps (0: the recipe's)")
    parser.add_argument("--mode", default="graph", choices=["graph", "pynative"])
    parser.add_argument("--out", default="runs/mindspore_vs_torch")
    parser.add_argument("--set", nargs="*", default=[], help="recipe overrides for both runs")
    args = parser.parse_args()
    out = ROOT / args.out
    print(f"CPU: {cpu_kind()}")
    walls, curves = {}, {}
    for backend in ("torch", "mindspore"):
        walls[backend] = train(args.config, backend, out / backend, args.steps, args.mode, args.set)
        curves[backend] = read(out / backend)
    png = out / "loss.png"
    plot(curves, png, f"{Path(args.config).name}: torch vs MindSpore ({args.mode}), same data and initial weights")
    finals = {b: next((r["final_eval_loss"] for r in reversed(c) if "final_eval_loss" in r), None) for b, c in curves.items()}
    last = {b: [r["loss"] for r in c if "loss" in r][-1] for b, c in curves.items()}
    print(f"wrote {png}")
    for b in curves:
        print(f"{b:<10} final train loss {last[b]:.4f}  held-out {finals[b]}  wall {walls[b]:.0f}s")
    print(json.dumps({"bench": "mindspore_vs_torch_loss", "figures": {
        **{f"{b}_final_train_loss": round(v, 4) for b, v in last.items()},
        **{f"{b}_final_eval_loss": v for b, v in finals.items()},
        **{f"{b}_wall_s": round(v, 1) for b, v in walls.items()}, "cpu": cpu_kind()},
        "ratios": {"mindspore_wall_vs_torch": round(walls["mindspore"] / walls["torch"], 3)}}))


if __name__ == "__main__":
    main()
