"""`orthon pretrain -c recipe.yaml [key=value ...]` or `orthon pretrain --resume RUN_DIR`.

With no data sources in the recipe, the built-in corpus (Python standard library + generated
arithmetic) is prepared first (once; reused afterwards) and the tokenizer trained on it. Launch on
several processes with torchrun (DDP or FSDP2 by train.parallel)."""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from orthon.core.errors import ConfigError, OrthonError
from orthon.launch.args import add_recipe_args, check_recipe_fits, held_out, require_recipe
from orthon.pretrain.recipe import Recipe, load_recipe, with_tokenizer_ids


def register(parser, name):
    add_recipe_args(parser)
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last good checkpoint")
    parser.add_argument("--step", type=int, help="with --resume: continue from the checkpoint of this step instead "
                                                 "(the later ones are moved to checkpoints/abandoned/)")
    parser.add_argument("--skip-batches", type=int, default=0, metavar="K",
                        help="with --resume: move the data past the next K steps' batches first (past a loss spike)")
    parser.add_argument("--sample", default="def ", help="prompt to sample from the trained model at the end")


def with_builtin_data(recipe: Recipe, log=print) -> Recipe:
    """Fill data.sources/valid/tokenizer from the built-in corpus when the recipe names no sources; then
    the model's token ids from the tokenizer (``with_tokenizer_ids``)."""
    if recipe.data.sources:
        return with_tokenizer_ids(with_stores_tokenizer(recipe, log), log)
    if not recipe.train.builtin_dir:
        return with_tokenizer_ids(recipe, log)
    from orthon.data.builtin import prepare_builtin

    b = recipe.builtin
    fields = {k: getattr(b, k) for k in b.__dataclass_fields__ if k not in ("vocab_size", "seed", "weights")}
    paths = prepare_builtin(recipe.train.builtin_dir, vocab_size=b.vocab_size, seed=b.seed, log=log, **fields)
    d = recipe.data
    data = paths.data_config(seq_len=d.seq_len, weights=dict(b.weights) or None, seed=d.seed, shuffle=d.shuffle, document_mask=d.document_mask,
                             blend_cycle=d.blend_cycle, num_samples=d.num_samples)
    return with_tokenizer_ids(replace(recipe, data=data), log)


def with_stores_tokenizer(recipe: Recipe, log=print) -> Recipe:
    """data.tokenizer checked against the stores' (``orthon.data.store.stores_tokenizer``), or filled from
    them when the recipe names none: the run then records it, and generate, export and RL find it."""
    from orthon.data.store import stores_tokenizer

    d = recipe.data
    stores = [s.path for s in [*d.sources, *d.valid]]
    found = stores_tokenizer(stores, d.tokenizer)
    if found == d.tokenizer:
        return recipe
    log(f"data.tokenizer: {found} (the one the stores were prepared with)")
    return replace(recipe, data=replace(d, tokenizer=found))


def resume_command(args, name) -> str:
    """What to type after Ctrl-C (cli.py prints it)."""
    run_dir = args.resume or getattr(args, "started_run_dir", None)
    if run_dir is None:  # stopped before the run directory was set up: the same command starts it
        import shlex
        import sys

        return "nothing trained yet; start again with: orthon " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    from orthon.pretrain.checkpoint import Checkpointer

    steps = Checkpointer(run_dir).step_dirs()
    where = (f"newest checkpoint: step {int(steps[-1].name.split('_')[1])}" if steps
             else "no checkpoint yet, it restarts at step 0")
    from orthon.core.distributed import launched_by_msrun

    launcher = ("msrun" if launched_by_msrun() else
                "torchrun" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    how = f" through the same launch (orthon launch {launcher} ... -- pretrain --resume {run_dir})" if launcher else ""
    return f"resume with: orthon pretrain --resume {run_dir}{how} ({where})"


def make_trainer(recipe, run_dir, with_data: bool = True):
    """The trainer of the recipe's backend: the torch Trainer over orthon's model or over megatron-core's
    (``backend=megatron``), or the MindSpore loop (``backend=mindspore``); the same data, schedule, routing
    and outputs."""
    if recipe.backend == "mindspore":
        from orthon.backends.mindspore.trainer import MindSporeTrainer

        return MindSporeTrainer(recipe, run_dir, with_data=with_data)
    from orthon.pretrain.trainer import Trainer

    return Trainer(recipe, run_dir, with_data=with_data)


def run(args, name):
    from orthon.pretrain.trainer import CONFIG_NAME, write_run_config

    if (args.step is not None or args.skip_batches) and not args.resume:
        raise ConfigError("--step and --skip-batches go with --resume RUN_DIR")
    if args.skip_batches < 0:
        raise ConfigError(f"--skip-batches: must be >= 0, got {args.skip_batches}")
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / CONFIG_NAME).is_file():
            raise OrthonError(f"--resume {run_dir}: " + ("no such run directory" if not run_dir.is_dir() else
                                                         f"no {CONFIG_NAME} (not a run directory, or the run was "
                                                         f"stopped before it started: run its pretrain command again)"))
        recipe = load_recipe(run_dir / CONFIG_NAME, args.overrides)
        if recipe.backend == "mindspore" and (args.step is not None or args.skip_batches):
            raise ConfigError("--step and --skip-batches: the torch backend's (the MindSpore backend resumes from its newest checkpoint)")
        check_recipe_fits(recipe)
    else:
        require_recipe(args, name)
        recipe = load_recipe(args.config, args.overrides)
        check_recipe_fits(recipe)  # before the corpus, before any weights
        from orthon.core import distributed

        # Every rank of a torchrun job prepares (the first builds, the others wait and reuse); rank 0 speaks.
        recipe = with_builtin_data(recipe, log=print if distributed.rank() == 0 else (lambda *_: None))
        run_dir = Path(recipe.train.run_dir)
        if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
            raise SystemExit(f"orthon pretrain: {run_dir} already holds checkpoints; use --resume {run_dir} "
                             f"or another train.run_dir")
    start = time.perf_counter()
    trainer = make_trainer(recipe, run_dir)
    if trainer.rank == 0 and not args.resume:
        write_run_config(run_dir, replace(recipe, train=replace(recipe.train, run_dir=str(run_dir))))
    args.started_run_dir = str(run_dir)
    if args.resume:
        resumed = trainer.resume(args.step) if args.step is not None else trainer.resume()
        if not resumed:
            trainer.log(f"no usable checkpoint in {run_dir}; starting from step 0")
        if args.skip_batches:
            trainer.skip_batches(args.skip_batches)
    result = trainer.fit()
    if trainer.rank == 0:
        print(f"done: step {result['step']}, {result['tokens']:,} tokens, train loss {result.get('loss', float('nan')):.4f}, "
              f"{held_out(result['final_eval_loss'])}, "
              f"{time.perf_counter() - start:.0f}s; run directory {run_dir}")
        if args.sample and recipe.data.tokenizer and (run_dir / "final").is_dir():
            from orthon.launch.cmd_generate import sample_text

            text = sample_text(run_dir, args.sample, max_new_tokens=120, temperature=0.8, seed=0)
            print(f"--- sample ({args.sample!r}) ---\n{text}\n---")
    return 0
