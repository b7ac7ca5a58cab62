"""`orthon ablate -c configs/ablation.yaml`: train the recipe once per optimizer variant (same data, seed
and token budget) and write loss / max-attention-logit plots and a table to ablation.out_dir.

A variant that finished keeps a marker beside its run; the same command run again (after Ctrl-C, or
with another variant added) reuses each finished variant whose recipe is unchanged and trains the rest."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from orthon.core.files import atomic_write_json
from orthon.launch.args import add_recipe_args, check_recipe_fits, require_recipe
from orthon.pretrain.recipe import load_recipe

DONE = "ablation_done.json"  # in a variant's run directory once it has finished: {"wall_s": ...}


def register(parser, name):
    add_recipe_args(parser)


def resume_command(args, name) -> str:
    return "the same command again reuses the variants that finished"


def finished_wall(run_dir: Path, recipe) -> float | None:
    """The wall time of a variant trained to the end with exactly ``recipe`` (its saved config.yaml), else None."""
    from orthon.pretrain.trainer import CONFIG_NAME, run_config_text

    try:
        wall = json.loads((run_dir / DONE).read_text())["wall_s"]
        saved = (run_dir / CONFIG_NAME).read_text()
    except (OSError, ValueError, KeyError):
        return None
    return wall if saved == run_config_text(recipe) else None


def run(args, name):
    from orthon.launch.cmd_pretrain import make_trainer, with_builtin_data
    from orthon.core.metrics import moving_average, plot_curves, read_metrics
    from orthon.optim.ablation import format_table, summarize
    from orthon.pretrain.trainer import write_run_config

    require_recipe(args, name)
    base = load_recipe(args.config, args.overrides)
    check_recipe_fits(base)
    ab = base.ablation
    out = Path(ab.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves, wall, logits = {}, {}, {}
    for variant in ab.variants:
        recipe = with_builtin_data(load_recipe(args.config, [*args.overrides, *variant.overrides]))
        run_dir = out / variant.name
        recipe = replace(recipe, train=replace(recipe.train, run_dir=str(run_dir), progress_label=variant.name))
        wall[variant.name] = finished_wall(run_dir, recipe)
        if wall[variant.name] is not None:
            print(f"=== {variant.name}: finished before ({run_dir}), reused")
        else:
            print(f"=== {variant.name}: {' '.join(variant.overrides)}")
            (run_dir / DONE).unlink(missing_ok=True)  # an older run's: this one has not finished yet
            write_run_config(run_dir, recipe)
            start = time.perf_counter()
            make_trainer(recipe, run_dir).fit()  # the recipe's backend: torch, or MindSpore
            wall[variant.name] = time.perf_counter() - start
            atomic_write_json(run_dir / DONE, {"wall_s": wall[variant.name]})
        records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
        curves[variant.name] = ([r["step"] for r in records], [r["loss"] for r in records])
        logits[variant.name] = [(r["step"], r.get("max_attn_logit")) for r in records]
    rows = summarize(curves, wall, ab.baseline, ab.smooth)
    table = format_table(rows, ab.baseline)
    (out / "table.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    merged = {}
    for name, (steps, losses) in curves.items():
        # Batches mix code and arithmetic, so the raw loss is noisy: plot the moving average the table uses.
        for s, l in zip(steps, moving_average(losses, ab.smooth)):
            merged.setdefault(s, {"step": s})[f"loss_{name}"] = l
        for s, m in logits[name]:
            if m is not None:
                merged.setdefault(s, {"step": s})[f"max_attn_logit_{name}"] = m
    records = [merged[s] for s in sorted(merged)]
    plot_curves(records, [f"loss_{n}" for n in curves], out / "loss.png", title=f"optimizer ablation: training loss ({ab.smooth}-step mean)",
                logy=True)
    plots = [out / "loss.png"]
    logged = [f"max_attn_logit_{n}" for n in curves if any(m is not None for _, m in logits[n])]
    if logged:  # the torch Trainer logs it; the MindSpore backend does not
        plot_curves(records, logged, out / "max_attn_logit.png",
                    title="largest attention logit per step (no gradient clipping)")
        plots.append(out / "max_attn_logit.png")
    print(table)
    print(f"plots: {', '.join(map(str, plots))}")
    return 0
