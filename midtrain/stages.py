"""The stage runner: continue a pretraining run (weights and optimizer state) through the plan's stages.

Each stage is the one Trainer (the same loop, checkpoints, metrics, resume) over a recipe derived from
the source run's: the stage's sequence length, RoPE base, IndexShare layer types, DSA switch, LR
segment and chunked cross-entropy, with mid-training's step plug-in (orthon.midtrain.steps: phases and
the indexer KL). Layout of a mid-training run directory:

    RUN/plan.yaml                       the resolved plan and the source run
    RUN/stages/00_<name>/               one Trainer run directory per stage: config.yaml, metrics.jsonl,
                                        checkpoints/ (resumable inside the stage), final/ (weights)
    RUN/stages/00_<name>/stage_done.json written when the stage is complete
A stage starts from the newest good checkpoint of the previous stage (the first from the source run);
a rerun skips finished stages and resumes the unfinished one from its own checkpoint.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from orthon.core import config as config_io
from orthon.core import distributed
from orthon.core.errors import CheckpointError, ConfigError
from orthon.data.config import DataConfig
from orthon.core.files import atomic_write_text
from orthon.midtrain.config import MidtrainPlan
from orthon.midtrain.optimizer import StageOptimizer
from orthon.midtrain.steps import StageStep
from orthon.optim.config import BatchRampConfig, ScheduleConfig
from orthon.pretrain import context_parallel
from orthon.pretrain import checkpoint
from orthon.pretrain.checkpoint import Checkpointer
from orthon.pretrain.config import RuntimeOptions
from orthon.pretrain.recipe import Recipe, load_recipe
from orthon.pretrain.train_config import TrainConfig
from orthon.pretrain.trainer import CONFIG_NAME, Trainer, write_run_config

PLAN_NAME = "plan.yaml"
DONE_NAME = "stage_done.json"


def stage_dir(run_dir, plan: MidtrainPlan, index: int) -> Path:
    return Path(run_dir) / "stages" / f"{index:02d}_{plan.stages[index].name}"


def stage_recipe(source: Recipe, plan: MidtrainPlan, index: int, run_dir) -> Recipe:
    """The Trainer recipe of stage ``index``: the source run's, with the stage's length, RoPE base,
    attention settings, batch, LR segment and budget."""
    stage = plan.stages[index]
    indexer_types = None
    if stage.index_share:
        indexer_types = plan.indexer_types(source.model.num_hidden_layers)
    model = source.model.replace(rope_theta=plan.rope_theta(index, source.model.rope_theta), indexer_types=indexer_types)
    runtime = config_io.build(RuntimeOptions, {**config_io.to_dict(source.runtime), **plan.runtime,
                                               "sparse_attention": stage.dsa != "off"}, "runtime")
    lr0, lr1 = plan.lr_segment(index)
    batch = stage.batch_tokens or plan.batch_tokens
    train = config_io.build(TrainConfig, {
        **config_io.to_dict(source.train), **plan.train, "run_dir": str(run_dir), "total_tokens": stage.tokens,
        "max_steps": 0, "progress_label": f"stage {stage.name}",
        "init_from": "",  # a stage starts from the previous stage's weights and optimizer, loaded by the stage
        **({"micro_batch_size": stage.micro_batch_size} if stage.micro_batch_size else {}),
        **({"context_parallel": stage.context_parallel} if stage.context_parallel else {})}, "train")
    # The plan's data overrides; a different shuffle per stage, reproducible from the source seed.
    data = config_io.build(DataConfig, {**config_io.to_dict(source.data), **plan.data, "seq_len": stage.seq_len,
                                        "seed": source.data.seed + 1000 * (index + 1)}, "data")
    return replace(source, model=model, runtime=runtime, data=data, train=train,
                   schedule=ScheduleConfig(kind="linear", peak_lr=lr0, floor_lr=lr1, warmup_tokens=0,
                                           total_tokens=stage.tokens),
                   batch=BatchRampConfig(start_batch_tokens=batch, end_batch_tokens=batch, ramp_tokens=0))


def _stage_optimizer(model, recipe) -> StageOptimizer:
    # Everything trainable until a step says otherwise: torch.distributed.checkpoint restores optimizer
    # state only for parameters that require grad, and a resume must restore all of it.
    model.requires_grad_(True)
    return StageOptimizer(model, recipe.optim, recipe.schedule)


def stage_trainer(plan: MidtrainPlan, index: int, source: Recipe, run_dir, log=print) -> Trainer:
    """The one Trainer running stage ``index``: the stage's recipe, the LM + indexer-KL step plug-in,
    and the optimizer split into main and indexer parts."""
    recipe = stage_recipe(source, plan, index, run_dir)
    step = StageStep(plan.stages[index], recipe.train.loss_chunk, recipe.data.document_mask)
    return Trainer(recipe, run_dir, log, step=step, build_optimizer=_stage_optimizer)


# ---------------------------------------------------------------- stage hand-over
@torch.no_grad()
def scale_attention_logits(model, factor: float) -> None:
    """Every layer's attention logits q.k times ``factor``: q_b_proj makes the whole query (both its
    no-RoPE and RoPE halves) from the normed q_a output, so scaling it scales q alone; the indexers
    read the q_a output itself and are untouched."""
    for layer in model.model.layers:
        layer.self_attn.q_b_proj.weight.mul_(factor)


def _previous_checkpoint(plan: MidtrainPlan, index: int, run_dir: Path, log) -> Path:
    """The checkpoint stage ``index`` starts from: the previous stage's newest good one, the first stage's
    the source run's."""
    directory = Path(plan.source) if index == 0 else stage_dir(run_dir, plan, index - 1)
    path = Checkpointer(directory, log=log).latest_good()
    if path is None:
        # Mid-training continues the optimizer state too, so a weights directory alone (final/) is not enough.
        raise CheckpointError(f"{directory}: no checkpoint to continue from (mid-training needs "
                              f"{'the source run' if index == 0 else 'the previous stage'}'s checkpoints/, with its "
                              f"optimizer state, not only final/)")
    return path


