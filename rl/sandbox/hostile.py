"""The hostile corpus the sandbox must hold against, and the harmless probes that come first.

The machine is shared (other jobs, the test run itself), so the limits that contain a fork bomb and a
memory bomb are shown to hold with harmless probes before either runs: 200 sleeping processes under a
process limit of 32 (all but 30 refused: the namespace's init and the job itself count), an allocation
over the address-space limit refused while a small one succeeds, and a PID namespace in which the job
sees only its own processes. ``run_corpus`` refuses the bombs when a probe fails.

A snippet's source is a template: {port} (a TCP port the host listens on at 127.0.0.1), {marker}
(a unique number a left-behind process carries on its command line, for the host to look for) and
{project_file} (a file of the user's the sandbox must not read).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from orthon.rl.sandbox.limits import SandboxLimits
from orthon.rl.sandbox.pool import SandboxPool
from orthon.rl.sandbox.process import Job
from orthon.rl.sandbox.result import SandboxResult
from orthon.rl.sandbox.run import run_job

PROBE_NPROC = 32
PROBE_MEMORY_MB = 64


@dataclass(frozen=True)
class Hostile:
    name: str
    source: str
    status: str  # what the sandbox must report
    bomb: bool = False  # runs only inside limits the probes have shown to hold


CORPUS = (
    Hostile("infinite loop", "while True:\n    pass\n", "timeout"),
    Hostile("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            "timeout", bomb=True),
    Hostile("10 GB allocation", "x = bytearray(10 * 1024 ** 3)\n", "error", bomb=True),
    Hostile("read /etc/shadow", "print(open('/etc/shadow').read())\n", "error"),
    Hostile("list /root", "import os\nprint(os.listdir('/root'))\n", "error"),
    Hostile("read the project's files", "print(open({project_file!r}).read())\n", "error"),
    Hostile("write outside its directory", "open('/usr/orthon_escape_{marker}', 'w').write('x')\n", "error"),
    Hostile("socket to 127.0.0.1", "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\n",
            "error"),
    Hostile("socket to an outside address", "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)\n",
            "error"),
    Hostile("print 1 GB", "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n",
            "ok"),
    Hostile("ctypes crash", "import ctypes\nctypes.string_at(0)\n", "killed"),
    Hostile("os.kill of its parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')\n",
            "ok"),
    Hostile("sleeping child left behind", "import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nprint('left it')\n",
            "ok"),
)

# Each probe: (name, source, limits, what its stdout must be).
_NPROC_PROBE = (
    "import subprocess\nstarted = 0\nfor _ in range(200):\n    try:\n        subprocess.Popen(['sleep', '{marker}'])\n"
    "        started += 1\n    except OSError:\n        pass\nprint(started)\n"
)
_MEMORY_PROBE = (
    "small = bytearray(8 << 20)\ntry:\n    big = bytearray({big_mb} << 20)\n    print('allocated')\n"
    "except MemoryError:\n    print('refused')\n"
)
_PID_PROBE = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"


def probes(marker: str) -> list[tuple[str, str, SandboxLimits, str]]:
    return [
        ("process limit", _NPROC_PROBE.format(marker=marker), SandboxLimits(timeout_s=20, nproc=PROBE_NPROC),
         str(PROBE_NPROC - 2)),
        ("memory limit", _MEMORY_PROBE.format(big_mb=4 * PROBE_MEMORY_MB),
         SandboxLimits(timeout_s=20, memory_mb=PROBE_MEMORY_MB), "refused"),
        ("PID namespace", _PID_PROBE, SandboxLimits(timeout_s=20), "[1, 2]"),
    ]


def check_limits(marker: str, pool: SandboxPool | None = None) -> list[str]:
    """Run the harmless probes; the problems found (empty when every limit holds)."""
    problems = []
    for name, source, limits, want in probes(marker):
        result = run_job(Job("python", source), limits, pool)
        if result.status != "ok" or result.stdout.strip() != want:
            problems.append(f"{name}: expected {want!r}, got {result.status} {result.stdout.strip()[:200]!r} "
                            f"{result.stderr.strip()[-200:]!r}")
    return problems


def corpus_limits(item: Hostile) -> SandboxLimits:
    """The limits each snippet runs under: short, small, and a process limit the probe has shown to hold."""
    return SandboxLimits(timeout_s=2.0 if item.name in ("infinite loop", "fork bomb") else 10.0, memory_mb=256,
                         nproc=PROBE_NPROC, output_bytes=1 << 20)


def run_corpus(context: dict, pool: SandboxPool | None = None,
               limits_checked: bool = False) -> list[tuple[Hostile, SandboxResult | None]]:
    """Every snippet, formatted with ``context`` ({port}, {marker}, {project_file}); a bomb gets None
    instead of a result unless ``limits_checked`` (check_limits found nothing)."""
    out = []
    for item in CORPUS:
        if item.bomb and not limits_checked:
            out.append((item, None))
            continue
        out.append((item, run_job(Job("python", item.source.format(**context)), corpus_limits(item), pool)))
    return out


def processes_with(marker: str) -> list[int]:
    """Host processes (other than this one) whose command line carries ``marker``: what a job left alive."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found
