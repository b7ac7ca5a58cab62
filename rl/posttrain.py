"""Post-training as one plan: SFT -> reasoning RL -> agentic RL -> general RL -> cross-stage OPD.

A plan (``orthon posttrain -c configs/posttrain_tiny.yaml --from RUN``) names a base RL recipe and
its stages; each stage deep-merges its ``set:`` mapping over the base, starts from the previous
stage's final weights (the first from RUN/final) and writes its run under ``run_dir/<stage>``. An
OPD stage's teachers are earlier stages (``teachers: {teacher name: stage name}``), each scoring the
prompts of its own set. A finished stage (its final/ exists) is skipped and an interrupted one
resumes from its checkpoints, so the whole plan resumes by running the command again. At the end,
every stage's final model (and the starting one) is evaluated on every RL stage's held-out task
(a tool-using stage's task also without tools), so what a stage taught and what it made the model
forget stand side by side (stages.json). Under torchrun every stage trains data-parallel (the SFT and
RL steps' DP schedule); the ranks meet after each stage, and rank 0 evaluates and writes the summary.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from orthon.core import distributed
from orthon.core.config import build, deep_merge, read_yaml
from orthon.core.errors import ConfigError
from orthon.core.files import atomic_write_text
from orthon.core.plugins import resolve


@dataclass
class PosttrainStage:
    name: str
    kind: Literal["sft", "rl"] = "rl"
    set: dict[str, Any] = field(default_factory=dict)  # recipe keys over the plan's base recipe
    teachers: dict[str, str] = field(default_factory=dict)  # OPD: teacher name -> an earlier stage's name

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: must be a non-empty name without '/', got {self.name!r}")


@dataclass
class PosttrainPlan:
    recipe: str = "rl_tiny.yaml"  # the base RL recipe, relative to the plan's file
    run_dir: str = "runs/posttrain"
    stages: list[PosttrainStage] = field(default_factory=list)

    def __post_init__(self):
        names = [s.name for s in self.stages]
        if not names:
            raise ConfigError("stages: a plan needs at least one stage")
        if len(set(names)) != len(names):
            raise ConfigError(f"stages: names must differ, got {names}")
        for i, stage in enumerate(self.stages):
            for teacher, source in stage.teachers.items():
                if source not in names[:i]:
                    raise ConfigError(f"stages.{stage.name}.teachers.{teacher}: {source!r} is not an earlier stage")


def load_plan(path) -> PosttrainPlan:
    return build(PosttrainPlan, read_yaml(path))


def stage_mapping(plan: PosttrainPlan, plan_path: Path, stage: PosttrainStage, init_from: Path, finals: dict) -> dict:
    """The recipe mapping of one stage: the base recipe, the stage's keys, its run directory and start,
    its OPD teachers' weights."""
    mapping = deep_merge(read_yaml(Path(plan_path).parent / plan.recipe), stage.set)
    if "task" in stage.set.get("rl", {}):  # another task: the base task's arguments do not apply
        mapping["rl"]["task_args"] = dict(stage.set["rl"].get("task_args", {}))
    mapping = deep_merge(mapping, {"train": {"run_dir": str(Path(plan.run_dir) / stage.name), "init_from": str(init_from)}})
    if stage.teachers:
        teachers = mapping.get("rl", {}).get("opd", {}).get("teachers", [])
        for teacher in teachers:
            if teacher.get("name") not in stage.teachers:
                raise ConfigError(f"stages.{stage.name}: OPD teacher {teacher.get('name')!r} has no stage in teachers:")
            teacher["weights"] = str(finals[stage.teachers[teacher["name"]]])
    return mapping


def evaluate(weights: Path, recipe, tokenizer) -> dict:
    """Held-out rewards of ``weights`` on ``recipe``'s task (its rollout plug-in, its engine settings)."""
    from orthon.engine.in_process import InProcessEngine
    from orthon.pretrain.weights import load_weights
    from orthon.rl.rollout_manager import RolloutManager

    manager = RolloutManager(recipe.rl, tokenizer, InProcessEngine(load_weights(weights), recipe.rl.engine, tokenizer),
                             recipe.train.seed)
    return manager.evaluate()


