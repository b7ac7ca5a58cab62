"""orthon's C kernels: a C source built on first use with the system compiler into a per-user cache
(keyed by the source's hash and flags), loaded with ctypes.

Where a library cannot be built or run (no compiler, a CPU without AVX2 / FMA, its switch set to 0)
``load()`` returns None and every caller takes its torch path: the same values up to float summation
order. The reason is kept in ``why_unavailable`` and logged once per process (a warning, or info when
the switch asked for it). The C sources hold no state: each call is a pure function of its buffers.

OpenMP: a source built with ``openmp=True`` links libgomp by its soname, so inside a process that has
imported torch it shares torch's own OpenMP runtime (the same libgomp.so.1) and thread pool; each
parallel region takes its thread count from the caller (``torch.get_num_threads()``).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable


@functools.lru_cache(maxsize=None)
def _cpuinfo(field: str) -> str:
    """The value of the first /proc/cpuinfo line naming ``field`` on x86-64; "" elsewhere or unreadable."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.split(":")[0].strip() == field), "")
    return line.partition(":")[2].strip()


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The x86-64 CPU's feature flags; empty elsewhere."""
    return frozenset(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """The x86-64 CPU's vendor id ("GenuineIntel", "AuthenticAMD"); "" elsewhere."""
    return _cpuinfo("vendor_id")


def cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    """Whether the CPU has AVX512-BF16 (VDPBF16PS: bf16 pairs multiplied and summed into fp32)."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


def build(source: Path, openmp: bool = False, text: str | None = None) -> ctypes.CDLL:
    """Compile ``source`` (once per content and flags) into ``$ORTHON_CACHE`` (default ~/.cache/orthon)
    and load it; ``text``: the source as read earlier (default: read now). Raises OSError or
    subprocess.SubprocessError when it cannot."""
    flags = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"] + (["-fopenmp"] if openmp else [])
    text = _inline_local_headers(source) if text is None else text
    digest = hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("ORTHON_CACHE", Path.home() / ".cache" / "orthon"))
    target = cache / f"{source.stem}_{digest}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, out = Path(tmp) / source.name, Path(tmp) / f"{source.stem}.so"
            src.write_text(text)
            cc = os.environ.get("CC", "cc")
            subprocess.run([cc, *flags, str(src), "-o", str(out), "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(out, target)  # atomic: a concurrent build or a crash never leaves half a library
    return ctypes.CDLL(str(target))


def _inline_local_headers(source: Path) -> str:
    """The source's text with each ``#include "name.h"`` of a header beside it replaced by that header's
    text: the build compiles one file in a scratch directory, and the cache key (the text's hash) then
    changes when a shared header does."""
    def inline(match: re.Match) -> str:
        header = source.with_name(match.group(1))
        return header.read_text() if header.is_file() else match.group(0)

    return re.sub(r'^#include "([^"/]+)"$', inline, source.read_text(), flags=re.MULTILINE)


class NativeLibrary:
    """One C source's library, built and loaded on the first ``load()``.

    switch: the environment variable that turns it off with 0; declare: sets the functions' argtypes;
    logger / what / fallback: the once-per-process message, "orthon: {what} unavailable, {why}; {fallback}".
    """

    def __init__(self, source: Path, switch: str, what: str, fallback: str, logger: logging.Logger,
                 declare: Callable[[ctypes.CDLL], None], openmp: bool = False):
        self.source, self.switch, self.what, self.fallback = source, switch, what, fallback
        self.log, self.declare, self.openmp = logger, declare, openmp
        # The source as it is when the module declaring its functions is imported: a library built later
        # from a source changed since (an upgrade under a running job) could take other arguments than
        # ``declare`` gives them, and crash. (None: unreadable; the build then says so.)
        try:
            self.text: str | None = _inline_local_headers(source)
        except OSError:
            self.text = None
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget the outcome (tests): the next ``load()`` tries again."""
        self.lib: ctypes.CDLL | None = None
        self.tried = False
        self.why_unavailable: str | None = None

    def load(self) -> ctypes.CDLL | None:
        if self.tried:  # the hot path: no lock once decided
            return self.lib
        with self._lock:
            if not self.tried:
                self.lib, self.why_unavailable = self._try_build()
                self.tried = True
                if self.why_unavailable is not None:
                    level = logging.INFO if os.environ.get(self.switch) == "0" else logging.WARNING
                    self.log.log(level, "orthon: %s unavailable, %s; %s", self.what, self.why_unavailable, self.fallback)
        return self.lib

    def _try_build(self) -> tuple[ctypes.CDLL | None, str | None]:
        if os.environ.get(self.switch, "1") == "0":
            return None, f"disabled by {self.switch}=0"
        if not cpu_has_avx2_fma():
            return None, "the CPU lacks AVX2 / FMA (or is not x86-64)"
        try:
            lib = build(self.source, self.openmp, self.text)
            self.declare(lib)
            return lib, None
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", None)
            lines = detail.decode(errors="replace").strip().splitlines() if detail else []
            detail = [line for line in lines if "error" in line][:1] or lines[-1:]
            return None, f"could not build the kernel: {exc}" + (f" ({detail[0]})" if detail else "")
