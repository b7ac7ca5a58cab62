"""The sandbox against its hostile corpus (orthon.rl.sandbox.hostile): the table of snippet, status and wall
time, after the harmless probes that show the limits hold (the fork bomb and the 10 GB allocation run
only if they do). Each snippet also gets the host-side check that goes with it: the host's listener on
127.0.0.1 saw no connection, no process the snippet left carries its marker, nothing was written outside.

    python bench/sandbox_hostile.py [--pool]
"""
from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

from orthon.rl.sandbox import SandboxPool, sandbox_problem  # noqa: E402
from orthon.rl.sandbox.hostile import check_limits, corpus_limits, processes_with, run_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", action="store_true", help="run each snippet in a warm sandbox from a pool")
    args = parser.parse_args()
    problem = sandbox_problem()
    if problem:
        sys.exit(f"sandbox_hostile: {problem}")
    pool = SandboxPool(2) if args.pool else None
    marker = f"{random.randint(100000, 999999)}.{os.getpid()}"
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    context = {"port": listener.getsockname()[1], "marker": marker, "project_file": str(ROOT / "README.md")}
    print(f"CPU: {cpu_kind()}; {'warm sandboxes (pool of 2)' if pool else 'a cold sandbox per snippet'}")

    problems = check_limits(marker, pool)
    print("probes:", "all limits hold" if not problems else "; ".join(problems))
    start = time.perf_counter()
    rows = run_corpus(context, pool, limits_checked=not problems)
    total = time.perf_counter() - start
    time.sleep(0.2)  # the namespaces' last processes end asynchronously after bwrap
    try:
        listener.accept()
        reached = True
    except BlockingIOError:
        reached = False
    leftovers = processes_with(marker)
    escaped = os.path.exists(f"/usr/orthon_escape_{marker}")
    if pool:
        pool.close()

    print("\n| snippet | status | wall s | limits |\n|---|---|---|---|")
    contained = 0
    for item, result in rows:
        if result is None:
            print(f"| {item.name} | not run (probes failed) | | |")
            continue
        lim = corpus_limits(item)
        note = f"{item.status} expected" if result.status != item.status else ""
        extra = (f" {result.signal}" if result.signal else "") + (" truncated" if result.truncated else "")
        print(f"| {item.name} | {result.status}{extra}{' (' + note + ')' if note else ''} | {result.wall_s:.2f} | "
              f"{lim.timeout_s:g} s, {lim.memory_mb} MB, {lim.nproc} procs |")
        contained += result.status == item.status
    print(f"\nhost: listener reached: {reached}; processes left with the marker: {leftovers}; "
          f"wrote outside: {escaped}; corpus took {total:.1f} s")
    report("sandbox_hostile", {"contained": contained, "snippets": len(rows), "corpus_s": round(total, 2),
                               "listener_reached": reached, "leftover_processes": len(leftovers)},
           {"contained_share": contained / len(rows)})


if __name__ == "__main__":
    main()
