"""MetricsLogger (JSONL + TensorBoard) across fresh runs and resumes, and the training plot."""
import math

import pytest

from orthon.core.metrics import EVENT_GLOB, MetricsLogger, plot_training, read_metrics


def _scalars(tb_dir, tag="loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _run(run_dir, steps, resume_step=None, offset=0.0):
    logger = MetricsLogger(run_dir, resume_step=resume_step)
    for step in steps:
        logger.log(step, loss=step + offset)
    logger.close()


def test_resume_continues_the_events_and_a_fresh_run_starts_clean(tmp_path):
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"
    _run(tmp_path, range(1, 7))  # crashed after step 6; its checkpoint is at step 4
    assert len(list(tb.glob(EVENT_GLOB))) == 1
    _run(tmp_path, range(5, 9), resume_step=4, offset=0.5)  # the resumed run redoes 5 and 6
    assert len(list(tb.glob(EVENT_GLOB))) == 2  # its own file, opening with a purge of the steps after 4
    expected = [(s, float(s)) for s in range(1, 5)] + [(s, s + 0.5) for s in range(5, 9)]
    assert _scalars(tb) == expected  # each step once, the resumed run's values after the purge
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == expected

    _run(tmp_path, range(1, 4), offset=10.0)  # a fresh run in the same directory
    assert len(list(tb.glob(EVENT_GLOB))) == 1
    assert _scalars(tb) == [(s, s + 10.0) for s in range(1, 4)]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3


def test_training_plot_has_the_final_point_smoothing_and_the_lr_panel(tmp_path):
    records = [{"step": s, "loss": 8.0 - 0.05 * s + (0.3 if s % 2 else -0.3), "lr": 1e-3 * min(1, s / 10),
                "grad_norm": 1.0 / s} for s in range(1, 41)]
    for s in (10, 20, 30):
        records[s - 1]["eval_loss"] = 8.0 - 0.05 * s
    records.append({"step": 40, "final_eval_loss": 5.9})
    series = plot_training(records, tmp_path / "loss.png", title="t", reference=math.log(4096))
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert series["eval_loss"] == ([10, 20, 30, 40], [7.5, 7.0, 6.5, 5.9])  # the final evaluation is the last point
    raw, smooth = series["loss"][1], series["loss_smoothed"][1]
    assert len(smooth) == len(raw) == 40
    wiggle = lambda ys: max(abs(a - b) for a, b in zip(ys[5:], ys[6:]))
    assert wiggle(smooth) < wiggle(raw) / 2
    assert series["lr"][1][-1] == 1e-3 and series["grad_norm"][0] == list(range(1, 41))
    # A final evaluation at a step that also had a periodic one replaces it (one point per step).
    records.append({"step": 30, "final_eval_loss": 6.4})
    assert plot_training(records, tmp_path / "b.png")["eval_loss"][1][2] == 6.4