def run_posttrain(plan: PosttrainPlan, plan_path: Path, source: Path, tokenizer, log=print) -> dict:
    from orthon.pretrain.trainer import write_run_config
    from orthon.pretrain.weights import load_config, load_runtime
    from orthon.rl.recipe import RLRecipe
    from orthon.rl.sft import fit_sft, read_conversations
    from orthon.rl.trainer import RLTrainer, summary_line

    if distributed.rank() != 0:
        log = lambda *_: None  # noqa: E731 - rank 0 speaks for the job
    finals: dict[str, Path] = {}
    recipes, summary = {}, {"stages": []}
    start = source / "final"
    for stage in plan.stages:
        # The stage's recipe, with the model of the weights it starts from.
        recipe = build(RLRecipe, stage_mapping(plan, Path(plan_path), stage, start, finals))
        recipe = replace(recipe, model=load_config(start), runtime=load_runtime(start))
        if getattr(tokenizer, "path", None):  # recorded, so a stage can be the --from of a later run
            recipe = replace(recipe, data=replace(recipe.data, tokenizer=str(tokenizer.path)))
        run_dir = Path(recipe.train.run_dir)
        began = time.perf_counter()
        if (run_dir / "final" / "config.json").is_file():
            log(f"stage {stage.name}: done before ({run_dir / 'final'})")
            result = {"skipped": True}
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_run_config(run_dir, recipe)  # what the stage ran with, as orthon rl records it
            log(f"stage {stage.name}: {stage.kind} from {start}")
            if stage.kind == "sft":
                sft = recipe.sft
                conversations = (read_conversations(sft.data) if sft.data.endswith(".jsonl") else
                                 resolve(sft.data, "sft.data")(tokenizer, sft.examples, seed=recipe.train.seed))
                result = fit_sft(recipe, tokenizer, conversations, log)
            else:
                trainer = RLTrainer(recipe, tokenizer, log=log)
                trainer.resume()
                result = trainer.fit()
        distributed.barrier()  # every rank sees this stage's final weights before the next stage loads them
        result["time_s"] = time.perf_counter() - began
        if not result.get("skipped") and distributed.rank() == 0:  # (SFT's other ranks return no losses)
            done = (f"{result['steps']} steps, loss {result['loss_start']:.3f} -> {result['loss_end']:.3f}"
                    if stage.kind == "sft" else summary_line(result))
            log(f"stage {stage.name} done: {done}; {result['time_s']:.0f} s")
        summary["stages"].append({"name": stage.name, "kind": stage.kind, **result})
        finals[stage.name] = start = run_dir / "final"
        if stage.kind == "rl":
            recipes[stage.name] = recipe
            if recipe.rl.rollout == "orthon.rl.multi_turn.tool_rollout":  # the task without tools, for comparison
                plain = replace(recipe.rl, rollout="orthon.rl.rollout.single_turn", rollout_args={})
                recipes[f"{stage.name} (no tools)"] = replace(recipe, rl=plain)
    # What each stage's model can do on each RL stage's task (the starting model's too).
    models = {"start": source / "final", **finals}
    if distributed.rank() == 0:
        from tqdm import tqdm

        pairs = [(model, task) for model in models for task in recipes]
        progress = any(r.train.progress for r in recipes.values())
        summary["evaluation"] = {model: {} for model in models}
        for model, task in tqdm(pairs, desc="evaluate stages", unit="run", disable=not progress):
            summary["evaluation"][model][task] = evaluate(models[model], recipes[task], tokenizer)["eval_reward"]
        atomic_write_text(Path(plan.run_dir) / "stages.json", json.dumps(summary, indent=1, default=str))
    return distributed.broadcast_object(summary)
