"""orthon.core.allocator: a freed large block is reused from the heap instead of mapped afresh.

glibc's defaults serve any block above 32 MiB (the ceiling of their adaptive threshold) with a new
mmap, so every page of it faults again each time it is allocated and touched. The benchmarks show
what that costs a training step (README, "Memory reuse"); this checks the mechanism, deterministically,
on the C library's own malloc."""
import os
import platform
import subprocess
import sys

import pytest

BLOCK = 64 << 20
PAGES = BLOCK // 4096

# Allocate, touch and free a 64 MiB block: once to warm up, then the minor page faults of 5 more cycles.
SCRIPT = f"""
import ctypes, resource
from orthon.core.allocator import retain_freed_memory
threshold = retain_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
def cycle():
    block = libc.malloc({BLOCK})
    ctypes.memset(block, 1, {BLOCK})
    libc.free(ctypes.c_void_p(block))
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    cycle()
print(threshold, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def faults_per_cycle(retain: bool) -> tuple[int, float]:
    env = dict(os.environ, ORTHON_RETAIN_FREED_MEMORY="1" if retain else "0")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    threshold, faults = out.stdout.split()
    return int(threshold), float(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_a_freed_large_block_is_reused_instead_of_faulting_in_again():
    threshold, faults = faults_per_cycle(True)
    unset, default_faults = faults_per_cycle(False)
    assert unset == 0
    # glibc's defaults: every page of the block faults on every cycle.
    assert default_faults >= 0.9 * PAGES, default_faults
    if threshold < BLOCK:
        pytest.skip(f"this glibc caps the mmap threshold at {threshold >> 20} MiB, below the 64 MiB block")
    assert threshold == 1 << 30
    # Retained: the block comes back from the heap with its pages mapped (0 measured).
    assert faults < 0.01 * PAGES, faults