def carry_training_state(path: Path, trainer: Trainer, log) -> None:
    """The previous run's weights and optimizer state into the stage's (maybe sharded) model, by name."""
    report = checkpoint.carry(path, trainer.model, trainer.optimizer.optimizers)
    log(f"continuing {path.parent.parent} from {path.name}")
    if report["dropped"]:
        log(f"dropping {len(report['dropped'])} tensors the new stage's model does not have "
            f"(e.g. {report['dropped'][0]})")
    fresh = report["fresh"]
    log(f"carried optimizer state for {report['carried']} of {report['carried'] + len(fresh)} parameters"
        + (f"; fresh state for {len(fresh)} without state there (e.g. {fresh[0]})" if fresh else ""))


def _clear_partial(directory: Path) -> None:
    import shutil

    for name in ("metrics.jsonl", "samples.jsonl"):
        (directory / name).unlink(missing_ok=True)
    shutil.rmtree(directory / "tb", ignore_errors=True)


def write_plan(run_dir: Path, plan: MidtrainPlan) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / PLAN_NAME, yaml.safe_dump(config_io.to_dict(plan), sort_keys=False))


def load_plan(path, overrides=()) -> MidtrainPlan:
    return config_io.load(MidtrainPlan, path, overrides)


def prepare(plan: MidtrainPlan) -> Recipe:
    """Every check that can fail before training: the source run, and the plan against its model."""
    source_dir = Path(plan.source)
    if not plan.source:
        raise ConfigError("source: no pretraining run given (use --from RUN_DIR)")
    if not (source_dir / CONFIG_NAME).is_file():
        raise ConfigError(f"source: {source_dir} is not a pretraining run directory (no {CONFIG_NAME})")
    source = load_recipe(source_dir / CONFIG_NAME)
    plan.check_against_model(source.model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for i, stage in enumerate(plan.stages):  # every stage's derived config must build (e.g. IndexShare types)
        train = stage_recipe(source, plan, i, stage_dir(plan.run_dir, plan, i)).train
        if world > 1:  # a later stage's degree that does not fit this world fails now, not hours into the run
            context_parallel.check_degree(train.context_parallel, world, stage.seq_len,
                                          f"stages[{i}] ({stage.name}): train.context_parallel")
    return source


def run_plan(plan: MidtrainPlan, log=print) -> list[dict]:
    """Run (or continue) every stage of ``plan`` in plan.run_dir; returns each stage's summary."""
    source = prepare(plan)
    run_dir = Path(plan.run_dir)
    rank = int(os.environ.get("RANK", "0"))  # the process group starts in the first StageTrainer
    if rank == 0:
        write_plan(run_dir, plan)
    summaries = []
    for i, stage in enumerate(plan.stages):
        directory = stage_dir(run_dir, plan, i)
        done = directory / DONE_NAME
        if done.is_file():
            summaries.append(json.loads(done.read_text()))
            continue
        log(f"stage {i} {stage.name!r}: seq_len {stage.seq_len}, {stage.tokens:,} tokens, dsa {stage.dsa}, "
            f"IndexShare {'on' if stage.index_share else 'off'}")
        trainer = stage_trainer(plan, i, source, directory, log=log)
        if rank == 0 and not (directory / CONFIG_NAME).is_file():
            write_run_config(directory, trainer.recipe)
        distributed.barrier()
        if not trainer.resume():
            if rank == 0:
                _clear_partial(directory)  # a start killed before its first checkpoint left these behind
            distributed.barrier()
            carry_training_state(_previous_checkpoint(plan, i, run_dir, log), trainer, log)
            if stage.attention_scale != 1.0:  # once, at the start: a resumed stage's weights hold it already
                scale_attention_logits(trainer.model, stage.attention_scale)
                log(f"attention logits scaled by {stage.attention_scale:g} (q_b_proj)")
        result = trainer.fit()
        trainer.step_fn.close()
        summary = {"stage": stage.name, "index": i, **{k: v for k, v in result.items() if not isinstance(v, torch.Tensor)}}
        if rank == 0:
            atomic_write_text(done, json.dumps(summary))
        distributed.barrier()
        summaries.append(summary)
    return summaries
