"""`orthon posttrain -c configs/posttrain_tiny.yaml --from RUN_DIR`: SFT -> reasoning RL -> agentic RL
-> general RL -> cross-stage OPD as one plan (orthon.rl.posttrain); running it again resumes."""
from __future__ import annotations

from pathlib import Path


def register(parser, name):
    parser.add_argument("-c", "--config", required=True, help="the post-training plan (YAML)")
    parser.add_argument("--from", dest="source", required=True, help="pretraining run directory (final/ weights, tokenizer)")


def resume_command(args, name) -> str | None:
    return f"resume with: orthon posttrain -c {args.config} --from {args.source}"


def run(args, name):
    from orthon.core.errors import CheckpointError
    from orthon.data.tokenizer import load_tokenizer
    from orthon.rl.posttrain import load_plan, run_posttrain
    from orthon.rl.recipe import source_tokenizer

    source = Path(args.source)
    if not (source / "final" / "config.json").is_file():
        raise CheckpointError(f"{source}: no final/ weights (is it a finished pretraining run directory?)")
    plan = load_plan(args.config)
    _check_fits(plan, Path(args.config), source / "final")
    tokenizer = load_tokenizer(source_tokenizer(source))
    summary = run_posttrain(plan, Path(args.config), source, tokenizer)
    from orthon.core import distributed

    if distributed.rank() != 0:  # under torchrun: rank 0 says it
        return 0
    for stage in summary["stages"]:
        print(f"{stage['name']:>14} ({stage['kind']}): {stage['time_s']:.0f} s")
    print("held-out reward of each stage's model on each RL stage's task:")
    print(reward_table(summary["evaluation"]))
    print(f"{plan.run_dir}/stages.json")
    return 0


def _check_fits(plan, plan_path: Path, start: Path) -> None:
    """Every stage against the machine before anything is allocated (the model is the source's throughout)."""
    from orthon.core.config import build
    from orthon.launch.args import check_rl_fits
    from orthon.pretrain.weights import load_config
    from orthon.rl.posttrain import stage_mapping
    from orthon.rl.recipe import RLRecipe

    model = load_config(start)
    teachers = {stage.name: start for stage in plan.stages}  # where the teachers' weights will be: any path
    for stage in plan.stages:
        recipe = build(RLRecipe, stage_mapping(plan, plan_path, stage, start, teachers))
        check_rl_fits(model, recipe, f"post-train (stage {stage.name})")


def reward_table(evaluation: dict[str, dict[str, float]]) -> str:
    """Rows: models; columns: tasks, each as wide as its name (two spaces apart)."""
    widths = {task: max(len(task), 5) for task in next(iter(evaluation.values()))}  # 5: "0.000"
    first = max(len(model) for model in evaluation)
    lines = [" " * first + "".join(f"  {task:>{w}}" for task, w in widths.items())]
    for model, row in evaluation.items():
        lines.append(f"{model:>{first}}" + "".join(f"  {row[task]:>{w}.3f}" for task, w in widths.items()))
    return "\n".join(lines)
