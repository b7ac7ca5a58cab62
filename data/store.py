"""The memory-mapped token store.

A shard is two files with one prefix:

- ``PREFIX.bin``: every document's token ids back to back, uint16 when the
  vocabulary has fewer than 65536 entries, else uint32;
- ``PREFIX.idx``: a 40-byte header (magic, version, item size, vocab size,
  document count, token count) and the int64 offsets of the document
  boundaries (n_docs + 1 of them, from 0 to n_tokens).

A store is a directory of shards listed in order by ``manifest.json`` (what
``orthon data prepare`` writes), or a single shard opened by its prefix. Opening
checks that every index matches its .bin (sizes, offsets, counts) and names the
file and the mismatch otherwise. Shards are written under temporary names and
renamed into place when complete.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from orthon.core.errors import DataError
from orthon.core.files import tmp_path

MAGIC = b"ORTHTOK1"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQ")
MANIFEST = "manifest.json"


class StoreError(DataError):
    """A store whose files are missing, truncated or inconsistent."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab < 65536), else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < 2**16 else np.dtype(np.uint32)


class ShardWriter:
    """Append documents to a shard; ``finish`` renames it into place, ``abort`` (or an exception
    inside ``with``) removes the temporary files, so no half-written shard gets a final name."""

    def __init__(self, prefix: str | Path, vocab_size: int):
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self.dtype = token_dtype(vocab_size)
        self.bin_path, self.idx_path = self.prefix.with_suffix(".bin"), self.prefix.with_suffix(".idx")
        self._bin_tmp, self._idx_tmp = tmp_path(self.bin_path), tmp_path(self.idx_path)
        self._file = open(self._bin_tmp, "wb")
        self._lengths: list[np.ndarray] = []
        self.n_tokens = 0
        self.n_docs = 0

    def add(self, ids) -> None:
        """One document."""
        ids = np.asarray(ids)
        self.add_many(ids, np.array([ids.size], dtype=np.int64))

    def add_many(self, flat, lengths) -> None:
        """Several documents: their ids concatenated in ``flat``, their sizes in ``lengths``."""
        flat = np.asarray(flat)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != flat.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {flat.size} ids were given")
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}) for {self.prefix}")
        self._file.write(flat.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(lengths)
        self.n_tokens += flat.size
        self.n_docs += lengths.size

    def finish(self) -> tuple[Path, Path]:
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.vocab_size, self.n_docs, self.n_tokens))
            f.write(offsets.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)
        return self.bin_path, self.idx_path

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        for path in (self._bin_tmp, self._idx_tmp):
            path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        elif not self._file.closed:
            self.finish()
        return False


def write_shard(prefix: str | Path, docs, vocab_size: int) -> tuple[Path, Path]:
    """Write an iterable of token-id sequences as one shard."""
    with ShardWriter(prefix, vocab_size) as writer:
        for doc in docs:
            writer.add(doc)
    return writer.bin_path, writer.idx_path


class Shard:
    """One validated (.bin, .idx) pair, memory-mapped read-only."""

    def __init__(self, prefix: str | Path):
        prefix = Path(prefix)
        self.bin_path, self.idx_path = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise StoreError(f"{path}: missing (a store shard needs both .bin and .idx)")
        idx_size = self.idx_path.stat().st_size
        if idx_size < _HEADER.size:
            raise StoreError(f"{self.idx_path}: {idx_size} bytes, shorter than the {_HEADER.size}-byte header")
        with open(self.idx_path, "rb") as f:
            magic, version, itemsize, vocab, n_docs, n_tokens = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise StoreError(f"{self.idx_path}: not an orthon token index (magic {magic!r})")
        if version != VERSION:
            raise StoreError(f"{self.idx_path}: index version {version}, this orthon reads {VERSION}")
        if itemsize != token_dtype(vocab).itemsize:
            raise StoreError(f"{self.idx_path}: item size {itemsize} does not fit vocab size {vocab}")
        want_idx = _HEADER.size + 8 * (n_docs + 1)
        if idx_size != want_idx:
            raise StoreError(f"{self.idx_path}: {idx_size} bytes, but {n_docs} documents need {want_idx}")
        bin_size = self.bin_path.stat().st_size
        if bin_size != n_tokens * itemsize:
            raise StoreError(
                f"{self.bin_path}: {bin_size} bytes, but its index records {n_tokens} tokens of "
                f"{itemsize} bytes ({n_tokens * itemsize} bytes): the index does not match the .bin"
            )
        offsets = np.fromfile(self.idx_path, dtype=np.int64, offset=_HEADER.size)
        if offsets[0] != 0 or offsets[-1] != n_tokens or (n_docs and np.any(np.diff(offsets) < 0)):
            raise StoreError(f"{self.idx_path}: document offsets are not 0 <= ... <= {n_tokens} in order")
        self.vocab_size, self.n_docs, self.n_tokens = int(vocab), int(n_docs), int(n_tokens)
        self.dtype = token_dtype(vocab)
        self.offsets = offsets
        # np.memmap refuses an empty file; an empty shard has no tokens to map.
        self.tokens = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r") if n_tokens else np.zeros(0, self.dtype)
        )

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


