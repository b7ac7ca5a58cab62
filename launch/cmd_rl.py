"""`orthon rl -c configs/rl_tiny.yaml --from RUN_DIR`: GRPO + IcePop on a verifiable task, starting from a
pretraining run's final weights (RUN_DIR/final) and tokenizer; `--resume` continues an RL run."""
from __future__ import annotations

from pathlib import Path

from orthon.launch.args import add_recipe_args
from orthon.pretrain.recipe import load_recipe
from orthon.rl.recipe import load_rl_recipe


def register(parser, name):
    add_recipe_args(parser)
    parser.add_argument("--from", dest="source", help="pretraining run directory (its final/ weights and tokenizer)")
    parser.add_argument("--resume", action="store_true", help="continue rl.run_dir from its last good checkpoint")


def resume_command(args, name) -> str | None:
    """What to type after Ctrl-C (cli.py prints it)."""
    import shlex

    if not getattr(args, "started", False):
        return None
    words = ["orthon", "rl"] + (["-c", args.config] if args.config else []) + list(args.overrides) + ["--resume"]
    return "resume with: " + " ".join(shlex.quote(str(w)) for w in words)


def run(args, name):
    import yaml

    from orthon.data.tokenizer import load_tokenizer
    from orthon.core.config import to_dict
    from orthon.rl.trainer import RLTrainer

    recipe = load_rl_recipe(args.config, args.overrides)
    cfg = recipe.rl
    run_dir = Path(cfg.run_dir)
    source = Path(args.source) if args.source else None
    if source is None:
        if not (run_dir / "source.txt").is_file():
            raise SystemExit("orthon rl: give --from PRETRAIN_RUN_DIR")
        source = Path((run_dir / "source.txt").read_text().strip())
    pre = load_recipe(source / "config.yaml")
    if not pre.data.tokenizer:
        raise SystemExit(f"orthon rl: {source}/config.yaml names no tokenizer (data.tokenizer)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "source.txt").write_text(str(source.resolve()) + "\n")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(recipe), sort_keys=False))
    trainer = RLTrainer(cfg, source / "final", load_tokenizer(pre.data.tokenizer), run_dir)
    args.started = True
    if args.resume and not trainer.resume():
        print(f"no usable RL checkpoint in {run_dir}; starting at iteration 0")
    result = trainer.fit()
    print(f"done: {result['iterations']} iterations; held-out mean reward {result['eval_start']:.3f} -> "
          f"{result['eval_end']:.3f} (best {result['eval_best']:.3f}), greedy {result['greedy_start']:.3f} -> "
          f"{result['greedy_end']:.3f}; {run_dir / 'reward.png'}")
    return 0
