"""The C allocator's handling of large freed blocks (glibc): keep them for reuse.

A step allocates and frees the same large tensors every step; above glibc's mmap threshold (adaptive, up
to 32 MiB) and past its trim threshold freed blocks go back to the kernel, so the next step's tensors land
on new pages that fault on first touch (the tiny model's Muon step 92 -> 72 ms with both raised; README,
"Memory reuse"). ``retain_freed_memory`` raises both; ``orthon`` and the benches call it unless
``ORTHON_RETAIN_FREED_MEMORY=0``. Nothing changes where the C library is not glibc or under a preloaded
jemalloc / tcmalloc.
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


def physical_memory() -> int:
    """This machine's RAM in bytes (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
