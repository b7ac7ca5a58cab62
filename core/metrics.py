"""Metrics to JSONL and TensorBoard, and loss curves as PNG."""
from __future__ import annotations

import json
import math
from pathlib import Path

from orthon.core.files import atomic_path, atomic_write_text

EVENT_GLOB = "events.out.tfevents.*"


def open_step_log(path: Path, resume_step: int | None):
    """A per-step JSON-lines file opened for appending, first cut back to the records of steps up to
    ``resume_step``; a fresh run (None) starts it empty: nothing stale is ever appended to."""
    if path.exists():
        kept = [line for line in path.read_text().splitlines()
                if resume_step is not None and line.strip() and json.loads(line).get("step", -1) <= resume_step]
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return open(path, "a")


class MetricsLogger:
    """One JSON object per line in ``metrics.jsonl`` plus TensorBoard scalars under ``tb/``.

    On resume the JSONL is cut back to the checkpoint's step, so the file never holds two values for
    one step (a crash after the checkpoint leaves lines the resumed run will write again); a fresh
    run (resume_step None) starts the file anew. TensorBoard likewise: a resumed run writes a new event
    file that opens with a purge after the resumed step (readers drop the old file's later steps, so each
    step has the resumed run's value), and a fresh run first removes the event files of any earlier
    run in the same directory."""

    def __init__(self, run_dir, enabled: bool = True, resume_step: int | None = None, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.writer = None
        if not enabled:
            return
        self.file = open_step_log(self.path, resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = Path(run_dir) / "tb"
            if resume_step is None:
                for old in tb.glob(EVENT_GLOB):
                    old.unlink()
            # purge_step drops the steps from it on (>=); the resumed run's first new step is resume_step + 1.
            self.writer = SummaryWriter(str(tb), purge_step=None if resume_step is None else resume_step + 1)

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
    plt = pyplot()

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


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed), imported on first use: the
    commands that never plot do not pay for matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out_png) -> None:
    """Write a matplotlib figure to PNG atomically (temp name, then rename) and close it."""
    plt = pyplot()
    fig.tight_layout()
    try:
        with atomic_path(out_png) as tmp:
            fig.savefig(tmp, format="png")  # the temporary name ends in .tmp: say the format
    finally:
        plt.close(fig)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _points(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in records
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]


def plot_training(records: list[dict], out_png, title: str = "", reference: float | None = None,
                  reference_label: str = "ln(vocab)", smooth: int | None = None) -> dict:
    """A training run's picture, written atomically to ``out_png``: the loss panel (raw training loss,
    its trailing ``smooth``-step mean, held-out loss with the final evaluation as its last point, an
    optional reference line) over a panel of learning rate and gradient norm (own axes). Returns the
    plotted series, ``{name: (steps, values)}``."""
    plt = pyplot()

    series: dict[str, tuple[list, list]] = {}
    loss = _points(records, "loss")
    if loss:
        xs, ys = map(list, zip(*loss))
        window = smooth or max(2, round(len(ys) / 15))
        series["loss"] = (xs, ys)
        series["loss_smoothed"] = (xs, moving_average(ys, window))
    held = dict(_points(records, "eval_loss"))
    held.update(_points(records, "final_eval_loss"))  # the last step's evaluation; replaces one at that step
    if held:
        steps = sorted(held)
        series["eval_loss"] = (steps, [held[s] for s in steps])
    for key in ("lr", "grad_norm"):
        points = _points(records, key)
        if points:
            series[key] = tuple(map(list, zip(*points)))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 6.4), dpi=110, sharex=True,
                                      gridspec_kw={"height_ratios": [2.2, 1]})
    if "loss" in series:
        top.plot(*series["loss"], color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss")
        top.plot(*series["loss_smoothed"], color="tab:blue", linewidth=1.8,
                 label=f"train loss, {window}-step mean")
    if "eval_loss" in series:
        top.plot(*series["eval_loss"], color="tab:orange", marker="o", markersize=4, linewidth=1.5,
                 label="held-out loss")
        last_x, last_y = series["eval_loss"][0][-1], series["eval_loss"][1][-1]
        top.annotate(f"{last_y:.3f}", (last_x, last_y), textcoords="offset points", xytext=(4, 6),
                     color="tab:orange", fontsize=8)
    if reference is not None:
        top.axhline(reference, color="gray", linestyle="--", linewidth=1, label=reference_label)
    top.set_ylabel("loss (nats / token)")
    top.set_title(title)
    top.grid(alpha=0.3)
    top.legend(fontsize=8)

    handles = []
    if "lr" in series:
        handles += bottom.plot(*series["lr"], color="tab:green", linewidth=1.4, label="learning rate")
        bottom.set_ylabel("learning rate", color="tab:green")
        bottom.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    if "grad_norm" in series:
        right = bottom.twinx()
        handles += right.plot(*series["grad_norm"], color="tab:red", alpha=0.8, linewidth=1.0, label="gradient norm")
        right.set_ylabel("gradient norm", color="tab:red")
    if handles:
        bottom.legend(handles=handles, labels=[h.get_label() for h in handles], fontsize=8, loc="upper right")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    save_figure(fig, out_png)
    return series
