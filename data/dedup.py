"""Fuzzy deduplication with MinHash-LSH (``datasketch``), with a report of what was removed.

A document's shingles are its lower-cased word n-grams. Documents are
visited in order; a document whose MinHash estimates a Jaccard similarity of
at least ``threshold`` with an earlier kept document is removed (LSH proposes
candidates; the estimate confirms them), otherwise it is kept and indexed.
The first of a group of near-duplicates is the one that stays.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

from orthon.data.config import DedupConfig
from orthon.core.files import atomic_path, atomic_write_json
from orthon.data.sources import classify, expand_inputs, iter_records

_WORD = re.compile(r"\w+")
_BULK = 512  # documents hashed together (MinHash.bulk shares the permutations)


def shingles(text: str, ngram: int) -> set[bytes]:
    """Lower-cased word ``ngram``-grams; a document with fewer words is one shingle of all of them."""
    words = _WORD.findall(text.lower())
    if len(words) < ngram:
        return {" ".join(words).encode()} if words else {text.encode("utf-8", "replace")}
    return {" ".join(words[i : i + ngram]).encode() for i in range(len(words) - ngram + 1)}


@dataclasses.dataclass
class Removed:
    index: int  # position of the removed document in the input order
    duplicate_of: int  # position of the kept document it matched
    jaccard: float  # MinHash estimate of their Jaccard similarity


class NearDuplicateIndex:
    def __init__(self, threshold: float = 0.8, num_perm: int = 128, ngram: int = 5, seed: int = 1):
        from datasketch import MinHashLSH

        self.threshold, self.num_perm, self.ngram, self.seed = threshold, num_perm, ngram, seed
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self.kept: dict[int, object] = {}

    def minhashes(self, texts: list[str]) -> list:
        from datasketch import LeanMinHash, MinHash

        hashes = MinHash.bulk([shingles(t, self.ngram) for t in texts], num_perm=self.num_perm, seed=self.seed)
        return [LeanMinHash(m) for m in hashes]

    def check_and_add(self, index: int, minhash) -> Removed | None:
        """Removed(...) if ``minhash`` near-duplicates a kept document, else index it and return None."""
        best, best_j = None, -1.0
        for candidate in self.lsh.query(minhash):
            j = minhash.jaccard(self.kept[candidate])
            if j > best_j or (j == best_j and candidate < best):
                best, best_j = candidate, j
        if best is not None and best_j >= self.threshold:
            return Removed(index=index, duplicate_of=best, jaccard=round(float(best_j), 4))
        self.lsh.insert(index, minhash)
        self.kept[index] = minhash
        return None


def deduplicate(texts: Iterable[str], threshold: float = 0.8, num_perm: int = 128, ngram: int = 5,
                seed: int = 1) -> Iterator[tuple[int, str, Removed | None]]:
    """Yield ``(index, text, removed)`` for every input document; ``removed`` is None for kept ones."""
    index = NearDuplicateIndex(threshold, num_perm, ngram, seed)
    batch: list[str] = []
    position = 0

    def flush():
        nonlocal position
        for text, mh in zip(batch, index.minhashes(batch)):
            yield position, text, index.check_and_add(position, mh)
            position += 1
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) >= _BULK:
            yield from flush()
    if batch:
        yield from flush()


def dedup_files(cfg: DedupConfig, log=print) -> dict:
    """Read ``cfg.inputs``, write the kept documents to ``cfg.output`` (JSON lines: a JSON-lines or Parquet
    input's whole record, every field kept; {"text": ...} for plain text); an output naming a folder
    (ending in "/", or one that exists) gets ``dedup.jsonl`` inside it.

    Writes a report beside it (``OUTPUT.report.json``): counts, skipped bad
    documents, and every removed document with its source file and the kept
    document it duplicates. Both files are written atomically.
    """
    log = log or (lambda _msg: None)
    files = expand_inputs(cfg.inputs)
    origin: list[tuple[str, int]] = []  # (file, record number) of each deduplicated document
    records: dict[int, dict] = {}  # the records of documents read and not yet written or dropped
    skipped: dict[str, int] = {}

    def texts():
        for path in files:
            for record_no, (text, record) in enumerate(iter_records(path, cfg.read)):
                reason = classify(text)
                if reason:
                    skipped[reason] = skipped.get(reason, 0) + 1
                    continue
                records[len(origin)] = {"text": text} if record is None else record
                origin.append((str(path), record_no))
                yield text

    output = Path(cfg.output)
    if cfg.output.endswith(("/", os.sep)) or output.is_dir():  # a folder: the file goes inside it
        output = output / "dedup.jsonl"
    output.parent.mkdir(parents=True, exist_ok=True)
    removed: list[dict] = []
    kept = 0
    with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for i, text, dup in deduplicate(texts(), cfg.threshold, cfg.num_perm, cfg.ngram, cfg.seed):
            record = records.pop(i)
            if dup is None:
                # Parquet may hold what JSON has no type for (dates, bytes): written as their str().
                out.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
                kept += 1
            else:
                (file, record), (dup_file, dup_record) = origin[i], origin[dup.duplicate_of]
                removed.append({"index": i, "file": file, "record": record, "duplicate_of": dup.duplicate_of,
                                "duplicate_of_file": dup_file, "duplicate_of_record": dup_record,
                                "jaccard": dup.jaccard})
        out.flush()
        os.fsync(out.fileno())
    report = {"output": str(output), "documents": kept + len(removed), "kept": kept, "removed": len(removed),
              "skipped": skipped, "threshold": cfg.threshold, "num_perm": cfg.num_perm, "ngram": cfg.ngram,
              "removed_documents": removed}
    atomic_write_json(output.with_name(output.name + ".report.json"), report)
    log(f"dedup: {report['documents']} documents, kept {kept}, removed {len(removed)} near-duplicates "
        f"(threshold {cfg.threshold}); report {output.name}.report.json")
    return report
