"""When did a run learn to copy? The copying check, head diagnostics and passkey at the run's training
length, at every checkpoint it kept (``orthon midtrain --eval RUN --checkpoints``).

Retrieval of any kind rests on an induction (copy) head, and such a head forms suddenly, after a
plateau: the repeat of a random sequence stays as hard to predict as its first half, then within a few
hundred steps becomes nearly free. The step where that happens says how long a recipe must pretrain
before any context-length figure can mean anything. Formation is reported at fixed thresholds
(FORMED): the first checkpoint whose repeat costs at least 1 nat less than the random half it repeats,
whose best head puts a third of its attention where an induction head does (uniform attention: about
1 / position), and whose passkey exact match at the training length reaches 0.9.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from orthon.core.files import atomic_write_text
from orthon.core.metrics import pyplot, save_figure
from orthon.midtrain.config import LongEvalConfig
from orthon.midtrain.eval import Haystack, copy_nll, head_scores, passkey_scores

# metric -> (threshold, "below" | "above"): the step a run crosses it is the step the mechanism formed.
FORMED = {"copy_gain": (1.0, "above"), "induction": (0.3, "above"), "passkey": (0.9, "above")}


def checkpoint_point(model, tokenizer, haystack: Haystack, cfg: LongEvalConfig, length: int) -> dict:
    """The measurements of one model at one length: copying NLLs, best-head scores, passkey."""
    cfg = replace(cfg, lengths=[length])
    copy = copy_nll(model, cfg)[length]
    layers = head_scores(model, haystack, cfg)[length]["layers"]
    accuracy, nats = passkey_scores(model, tokenizer, haystack, cfg, log=lambda *_: None)
    return {"copy_first_nll": copy["first"], "copy_repeat_nll": copy["repeat"],
            "copy_gain": copy["first"] - copy["repeat"],  # nats the repeat saves: an induction head's work
            "induction": max(x["induction"] for x in layers),
            "previous_token": max(x["previous_token"] for x in layers),
            "passkey": sum(accuracy[length].values()) / len(accuracy[length]),
            "passkey_answer_nll": sum(nats[length].values()) / len(nats[length])}


def formation_steps(points: list[dict]) -> dict[str, int | None]:
    """{metric: the first step whose value crosses FORMED's threshold, or None}."""
    out = {}
    for key, (threshold, side) in FORMED.items():
        crossed = [p["step"] for p in points if (p[key] < threshold if side == "below" else p[key] >= threshold)]
        out[key] = crossed[0] if crossed else None
    return out


def run_timeline(run_dir, cfg: LongEvalConfig, log=print) -> dict:
    """The measurements at every checkpoint of a pretraining run (or one stage), at its training length."""
    from orthon.data.tokenizer import load_tokenizer
    from orthon.pretrain.checkpoint import Checkpointer
    from orthon.pretrain.model import GLMForCausalLM
    from orthon.pretrain.recipe import load_recipe

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no config.yaml)")
    recipe = load_recipe(run_dir / "config.yaml")
    checkpointer = Checkpointer(run_dir, log=log)
    steps = checkpointer.step_dirs()
    if not steps:
        raise FileNotFoundError(f"{run_dir}: no checkpoints (keep them with train.keep_last)")
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    haystack = Haystack.from_valid(recipe.data.valid, cfg.haystack)
    length = recipe.data.seq_len
    model = GLMForCausalLM(recipe.model, runtime=replace(recipe.runtime)).eval()
    points = []
    for path in steps:
        state = checkpointer.load_model(path, model)
        model.eval()
        point = {"step": state["step"], "tokens": state["tokens"],
                 **checkpoint_point(model, tokenizer, haystack, cfg, length)}
        points.append(point)
        log(f"  step {point['step']}: copy NLL {point['copy_first_nll']:.2f} / {point['copy_repeat_nll']:.2f}, "
            f"induction {point['induction']:.2f}, previous-token {point['previous_token']:.2f}, "
            f"passkey {point['passkey']:.2f}")
    return {"run": str(run_dir), "length": length, "points": points, "formed": formation_steps(points),
            "thresholds": {k: {"value": v, "side": s} for k, (v, s) in FORMED.items()}}


def plot_timeline(result: dict, out_png) -> None:
    """Copying NLLs, best-head scores and passkey against the step, the formation steps marked."""
    plt = pyplot()

    points = result["points"]
    steps = [p["step"] for p in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    ax1.plot(steps, [p["copy_first_nll"] for p in points], marker="o", label="random half")
    ax1.plot(steps, [p["copy_repeat_nll"] for p in points], marker="o", label="its repeat")
    ax1.set_xlabel("step")
    ax1.set_ylabel("NLL (nats)")
    ax1.set_title(f"copying check at L={result['length']}")
    ax1.legend()
    for key, label in (("induction", "best induction score"), ("previous_token", "best previous-token score"),
                       ("passkey", "passkey exact match")):
        ax2.plot(steps, [p[key] for p in points], marker="o", label=label)
    ax2.set_ylim(0, 1.02)
    ax2.set_xlabel("step")
    ax2.set_title("heads and retrieval")
    for ax, key in ((ax1, "copy_gain"), (ax2, "induction")):
        if result["formed"][key] is not None:
            ax.axvline(result["formed"][key], linestyle="--", color="grey", linewidth=0.8)
    ax2.legend(fontsize=8)
    save_figure(fig, out_png)


def write_timeline(result: dict, out_dir) -> str:
    """timeline.json and timeline.png in out_dir; returns a summary line."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "timeline.json", json.dumps(result, indent=1))
    plot_timeline(result, out_dir / "timeline.png")
    formed = result["formed"]
    return (f"{result['run']} at L={result['length']}: the repeat 1 nat cheaper from step {formed['copy_gain']}, "
            f"induction >= 0.3 from step {formed['induction']}, passkey >= 0.9 from step {formed['passkey']}")
