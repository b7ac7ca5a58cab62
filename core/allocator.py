"""The C allocator's handling of large freed blocks (glibc): keep them for reuse.

A training step allocates and frees the same large tensors (activations, gradients, Muon's stacks)
every step. glibc's malloc serves blocks above its mmap threshold with fresh ``mmap`` calls, and gives
the top of its heap back to the kernel once more than its trim threshold lies free there; either way
the next step's tensors land on new pages, and touching each page faults. Both thresholds adapt at
run time (up to 32 MiB), so how much of this a process pays changes from run to run. Measured: the
tiny model's Muon step 92 -> 72 ms with both thresholds raised (one CPU thread); transformers' training
step at 2 x 1,024 tokens 1,911 -> 3,080 tokens/s (two threads; its attention masks and logits are
larger than 32 MiB).

``retain_freed_memory`` raises both (mmap at 1 GiB, or 32 MiB where glibc takes no more; trim at
1 GiB): freed blocks stay in the heap for the next step. The process's resident memory then stays near
its peak instead of shrinking between steps. ``orthon`` calls it at start unless ``ORTHON_RETAIN_FREED_MEMORY=0``; the
benchmarks call it too, for both sides of each comparison. It does nothing where the C library is not
glibc (the allocator behaves differently there) or where jemalloc / tcmalloc were preloaded.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap; where glibc refuses 1 GiB (some versions cap it), 32 MiB.
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
TRIM_THRESHOLD = 1 << 30


def retain_freed_memory() -> int:
    """Raise glibc's mmap and trim thresholds for this process. Returns the mmap threshold set, in bytes
    (blocks below it are reused from the heap), or 0 where nothing was changed."""
    if os.environ.get("ORTHON_RETAIN_FREED_MEMORY") == "0":
        return 0
    if platform.libc_ver()[0] != "glibc" or any(name in os.environ.get("LD_PRELOAD", "")
                                                for name in ("jemalloc", "tcmalloc")):
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return 0
    # mallopt returns 1 on success; setting either also stops glibc adapting the thresholds itself.
    threshold = next((value for value in MMAP_THRESHOLDS if libc.mallopt(M_MMAP_THRESHOLD, value)), 0)
    return threshold if threshold and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) else 0
