"""The ``orthon`` command line.

Each subcommand lives in its own module with ``register(parser)`` and
``run(args) -> int``; this file only maps names to modules, imported lazily so
``orthon --help`` stays fast and a command's heavy imports cost only its users.

What reaches this file is turned into one line, never a traceback: an OrthonError (a bad recipe, a
damaged checkpoint, a missing run) is ``orthon CMD: message`` and exit code 2; Ctrl-C is
``orthon CMD: interrupted ...`` with the command that resumes the work, if the command has one
(a module's ``resume_command(args)``), and exit code 130; a stop signal (SIGTERM: preemption, a time
limit) is ``orthon CMD: stopped by SIGTERM after step N, checkpoint saved; resume with ...`` and exit
code 128 + the signal's number (143).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from orthon.core.allocator import retain_freed_memory
from orthon.core.errors import ConfigError, OrthonError
from orthon.core.interrupts import StopRequested
from orthon.launch.threads import pop_threads, set_threads

COMMANDS = {
    "model-info": ("orthon.launch.cmd_model_info", "parameter counts per component (meta device)"),
    "export": ("orthon.launch.cmd_hf", "copy a run's weights (HF glm_moe_dsa layout) and tokenizer, cast / re-sharded for publishing"),
    "import": ("orthon.launch.cmd_hf", "check an HF glm_moe_dsa directory and write it as an orthon weights directory"),
    "smoke": ("orthon.launch.cmd_smoke", "build the model of a recipe, train a few steps, print the loss"),
    "pretrain": ("orthon.launch.cmd_pretrain", "pretrain (or --resume) a model; the built-in corpus by default"),
    "generate": ("orthon.launch.cmd_generate", "sample text from a run's final model or a weights directory"),
    "ablate": ("orthon.launch.cmd_ablate", "optimizer ablation: AdamW vs Muon vs Muon + Split on one recipe"),
    "midtrain": ("orthon.launch.cmd_midtrain", "long-context mid-training + DSA adaptation (--from a pretraining run); --eval: passkey heat map, perplexity by position"),
    "rl": ("orthon.launch.cmd_rl", "GRPO + IcePop from a pretraining run (--from RUN_DIR)"),
    "serve": ("orthon.launch.cmd_serve", "serve a weights directory over SGLang's HTTP API and OpenAI's (continuous batching, streams)"),
    "distill": ("orthon.launch.cmd_rl", "on-policy distillation from rl.opd.teachers (--from RUN_DIR)"),
    "posttrain": ("orthon.launch.cmd_posttrain", "SFT -> reasoning RL -> agentic RL -> general RL -> OPD as one plan"),
    "optim-plan": ("orthon.launch.cmd_optim_plan", "which optimizer updates each parameter, with Muon Split blocks and totals"),
    "data": ("orthon.launch.cmd_data", "tokenise text into token stores, build the built-in corpus, dedup, inspect"),
    "tokenizer": ("orthon.launch.cmd_tokenizer", "train a sentencepiece tokenizer; encode text"),
    "sandbox": ("orthon.launch.cmd_sandbox", "run a file in the sandbox for model-written code; prints one JSON object"),
    "launch": ("orthon.launch.cmd_launch", "the msrun / torchrun / sbatch / Ray command lines that start a command on many processes (--run starts them)"),
}

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def _rank0() -> bool:
    return os.environ.get("RANK", os.environ.get("RANK_ID", "0")) == "0"  # torchrun's, msrun's


def _quiet_interrupts() -> None:
    """After Ctrl-C: no second traceback from a second Ctrl-C, and none from threads at exit."""
    import signal

    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):
        pass


def _close_progress_bars() -> None:
    """End a progress bar's line, so the interrupt message starts a line of its own."""
    if "tqdm" not in sys.modules:
        return
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        try:
            bar.close()
        except Exception:  # a bar half torn down by the interrupt: its line is not worth a traceback
            pass


def _say_stopped(module, args, name: str, what: str) -> None:
    """``orthon NAME: WHAT; resume with ...`` on rank 0, on a line of its own (the command's
    ``resume_command``, if it has one, says how to continue)."""
    _close_progress_bars()
    if _rank0():
        hint = getattr(module, "resume_command", lambda *_: None)(args, name)
        print(f"orthon {name}: {what}" + (f"; {hint}" if hint else ""), file=sys.stderr)


def parse_command_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """A command's arguments; overrides may come before and after options
    (``orthon rl --resume a.b=1 -c rl.yaml c.d=2``), except for commands with sub-commands."""
    try:
        return parser.parse_intermixed_args(argv)
    except TypeError:  # argparse cannot intermix a parser with sub-commands
        return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    retain_freed_memory()  # before the first large tensor: see orthon.core.allocator
    argv = sys.argv[1:] if argv is None else argv
    threads, argv = pop_threads(list(argv))
    parser = argparse.ArgumentParser(prog="orthon", description="GLM-5-style LLM training.",
                                     epilog="orthon --threads N COMMAND ... sets the CPU threads (default: "
                                            "OMP_NUM_THREADS, else the idle cores).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    if os.environ.get("MS_ROLE") == "MS_SCHED":  # msrun's scheduler process: the rendezvous, not the command
        from orthon.backends.mindspore.distributed import run_scheduler

        return run_scheduler()
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"orthon {name}", description=COMMANDS[name][1])
    module.register(cmd_parser, name)
    args = parse_command_args(cmd_parser, argv[1:])
    try:
        if getattr(module, "STARTS_PROCESSES", False):
            # A launcher's processes choose their own threads; --threads reaches them through the environment.
            if threads:
                os.environ["OMP_NUM_THREADS"] = str(threads)
        else:
            set_threads(threads)
        code = int(module.run(args, name) or 0)
    except KeyboardInterrupt:
        _quiet_interrupts()
        _say_stopped(module, args, name, "interrupted")
        return INTERRUPTED
    except StopRequested as stop:
        _say_stopped(module, args, name, str(stop))
        _shutdown()  # every rank stops after the same step, so they meet in the teardown
        return stop.exit_code
    except ConfigError as exc:
        print(f"orthon {name}: config error: {exc}", file=sys.stderr)
        return 2
    except OrthonError as exc:
        print(f"orthon {name}: {exc}", file=sys.stderr)
        return 2
    _shutdown()
    return code


def _shutdown() -> None:
    """The process group torn down before the interpreter's exit (``orthon.core.distributed.shutdown``:
    without it gloo's threads can abort the exit, and a run that stopped cleanly dies of SIGABRT)."""
    if "torch.distributed" in sys.modules:  # only a command that may have started a process group
        from orthon.core.distributed import shutdown

        shutdown()


if __name__ == "__main__":
    sys.exit(main())