class TokenStore:
    """Documents of one or more shards, in order, as one sequence of documents.

    ``offsets`` (n_docs + 1, int64) are global document boundaries in the
    concatenated token space; ``read(start, stop)`` reads any token range.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        self.meta: dict = {}
        if path.is_dir():
            self.meta = read_manifest(path)
            if not self.meta.get("complete"):
                done = len(self.meta.get("shards", []))
                raise StoreError(
                    f"{path}: store is incomplete ({done} shards finished); rerun `orthon data prepare` to finish it"
                )
            self.shards = [Shard(path / s["name"]) for s in self.meta["shards"]]
            for shard, entry in zip(self.shards, self.meta["shards"]):
                if (shard.n_docs, shard.n_tokens) != (entry["n_docs"], entry["n_tokens"]):
                    raise StoreError(
                        f"{shard.idx_path}: holds {shard.n_docs} docs / {shard.n_tokens} tokens, the manifest "
                        f"records {entry['n_docs']} / {entry['n_tokens']}"
                    )
        elif path.with_suffix(".idx").is_file() or path.with_suffix(".bin").is_file():
            self.shards = [Shard(path)]
        else:
            raise StoreError(f"{path}: no token store here (neither a directory with {MANIFEST} nor a .bin/.idx prefix)")
        vocabs = {s.vocab_size for s in self.shards}
        if len(vocabs) > 1:
            raise StoreError(f"{path}: shards disagree on vocab size {sorted(vocabs)}")
        self.vocab_size = vocabs.pop() if vocabs else int(self.meta.get("vocab_size", 0))
        self.eos_id = self.meta.get("eos_id")
        self._token_starts = np.cumsum([0] + [s.n_tokens for s in self.shards])
        parts = [np.zeros(1, np.int64)]
        for start, shard in zip(self._token_starts, self.shards):
            parts.append(shard.offsets[1:] + start)
        self.offsets = np.concatenate(parts)
        self.n_docs = len(self.offsets) - 1
        self.n_tokens = int(self._token_starts[-1])

    def __len__(self) -> int:
        return self.n_docs

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n_docs:
            raise IndexError(f"document {i} out of range [0, {self.n_docs})")
        return self.read(int(self.offsets[i]), int(self.offsets[i + 1]))

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated documents (crossing shards as needed)."""
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(f"token range [{start}, {stop}) out of [0, {self.n_tokens}]")
        first = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            shard_start = int(self._token_starts[first])
            shard = self.shards[first]
            take = min(stop, shard_start + shard.n_tokens)
            pieces.append(shard.tokens[start - shard_start : take - shard_start])
            start = take
            first += 1
        if not pieces:
            return np.zeros(0, self.shards[0].dtype if self.shards else np.uint16)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __iter__(self):
        for shard in self.shards:
            for i in range(shard.n_docs):
                yield shard.doc(i)


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise StoreError(f"{directory}: no {MANIFEST} (not a prepared store)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StoreError(f"{path}: not valid JSON: {exc}") from None


def stores_tokenizer(directories, configured: str = "") -> str:
    """The tokenizer to train on the prepared stores in ``directories`` with: ``configured`` (a recipe's
    data.tokenizer) where given, else the file their manifests record, where every store names the same one
    and it still holds the contents they were tokenised with; "" when there is none to name (stores
    without a manifest, stores that disagree, a file since moved or changed). A configured tokenizer whose
    contents differ from what a store was tokenised with is refused: its ids would not be the store's."""
    from orthon.core.files import sha256_file

    directories = [str(d) for d in directories]
    recorded = {}
    for directory in directories:
        try:
            manifest = read_manifest(directory)
        except StoreError:
            continue  # a bare .bin/.idx store records no tokenizer
        path = (manifest.get("tokenizer") or {}).get("path")
        digest = (manifest.get("fingerprint") or {}).get("tokenizer_sha256")
        if path and digest:
            recorded[directory] = (path, digest)
    if configured:
        if recorded and Path(configured).is_file():
            digest = sha256_file(configured)
            for directory, (path, wanted) in recorded.items():
                if digest != wanted:
                    raise DataError(f"data.tokenizer: {configured} is not the tokenizer the store {directory} was "
                                    f"prepared with ({path}, by content): the ids would not match")
        return configured
    named = set(recorded.values())
    if len(named) != 1 or len(recorded) != len(directories):
        return ""
    path, digest = named.pop()
    return path if Path(path).is_file() and sha256_file(path) == digest else ""
