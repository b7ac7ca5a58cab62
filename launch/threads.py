"""How many intra-op threads a command runs with: ``orthon --threads N``, else OMP_NUM_THREADS, else the
cores idle when it starts (an OpenMP thread on a core another process keeps busy stalls every parallel
region: on the 2-core machines here, 2 threads beside one busy process ran 1.2-25x slower than 1)."""
from __future__ import annotations

import os
import sys


def pop_threads(argv: list[str]) -> tuple[int | None, list[str]]:
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


def set_threads(requested: int | None) -> None:
    n, why, reduced = pick_threads(requested)
    if reduced and os.environ.get("RANK", "0") == "0":
        print(f"orthon: {n} CPU thread{'s' if n > 1 else ''} ({why}; other processes keep the rest busy); "
              f"--threads N or OMP_NUM_THREADS=N chooses", file=sys.stderr)
    # Worker processes (data preparation) and libraries that read the variable see the same number.
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    import torch

    torch.set_num_threads(n)
