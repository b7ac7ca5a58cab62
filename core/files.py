"""Atomic file writes.

Every file orthon produces is written under a temporary name and renamed
into place, so a crash never leaves a half-written file under a final name.
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


TMP_SUFFIX = ".tmp"


def tmp_path(path: str | Path) -> Path:
    """The temporary name ``path`` is written under before the rename: this process's own, so that two
    processes writing the same file (the ranks of a torchrun job, say) never rename each other's."""
    path = Path(path)
    return path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = tmp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """For a file another library writes (safetensors, matplotlib, a streamed jsonl): yields the
    temporary name to write; renamed into place when the block ends, removed if it raises."""
    path = Path(path)
    tmp = tmp_path(path)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


@contextmanager
def exclusive(path: str | Path) -> Iterator[None]:
    """One process at a time in the block, across processes of this machine (an advisory lock on the file
    ``path``, created if absent): the others wait at the door. The lock goes with the process, so a
    crashed holder never blocks the next."""
    import fcntl

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
