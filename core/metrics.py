"""Metrics to JSONL and TensorBoard, and loss curves as PNG."""
from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    """One JSON object per line in ``metrics.jsonl`` plus TensorBoard scalars under ``tb/``.

    On resume the JSONL is cut back to the checkpoint's step, so the file never holds two values for
    one step (a crash after the checkpoint leaves lines the resumed run will write again); a fresh
    run (resume_step None) starts the file anew."""

    def __init__(self, run_dir, enabled: bool = True, resume_step: int | None = None, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.writer = None
        if not enabled:
            return
        if self.path.exists():
            # A fresh run (resume_step None) starts a new file: nothing stale is ever appended to.
            kept = [line for line in self.path.read_text().splitlines()
                    if resume_step is not None and line.strip() and json.loads(line).get("step", -1) <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)
        self.file = open(self.path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step)

    def log(self, step: int, **values) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.writer is not None:
                self.writer.close()


def _plain(value):
    if hasattr(value, "item"):
        return value.item()
    return value


def read_metrics(path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(records: list[dict], keys: list[str], out_png, title: str = "", logy: bool = False,
                reference: float | None = None, reference_label: str = "") -> None:
    """Plot metric ``keys`` against step (each only where present) to a PNG, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for key in keys:
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=key, marker="o" if len(points) < 30 else None, markersize=3)
    if reference is not None:
        ax.axhline(reference, color="gray", linestyle="--", linewidth=1, label=reference_label)
    ax.set_xlabel("step")
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out_png)


def save_figure(fig, out_png) -> None:
    """Write a matplotlib figure to PNG atomically (temp name, then rename) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_png = Path(out_png)
    tmp = out_png.with_name(out_png.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out_png)
