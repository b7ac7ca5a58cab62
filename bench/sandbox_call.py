"""Per-call cost of the sandbox: a cold call (start bwrap + the interpreter, then run) against a warm one
(a sandbox from SandboxPool, already up), and a plain unsandboxed `python3 -I -c` subprocess as the floor.

Each call runs a trivial job (``print(1)``) and is timed end to end from the caller's side. Warm calls
are timed one at a time with the pool refilled in between (the latency a reward call sees when the
pool keeps up); the burst figure is calls per second for --burst calls back to back, where the pool's
starter must keep up with the callers (the throughput bound). The caller has torch imported, as a
trainer or a reward worker does: starting a process from a large one costs more.

    python bench/sandbox_call.py [--calls 30] [--burst 60] [--pool-size 4]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

import torch  # noqa: E402,F401  (a caller as large as the trainer)

from orthon.rl.sandbox import SandboxLimits, SandboxPool, sandbox_problem  # noqa: E402
from orthon.rl.sandbox.bwrap import find_runtime  # noqa: E402
from orthon.rl.sandbox.process import Job, SandboxProcess  # noqa: E402

JOB = Job("python", "print(1)")
LIMITS = SandboxLimits(timeout_s=30)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def checked(result) -> None:
    if result.status != "ok" or result.stdout != "1\n":
        raise SystemExit(f"sandbox_call: the job failed: {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--burst", type=int, default=60)
    parser.add_argument("--pool-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4, help="callers in the burst")
    args = parser.parse_args()
    problem = sandbox_problem()
    if problem:
        sys.exit(f"sandbox_call: {problem}")
    runtime = find_runtime()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"CPU: {cpu_kind()}; caller RSS {rss_mb:.0f} MB (torch imported); sandbox interpreter {runtime.python}; "
          f"bwrap started as {'uid %d' % runtime.run_as[0] if runtime.run_as else 'the caller'}")

    plain = [timed(lambda: subprocess.run([runtime.python, "-I", "-c", "print(1)"], capture_output=True, check=True))
             for _ in range(args.calls)]
    cold = [timed(lambda: checked(SandboxProcess(runtime).run(JOB, LIMITS))) for _ in range(args.calls)]
    warm = []
    with SandboxPool(args.pool_size, runtime) as pool:
        for _ in range(args.calls):
            if not pool.wait_ready(30):
                raise SystemExit("sandbox_call: the pool did not fill in 30 s")
            warm.append(timed(lambda: checked(pool.run(JOB, LIMITS))))
        pool.wait_ready(30)
        with ThreadPoolExecutor(args.threads) as executor:
            start = time.perf_counter()
            list(executor.map(lambda _: checked(pool.run(JOB, LIMITS)), range(args.burst)))
            burst_s = time.perf_counter() - start
        warm_share = pool.warm_calls / max(1, pool.warm_calls + pool.cold_calls)
    with ThreadPoolExecutor(args.threads) as executor:
        start = time.perf_counter()
        list(executor.map(lambda _: checked(SandboxProcess(runtime).run(JOB, LIMITS)), range(args.burst)))
        cold_burst_s = time.perf_counter() - start

    ms = {name: 1000 * statistics.median(times) for name, times in
          (("plain_subprocess", plain), ("cold", cold), ("warm", warm))}
    for name, value in ms.items():
        print(f"{name:>17}: {value:7.1f} ms a call (median of {args.calls})")
    print(f"burst of {args.burst} with {args.threads} callers: pool {args.burst / burst_s:.1f} calls/s "
          f"({100 * warm_share:.0f}% warm), cold {args.burst / cold_burst_s:.1f} calls/s")
    report("sandbox_call",
           {"plain_ms": round(ms["plain_subprocess"], 2), "cold_ms": round(ms["cold"], 2), "warm_ms": round(ms["warm"], 2),
            "pool_burst_calls_per_s": round(args.burst / burst_s, 1),
            "cold_burst_calls_per_s": round(args.burst / cold_burst_s, 1), "caller_rss_mb": round(rss_mb)},
           {"cold_over_warm": round(ms["cold"] / ms["warm"], 2), "cold_over_plain": round(ms["cold"] / ms["plain_subprocess"], 2),
            "pool_burst_over_cold_burst": round(cold_burst_s / burst_s, 2)})


if __name__ == "__main__":
    main()
