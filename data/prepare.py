"""``orthon data prepare``: tokenise source files in parallel into a token store.

The main process streams documents from each input file, skips and counts
bad ones (see ``sources.classify``), and hands batches to a pool of worker
processes that run the quality filters and the tokenizer; results come back
in order and are appended to the current shard. Input order is kept.

Resumable: each input file is cut into parts of about ``shard_mb`` MB of
text (the cut depends only on the file's content), and each part becomes one
shard. A finished shard is renamed into place and then recorded in
``manifest.json`` (itself replaced atomically); a rerun with the same
settings reads past recorded parts without tokenising them. A crash leaves at
most ``*.tmp`` files, which the rerun deletes: nothing half-written ever
carries a final name, and only the manifest says what is finished.

Worker processes are spawned (not forked), so a script that calls
``prepare`` with ``workers > 1`` needs Python's usual
``if __name__ == "__main__":`` guard around its top-level code.
"""
from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from orthon.data.config import FilterConfig, PrepareConfig
from orthon.core.errors import DataError
from orthon.core.files import TMP_SUFFIX, atomic_write_json, sha256_file
from orthon.data.filters import FilterChain
from orthon.data.sources import classify, expand_inputs, iter_documents
from orthon.data.store import MANIFEST, ShardWriter, token_dtype
from orthon.data.tokenizer import load_tokenizer

REPORT = "report.json"
_BATCH_CHARS = 1 << 18  # also close a worker batch at about 256K characters (keeps workers balanced)
_AUTO_BYTES_PER_WORKER = 4 << 20
_END = object()


@dataclasses.dataclass
class PrepareReport:
    out_dir: str
    files: int = 0
    shards_written: int = 0
    shards_resumed: int = 0
    docs_read: int = 0
    docs_kept: int = 0
    tokens: int = 0
    bytes_read: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        """Input text (MB, all documents read in this run's new shards) per second of wall time."""
        return self.bytes_read / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def add(self, entry: dict) -> None:
        """Count one newly written shard (its manifest entry)."""
        self.shards_written += 1
        self.docs_read += entry["docs_read"]
        self.docs_kept += entry["n_docs"]
        self.tokens += entry["n_tokens"]
        self.bytes_read += entry["bytes_read"]
        for reason, n in entry["skipped"].items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "mb_per_s": round(self.mb_per_s, 3)}

    def table(self) -> str:
        rows = [("output", self.out_dir), ("input files", self.files),
                ("shards written / resumed", f"{self.shards_written} / {self.shards_resumed}"),
                ("documents read", self.docs_read), ("documents kept", self.docs_kept),
                ("tokens written", self.tokens), ("input MB", f"{self.bytes_read / 1e6:.2f}"),
                ("seconds", f"{self.seconds:.2f}"), ("MB/s", f"{self.mb_per_s:.2f}")]
        rows += [(f"skipped: {k}", v) for k, v in sorted(self.skipped.items())]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def prepare(cfg: PrepareConfig, log: Callable[[str], None] | None = print) -> PrepareReport:
    """Tokenise ``cfg.inputs`` into the store at ``cfg.out_dir``; returns (and writes) the report."""
    log = log or (lambda _msg: None)
    if not cfg.out_dir:
        raise DataError("out_dir: no output directory given")
    if not cfg.tokenizer:
        raise DataError("tokenizer: no tokenizer given (train one with `orthon tokenizer train`)")
    files = expand_inputs(cfg.inputs)  # a missing input is an error before any work
    tokenizer = load_tokenizer(cfg.tokenizer)
    FilterChain(cfg.filters)  # a bad filter path fails here, not in a worker
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(cfg, files, tokenizer)
    manifest = _open_manifest(out, fingerprint, tokenizer, cfg.overwrite)
    for stale in out.glob(f"shard_*{TMP_SUFFIX}"):
        stale.unlink()  # left by a crashed run; the manifest never lists them
    done = {(s["file_index"], s["part"]) for s in manifest["shards"]}
    report = PrepareReport(out_dir=str(out), files=len(files))
    workers = cfg.workers or _auto_workers(files)
    start = time.perf_counter()

    def finished(part: _Part) -> None:
        entry = part.finish()
        manifest["shards"].append(entry)
        atomic_write_json(out / MANIFEST, manifest)  # only now is the shard "done" for a rerun
        report.add(entry)
        log(f"{entry['name']}: {entry['n_docs']} docs, {entry['n_tokens']} tokens from {Path(entry['file']).name}")

    with _Executor(workers, cfg.tokenizer, cfg.filters) as executor:
        pipeline = _Pipeline(executor, limit=4 * workers, on_part_done=finished)
        try:
            for file_index, path in enumerate(files):
                for part_no, records in _parts(iter_documents(path, cfg.read), int(cfg.shard_mb * 1e6)):
                    if (file_index, part_no) in done:
                        collections.deque(records, maxlen=0)
                        report.shards_resumed += 1
                        continue
                    part = _Part(out, path, file_index, part_no, tokenizer.vocab_size)
                    pipeline.feed(part, records, cfg)
            pipeline.flush()
        except BaseException:
            pipeline.abort()
            raise
    report.seconds = time.perf_counter() - start
    manifest["shards"].sort(key=lambda s: (s["file_index"], s["part"]))
    manifest["complete"] = True
    manifest["totals"] = _totals(manifest["shards"])
    atomic_write_json(out / MANIFEST, manifest)
    atomic_write_json(out / REPORT, report.as_dict())
    log(report.table())
    return report


