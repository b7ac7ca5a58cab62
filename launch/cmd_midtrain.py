"""`orthon midtrain -c plan.yaml --from RUN_DIR [key=value ...]`: long-context mid-training and DSA adaptation.

    orthon midtrain -c configs/midtrain_tiny.yaml --from runs/tiny      run every stage, then evaluate
    orthon midtrain --resume RUN                                        continue an interrupted plan
    orthon midtrain --eval RUN [RUN ...] [-c plan.yaml] [--out DIR]     passkey heat map + perplexity by position
    orthon midtrain --eval RUN --checkpoints [-c plan.yaml]             copying, heads, passkey at every checkpoint

The plan is checked (stage order, budgets, IndexShare after DSA, lengths against the source model)
before anything trains. After training, the source run and the mid-trained model are evaluated side
by side (RUN/eval/: eval.txt, eval.json, eval.png) unless --no-eval.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from orthon.core.errors import ConfigError
from orthon.launch.args import check_model_fits, check_weights_fit, held_out


def register(parser, name):
    parser.add_argument("-c", "--config", help="mid-training plan (configs/midtrain_*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run_dir=runs/x lr_start=1e-4")
    parser.add_argument("--from", dest="source", metavar="RUN_DIR", help="the pretraining run to continue")
    parser.add_argument("--resume", metavar="RUN", help="continue the mid-training run in RUN (its plan.yaml)")
    parser.add_argument("--eval", nargs="+", metavar="RUN", help="only evaluate these runs (pretraining, mid-training or stage dirs)")
    parser.add_argument("--out", help="where --eval writes its report (default: eval/ in the last RUN)")
    parser.add_argument("--no-eval", action="store_true", help="skip the evaluation after training")
    parser.add_argument("--engine", metavar="URL",
                        help="with --eval RUN: the passkey answers from the model served at URL (orthon serve or "
                             "SGLang; for a model too large for this process), on RUN's tokenizer and held-out text")
    parser.add_argument("--checkpoints", action="store_true",
                        help="with --eval: measure every kept checkpoint of each RUN at its training length "
                             "(when the copy head formed; timeline.json / timeline.png)")


def _names(runs: list[str]) -> dict[str, str]:
    names = {}
    for run in runs:
        base = Path(run).name or str(run)
        names[base if base not in names else str(run)] = run
    return names


def _check_fit(runs: list[str]) -> None:
    """Each run's model is evaluated whole in this process (orthon.midtrain.eval)."""
    from orthon.midtrain.eval import resolve_run
    from orthon.pretrain.weights import load_config

    for run in runs:
        check_weights_fit(load_config(resolve_run(run)[1]), f"evaluate {run}")


def _evaluate(runs: list[str], cfg, out_dir, engine: str | None = None) -> None:
    """The runs evaluated in this process, or (``engine``) the one run's prompts answered by a served model."""
    from orthon.midtrain.eval import evaluate_runs, evaluate_served, write_report

    if engine:
        results = {Path(runs[0]).name: evaluate_served(runs[0], engine, cfg)}
    else:
        _check_fit(runs)
        results = evaluate_runs(_names(runs), cfg)
    print(write_report(results, out_dir))
    print(f"report: {Path(out_dir) / 'eval.txt'}, heat map: {Path(out_dir) / 'eval.png'}")


def resume_command(args, name) -> str | None:
    """What to type after Ctrl-C (cli.py prints it)."""
    if args.eval:
        return None
    run_dir = args.resume or getattr(args, "started_run_dir", None)
    return f"resume with: orthon midtrain --resume {run_dir}" if run_dir else None


def run(args, name):
    from orthon.midtrain.config import LongEvalConfig
    from orthon.midtrain.stages import PLAN_NAME, load_plan, prepare, run_plan, stage_dir, stage_recipe

    if args.engine and not (args.eval and len(args.eval) == 1 and not args.checkpoints):
        raise ConfigError("--engine URL goes with --eval and one RUN (the run whose tokenizer and held-out text "
                          "make the prompts for the model served at URL)")
    if args.eval:
        cfg = load_plan(args.config, args.overrides).eval if args.config else LongEvalConfig()
        if args.checkpoints:
            from orthon.midtrain.timeline import run_timeline, write_timeline
            from orthon.pretrain.recipe import load_recipe

            for run in args.eval:
                if (Path(run) / "config.yaml").is_file():  # else run_timeline says what the directory lacks
                    check_weights_fit(load_recipe(Path(run) / "config.yaml").model, f"evaluate {run}")
                out = Path(run) / "eval" if not args.out else Path(args.out) / (Path(run).name if len(args.eval) > 1 else "")
                print(write_timeline(run_timeline(run, cfg), out))
                print(f"timeline: {out / 'timeline.json'}, {out / 'timeline.png'}")
            return 0
        _evaluate(args.eval, cfg, args.out or Path(args.eval[-1]) / "eval", args.engine)
        return 0
    if args.resume:
        # The run is where its plan.yaml is, whatever run_dir the plan recorded (a moved or copied run,
        # or a relative path from another working directory, must not continue the original).
        plan = load_plan(Path(args.resume) / PLAN_NAME, [*args.overrides, f"run_dir={args.resume}"])
    else:
        if not args.config:
            raise ConfigError("-c PLAN is required (or --resume RUN, or --eval RUN ...)")
        overrides = list(args.overrides) + ([f"source={args.source}"] if args.source else [])
        plan = load_plan(args.config, overrides)
        stages = Path(plan.run_dir) / "stages"
        if stages.is_dir() and any(stages.iterdir()):
            raise SystemExit(f"orthon midtrain: {plan.run_dir} already holds stages; use --resume {plan.run_dir} "
                             f"or another run_dir")
    source = prepare(plan)  # the source run and the plan against its model, before anything is allocated
    # Under the stages' parallelism (the source run's train section with the plan's overrides).
    train = stage_recipe(source, plan, 0, stage_dir(plan.run_dir, plan, 0)).train
    check_model_fits(source.model, train, command="mid-train")
    start = time.perf_counter()
    args.started_run_dir = str(plan.run_dir)
    summaries = run_plan(plan)
    for s in summaries:
        eval_loss = s.get("final_eval_loss")
        print(f"stage {s['stage']}: {s['step']} steps, {s['tokens']:,} tokens, train loss {s.get('loss', float('nan')):.4f}, "
              f"{held_out(eval_loss)}")
    print(f"done in {time.perf_counter() - start:.0f}s; run directory {plan.run_dir}")
    if not args.no_eval and int(os.environ.get("RANK", "0")) == 0:  # one process evaluates
        try:
            _check_fit([plan.source, plan.run_dir])
        except ConfigError as exc:  # the stages are saved: the run ends well, without its report
            print(f"evaluation skipped: {exc}")
            return 0
        _evaluate([plan.source, plan.run_dir], plan.eval, Path(plan.run_dir) / "eval")
    return 0
