"""`orthon generate RUN_DIR --prompt "def "`: sample text from a run's final model."""
from __future__ import annotations


def register(parser, name):
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)


def run(args, name):
    from pathlib import Path

    from orthon.core.errors import OrthonError

    if not Path(args.run_dir).is_dir():
        raise OrthonError(f"{args.run_dir}: no such run directory (give the train.run_dir of a finished run, "
                          f"e.g. runs/tiny after `orthon pretrain -c configs/tiny.yaml`)")
    from orthon.pretrain.generate import sample_text

    print(sample_text(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
    return 0