class _Part:
    """One part of one input file on its way to becoming a shard."""

    def __init__(self, out: Path, path: Path, file_index: int, part: int, vocab_size: int):
        self.name = f"shard_{file_index:05d}_{part:05d}"
        self.meta = {"name": self.name, "file": str(path), "file_index": file_index, "part": part}
        self.writer = ShardWriter(out / self.name, vocab_size)
        self.docs_read = self.bytes_read = 0
        self.skipped: collections.Counter = collections.Counter()

    def finish(self) -> dict:
        self.writer.finish()
        w = self.writer
        return {**self.meta, "n_docs": w.n_docs, "n_tokens": w.n_tokens, "docs_read": self.docs_read,
                "bytes_read": self.bytes_read, "skipped": dict(self.skipped),
                "bin_sha256": sha256_file(w.bin_path), "idx_sha256": sha256_file(w.idx_path)}


class _Pipeline:
    """Batches in flight across part boundaries, results consumed in submission order.

    The queue holds ("batch", part, future) and ("end", part) items; a part's
    shard is finished when its "end" comes out, so the workers never wait for
    one shard to be written before the next one's batches go out.
    """

    def __init__(self, executor, limit: int, on_part_done: Callable[[_Part], None]):
        self.executor, self.limit, self.on_part_done = executor, limit, on_part_done
        self.queue: collections.deque = collections.deque()
        self.in_flight = 0
        self.open_parts: list[_Part] = []

    def feed(self, part: _Part, records, cfg: PrepareConfig) -> None:
        self.open_parts.append(part)
        while len(self.open_parts) > self.limit and self.queue:  # bounds open files too
            self._consume()
        batch: list[str] = []
        batch_chars = 0
        for text, nbytes in records:
            part.docs_read += 1
            part.bytes_read += nbytes
            reason = classify(text, cfg.min_chars, cfg.max_chars)
            if reason is not None:
                part.skipped[reason] += 1
                continue
            batch.append(text)
            batch_chars += len(text)
            if len(batch) >= cfg.batch_docs or batch_chars >= _BATCH_CHARS:
                self._submit(part, batch)
                batch, batch_chars = [], 0
        if batch:
            self._submit(part, batch)
        self.queue.append(("end", part, None))

    def _submit(self, part: _Part, batch: list[str]) -> None:
        self.queue.append(("batch", part, self.executor.submit(batch)))
        self.in_flight += 1
        while self.in_flight > self.limit:  # bounded: reading never runs far ahead of tokenising
            self._consume()

    def _consume(self) -> None:
        kind, part, future = self.queue.popleft()
        if kind == "batch":
            self.in_flight -= 1
            flat, lengths, rejected = future.result()
            part.writer.add_many(flat, lengths)
            part.skipped.update(rejected)
        else:
            self.on_part_done(part)
            self.open_parts.remove(part)

    def flush(self) -> None:
        while self.queue:
            self._consume()

    def abort(self) -> None:
        """Remove the temporary files of every unfinished shard."""
        for part in self.open_parts:
            part.writer.abort()
        self.open_parts.clear()


def _parts(records: Iterator[object], shard_bytes: int) -> Iterator[tuple[int, Iterator[tuple[object, int]]]]:
    """Cut a stream of records into consecutive parts of at least ``shard_bytes`` UTF-8 bytes.

    Yields ``(part, iterator of (record, nbytes))``; a part is drained before the next starts.
    """
    it = iter(records)
    pending = next(it, _END)
    part = 0
    while pending is not _END:

        def one_part():
            nonlocal pending
            total = 0
            while pending is not _END and total < shard_bytes:
                record = pending
                nbytes = len(record.encode("utf-8", "replace")) if isinstance(record, str) else 0
                total += max(nbytes, 1)
                yield record, nbytes
                pending = next(it, _END)

        records_of_part = one_part()
        yield part, records_of_part
        collections.deque(records_of_part, maxlen=0)
        part += 1


