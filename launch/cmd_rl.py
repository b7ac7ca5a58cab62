"""`orthon rl -c configs/rl_tiny.yaml --from RUN_DIR`: GRPO + IcePop on a verifiable task, starting from a
pretraining run's final weights (RUN_DIR/final) and tokenizer; `--resume` continues an RL run."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from orthon.launch.args import add_recipe_args, check_rl_fits


def register(parser, name):
    add_recipe_args(parser)
    parser.add_argument("--from", dest="source", help="the run to start from (its final/ weights and tokenizer): "
                        "pretraining, mid-training, RL, distillation or a post-training stage")
    parser.add_argument("--resume", action="store_true", help="continue train.run_dir from its last good checkpoint")


def resume_command(args, name) -> str | None:
    """What to type after Ctrl-C (cli.py prints it)."""
    import shlex

    if not getattr(args, "started", False):
        return None
    words = ["orthon", name] + (["-c", args.config] if args.config else []) + list(args.overrides) + ["--resume"]
    return "resume with: " + " ".join(shlex.quote(str(w)) for w in words)


def run(args, name):
    from orthon.core.errors import ConfigError
    from orthon.core.files import atomic_write_text
    from orthon.data.tokenizer import load_tokenizer
    from orthon.pretrain.trainer import write_run_config
    from orthon.pretrain.weights import load_config, load_runtime
    from orthon.rl.recipe import load_rl_recipe, source_tokenizer
    from orthon.rl.trainer import RLTrainer, summary_line

    recipe = load_rl_recipe(args.config, args.overrides)
    if recipe.rl.cluster.enabled and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("rl.cluster.enabled: the Ray cluster runs its own trainer and engines; start it as "
                          "one process (orthon rl ...), not under torchrun (several trainer ranks: "
                          "rl.cluster.trainer_ranks)")
    if name == "distill" and (recipe.rl.opd is None or not recipe.rl.opd.teachers):
        raise ConfigError("rl.opd.teachers: orthon distill needs at least one teacher (name, weights, task)")
    run_dir = Path(recipe.train.run_dir)
    source = Path(args.source) if args.source else None
    if source is None:
        if not (run_dir / "source.txt").is_file():
            raise SystemExit(f"orthon {name}: give --from RUN_DIR (the run whose final/ weights to start from)")
        source = Path((run_dir / "source.txt").read_text().strip())
    tokenizer = recipe.data.tokenizer or source_tokenizer(source)
    policy = source / "final"
    # The policy's architecture and runtime are the source run's; the RL recipe's model section is not used.
    # The tokenizer is recorded in the run's config, so this run can be the --from of the next.
    recipe = replace(recipe, model=load_config(policy), runtime=load_runtime(policy),
                     data=replace(recipe.data, tokenizer=tokenizer), train=replace(recipe.train, init_from=str(policy)))
    cluster = recipe.rl.cluster
    check_rl_fits(recipe.model, recipe, "train with RL")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "source.txt", str(source.resolve()) + "\n")
    write_run_config(run_dir, recipe)
    args.started = True
    if cluster.enabled:  # the same loop with its parts as Ray actors (orthon.rl.cluster)
        from orthon.rl.cluster import run as run_on_ray

        result = run_on_ray(recipe, tokenizer, resume=args.resume)
    else:
        trainer = RLTrainer(recipe, load_tokenizer(tokenizer))
        if args.resume and not trainer.resume():
            trainer.log(f"no usable RL checkpoint in {run_dir}; starting at iteration 0")
        result = trainer.fit()
        if trainer.rank != 0:  # under torchrun: rank 0 says it
            return 0
    print(f"done: {summary_line(result)}; {run_dir / 'reward.png'}")
    if result.get("fleet"):  # on Ray: how the engines fared and how the weights reached them
        print("fleet: " + ", ".join(f"{name} {count}" for name, count in sorted(result["fleet"].items())))
    return 0
