"""``orthon sandbox``: run a file in the sandbox RL uses for model-written code (orthon.rl.sandbox).

    orthon sandbox run FILE.py [--timeout S] [--memory MB] [--nproc N] [--stdin FILE] [--shell]

prints one JSON object: status (ok / error / timeout / killed), exit_code, signal, stdout, stderr,
wall_s, truncated. The exit code is 0 whenever the job ran, whatever its status; 2 when it could not
(no such file, no sandbox on this machine).
"""
from __future__ import annotations

import json
from pathlib import Path

from orthon.core.errors import OrthonError

# cli.py: no torch threads to choose (the job is a process of its own), so nothing said about busy cores.
STARTS_PROCESSES = True


def register(parser, name):
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("run", help="run a Python file (or with --shell a shell script) in a fresh sandbox")
    p.add_argument("file")
    p.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds (also the CPU-time limit)")
    p.add_argument("--memory", type=int, default=512, help="address space of each process, MB")
    p.add_argument("--nproc", type=int, default=16, help="processes and threads inside the sandbox")
    p.add_argument("--output-bytes", type=int, default=1 << 20, help="kept of stdout and of stderr each")
    p.add_argument("--stdin", help="a file fed to the job's stdin")
    p.add_argument("--shell", action="store_true", help="run FILE with /bin/sh instead of Python")


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OrthonError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None


def run(args, name):
    from orthon.rl.sandbox import SandboxLimits, run_job
    from orthon.rl.sandbox.process import Job

    try:
        source = _read(args.file, "file to run").decode()
    except UnicodeDecodeError:
        raise OrthonError(f"{args.file}: not UTF-8 text") from None
    stdin = _read(args.stdin, "stdin file") if args.stdin else b""
    limits = SandboxLimits(timeout_s=args.timeout, memory_mb=args.memory, nproc=args.nproc,
                           output_bytes=args.output_bytes)
    result = run_job(Job("shell" if args.shell else "python", source, stdin), limits)
    print(json.dumps(result.as_json()))
    return 0
