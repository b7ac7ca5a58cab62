"""The ``orthon`` command line.

Each subcommand lives in its own module with ``register(parser)`` and
``run(args) -> int``; this file only maps names to modules, imported lazily so
``orthon --help`` stays fast and a command's heavy imports cost only its users.

What reaches this file is turned into one line, never a traceback: an OrthonError (a bad recipe, a
damaged checkpoint, a missing run) is ``orthon CMD: message`` and exit code 2; Ctrl-C is
``orthon CMD: interrupted ...`` with the command that resumes the work, if the command has one
(a module's ``resume_command(args)``), and exit code 130.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from orthon.core.errors import ConfigError, OrthonError

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

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def _pop_threads(argv: list[str]) -> tuple[int | None, list[str]]:
    """``--threads N`` / ``--threads=N`` before the command name."""
    if argv and argv[0].startswith("--threads"):
        if argv[0].startswith("--threads="):
            value, rest = argv[0].split("=", 1)[1], argv[1:]
        elif len(argv) > 1:
            value, rest = argv[1], argv[2:]
        else:
            raise SystemExit("orthon: --threads needs a number")
        if not value.isdigit() or int(value) < 1:
            raise SystemExit(f"orthon: --threads {value!r}: expected a positive integer")
        return int(value), rest
    return None, argv


def _cpu_times(cpus) -> dict[int, tuple[int, int]] | None:
    """{cpu: (idle, total)} jiffies from /proc/stat for ``cpus``; None where it cannot be read."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            numbers = [int(v) for v in values[:8]]
            out[int(name[3:])] = (numbers[3] + numbers[4], sum(numbers))  # idle + iowait, all
    return out if len(out) == len(cpus) else None


def idle_cores(interval: float = 0.2) -> tuple[int, float | None]:
    """(cores this process may run on, how many of them sat idle over ``interval`` seconds), measured on
    exactly those cores (/proc/stat; other processes of the machine count, containers included).
    None where the kernel does not say (then the load average stands in)."""
    import time

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    if len(cpus) == 1:
        return 1, 1.0
    before = _cpu_times(cpus)
    if before is None:
        try:
            return len(cpus), max(0.0, len(cpus) - os.getloadavg()[0])
        except (AttributeError, OSError):
            return len(cpus), None
    time.sleep(interval)
    after = _cpu_times(cpus)
    idle = 0.0
    for cpu in cpus:
        d_idle, d_total = after[cpu][0] - before[cpu][0], after[cpu][1] - before[cpu][1]
        idle += d_idle / d_total if d_total > 0 else 1.0
    return len(cpus), idle


def pick_threads(requested: int | None = None, environ=os.environ, measure=idle_cores) -> tuple[int, str, bool]:
    """(intra-op threads, why, whether busy cores were left out). ``--threads`` wins, then OMP_NUM_THREADS; otherwise the cores that are idle
    now (a core counts when at least 70% of it is free). An OpenMP thread on a core another process keeps
    busy makes every parallel region wait for it: on the 2-core machine here, 2 threads beside one busy
    process ran the tiny model's steps 1.2-25x slower than 1 thread (README, "Busy machines")."""
    if requested:
        return requested, "--threads", False
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS", False
    cores, idle = measure()
    if idle is None:
        return cores, f"{cores} cores", False
    n = max(1, min(cores, int(idle + 0.3)))
    return n, f"{idle:.1f} of {cores} cores idle", n < cores


def _set_threads(requested: int | None) -> None:
    n, why, reduced = pick_threads(requested)
    if reduced and _rank0():
        print(f"orthon: {n} CPU thread{'s' if n > 1 else ''} ({why}; other processes keep the rest busy); "
              f"--threads N or OMP_NUM_THREADS=N chooses", file=sys.stderr)
    # Worker processes (data preparation) and libraries that read the variable see the same number.
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    import torch

    torch.set_num_threads(n)


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    threads, argv = _pop_threads(list(argv))
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
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"orthon {name}", description=COMMANDS[name][1])
    module.register(cmd_parser, name)
    args = cmd_parser.parse_args(argv[1:])
    try:
        _set_threads(threads)
        code = int(module.run(args, name) or 0)
    except KeyboardInterrupt:
        _quiet_interrupts()
        _close_progress_bars()
        if _rank0():
            hint = getattr(module, "resume_command", lambda *_: None)(args, name)
            print(f"orthon {name}: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return INTERRUPTED
    except ConfigError as exc:
        print(f"orthon {name}: config error: {exc}", file=sys.stderr)
        return 2
    except OrthonError as exc:
        print(f"orthon {name}: {exc}", file=sys.stderr)
        return 2
    if "torch.distributed" in sys.modules:  # only a command that may have started a process group
        from orthon.core.distributed import shutdown

        shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
