"""The ``orthon`` command line.

Each subcommand lives in its own module with ``register(parser)`` and
``run(args) -> int``; this file only maps names to modules, imported lazily so
``orthon --help`` stays fast and a command's heavy imports cost only its users.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from orthon.core.errors import ConfigError

COMMANDS = {
    "model-info": ("orthon.launch.cmd_model_info", "parameter counts per component (meta device)"),
    "export": ("orthon.launch.cmd_hf", "copy a run's weights (HF glm_moe_dsa layout) cast / re-sharded for publishing"),
    "import": ("orthon.launch.cmd_hf", "check an HF glm_moe_dsa directory and write it as an orthon weights directory"),
    "smoke": ("orthon.launch.cmd_smoke", "build the model of a recipe, train a few steps, print the loss"),
    "pretrain": ("orthon.launch.cmd_pretrain", "pretrain (or --resume) a model; the built-in corpus by default"),
    "generate": ("orthon.launch.cmd_generate", "sample text from a run's final model"),
    "ablate": ("orthon.launch.cmd_ablate", "optimizer ablation: AdamW vs Muon vs Muon + Split on one recipe"),
    "midtrain": ("orthon.launch.cmd_midtrain", "long-context mid-training + DSA adaptation (--from a pretraining run); --eval: passkey heat map, perplexity by position"),
    "rl": ("orthon.launch.cmd_rl", "GRPO + IcePop from a pretraining run (--from RUN_DIR)"),
    "optim-plan": ("orthon.launch.cmd_optim_plan", "which optimizer updates each parameter, with Muon Split blocks and totals"),
    "data": ("orthon.launch.cmd_data", "tokenise text into token stores, build the built-in corpus, dedup, inspect"),
    "tokenizer": ("orthon.launch.cmd_tokenizer", "train a sentencepiece tokenizer; encode text"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="orthon", description="GLM-5-style LLM training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"orthon {name}", description=COMMANDS[name][1])
    module.register(cmd_parser, name)
    args = cmd_parser.parse_args(argv[1:])
    try:
        code = int(module.run(args, name) or 0)
    except ConfigError as exc:
        print(f"orthon {name}: config error: {exc}", file=sys.stderr)
        return 2
    if "torch.distributed" in sys.modules:  # only a command that may have started a process group
        from orthon.core.distributed import shutdown

        shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