def _auto_workers(files: list[Path]) -> int:
    """One process per core, but no more than one per 4 MB of input: starting a spawned
    worker costs about a second, more than tokenising a small file takes."""
    total = sum(f.stat().st_size for f in files)
    return max(1, min(os.cpu_count() or 1, total // _AUTO_BYTES_PER_WORKER))


# --- workers -----------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(tokenizer_path: str, filters: list[FilterConfig], parent_pid: int | None) -> None:
    if parent_pid is not None:
        # Ctrl-C reaches the whole process group: the parent stops the run and reports it once; a
        # worker dying of its own KeyboardInterrupt would only add tracebacks.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER["tokenizer"] = load_tokenizer(tokenizer_path)
    _WORKER["filters"] = FilterChain(filters)
    _WORKER["dtype"] = token_dtype(_WORKER["tokenizer"].vocab_size)
    if parent_pid is not None:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()


def _exit_when_orphaned(parent_pid: int) -> None:
    # A SIGKILLed prepare cannot stop its pool; the workers notice and leave on their own.
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def _encode_batch(texts: list[str]) -> tuple[np.ndarray, np.ndarray, dict]:
    """Filter and tokenise a batch: (ids concatenated, per-document lengths, rejected counts)."""
    filters: FilterChain = _WORKER["filters"]
    rejected: collections.Counter = collections.Counter()
    kept = []
    for text in texts:
        reason = filters.reject(text) if filters else None
        if reason is None:
            kept.append(text)
        else:
            rejected[reason] += 1
    encoded = _WORKER["tokenizer"].encode_batch(kept) if kept else []
    lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
    if lengths.size and not lengths.all():
        rejected["empty_after_tokenize"] += int((lengths == 0).sum())
        lengths = lengths[lengths > 0]
    dtype = _WORKER["dtype"]
    pieces = [np.asarray(ids, dtype=dtype) for ids in encoded if ids]
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    return flat, lengths, dict(rejected)


class _Executor:
    """A spawn-started process pool (or, with one worker, this process) running ``_encode_batch``.

    concurrent.futures rather than multiprocessing.Pool: a worker that dies (killed, out of
    memory) fails the run with BrokenProcessPool instead of leaving it waiting forever.
    """

    def __init__(self, workers: int, tokenizer_path: str, filters: list[FilterConfig]):
        self.workers = workers
        self.args = (str(tokenizer_path), list(filters))
        self.pool = None

    def __enter__(self):
        if self.workers <= 1:
            _init_worker(*self.args, None)
        else:
            # spawn, not fork: the reader (datasets, pyarrow) runs threads that fork would copy mid-state.
            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init_worker, initargs=(*self.args, os.getpid()))
        return self

    def submit(self, texts: list[str]):
        if self.pool is None:
            done = Future()
            done.set_result(_encode_batch(texts))
            return done
        return self.pool.submit(_encode_batch, texts)

    def __exit__(self, exc_type, exc, tb):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=exc_type is not None)
        return False


# --- manifest ----------------------------------------------------------------------------------


def _fingerprint(cfg: PrepareConfig, files: list[Path], tokenizer) -> dict:
    """Everything that decides the shards' contents; a rerun resumes only when it matches."""
    return {
        "files": [[str(f), f.stat().st_size] for f in files],
        "tokenizer_sha256": sha256_file(tokenizer.path),
        "read": dataclasses.asdict(cfg.read),
        "shard_mb": cfg.shard_mb,
        "min_chars": cfg.min_chars,
        "max_chars": cfg.max_chars,
        "filters": [dataclasses.asdict(f) for f in cfg.filters],
    }


def _open_manifest(out: Path, fingerprint: dict, tokenizer, overwrite: bool) -> dict:
    path = out / MANIFEST
    if path.is_file() and not overwrite:
        from orthon.data.store import read_manifest

        manifest = read_manifest(out)
        if manifest.get("fingerprint") == fingerprint:
            return manifest
        old = manifest.get("fingerprint", {})
        differ = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
        raise DataError(
            f"{out}: holds a store prepared with other settings ({', '.join(differ)} differ); "
            "use another output directory or --overwrite"
        )
    for stale in list(out.glob("shard_*")) + [path, out / REPORT]:
        stale.unlink(missing_ok=True)
    manifest = {"version": 1, "complete": False, "fingerprint": fingerprint, "tokenizer": tokenizer.describe(),
                "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id,
                "dtype": token_dtype(tokenizer.vocab_size).name, "shards": []}
    # Written before any work: a run that dies before its first shard leaves a store that says it is
    # incomplete (and how to finish it), not a directory that is no store at all.
    atomic_write_json(path, manifest)
    return manifest


def _totals(shards: list[dict]) -> dict:
    skipped: collections.Counter = collections.Counter()
    for s in shards:
        skipped.update(s["skipped"])
    return {"n_docs": sum(s["n_docs"] for s in shards), "n_tokens": sum(s["n_tokens"] for s in shards),
            "docs_read": sum(s["docs_read"] for s in shards), "bytes_read": sum(s["bytes_read"] for s in shards),
            "skipped": dict(skipped)}
