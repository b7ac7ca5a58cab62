"""Reading source files into documents through the ``datasets`` library, offline, streaming.

Formats: JSON lines (``.jsonl``/``.json``, one document per record, text in
``text_field``), Parquet (same), and plain text (cut into documents by line,
paragraph or whole file; datasets' ``sample_by``). Files are streamed, so a
large input is never loaded whole.

Undecodable bytes are replaced by U+FFFD while reading; ``classify`` then
reports such a document as ``non_utf8`` so that callers skip and count it.
(A document that legitimately contains U+FFFD is counted the same way.)

A JSON-lines file is read by pyarrow a block at a time, and one malformed line (or a field whose
type changes between records) fails the whole block; the rest of such a file is then read line by
line, and each line that does not hold a JSON object comes out as a ``Malformed`` record, which
``classify`` reports as ``malformed_json``: skipped and counted, its line number logged. A file in
which no line holds a JSON object is an error (it is not JSON lines at all).
"""
from __future__ import annotations

import glob
import json
import logging
import os
from pathlib import Path
from typing import Iterator, NamedTuple

from orthon.data.config import ReadConfig
from orthon.core.errors import DataError

# Never reach a hub: every source is a local file.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_SUFFIX_FORMAT = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
KNOWN_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".text", ".md", ".py")
REPLACEMENT_CHAR = "\ufffd"
_MALFORMED_LOGGED = 5  # line numbers logged per file; the rest are only counted

log = logging.getLogger(__name__)


class Malformed(NamedTuple):
    """A JSON-lines line that does not hold a JSON object."""
    line: int
    error: str


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named by paths, globs and directories (searched recursively for known suffixes), sorted.

    A path that does not exist, or a glob or directory with nothing in it, is an error naming it.
    """
    if not patterns:
        raise DataError("no input files given")
    files: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        if any(ch in pattern for ch in "*?["):
            matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
            if not matches:
                raise DataError(f"{pattern}: glob matches no file")
            files.extend(matches)
        elif path.is_dir():
            matches = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in KNOWN_SUFFIXES)
            if not matches:
                raise DataError(f"{path}: directory holds no {'/'.join(KNOWN_SUFFIXES)} file")
            files.extend(matches)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"{path}: no such file")
    return [f.resolve() for f in files]


def detect_format(path: str | Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    return _SUFFIX_FORMAT.get(Path(path).suffix.lower(), "text")


def iter_documents(path: str | Path, read: ReadConfig | None = None) -> Iterator[object]:
    """Yield each record's text (``str``) or, for a record without a string text field, what it held;
    a JSON-lines line without a JSON object comes out as ``Malformed``.

    Errors from the reader (an unreadable file, a .jsonl file that is not JSON lines) become a DataError
    naming the file.
    """
    return (text for text, _ in _records(path, read, exact=False))


def iter_records(path: str | Path, read: ReadConfig | None = None) -> Iterator[tuple[object, dict | None]]:
    """``iter_documents``'s texts, each with the whole record it came from: a JSON-lines line's object as
    written (read line by line: datasets' reader would give every record the file's union of fields, and
    its numbers one type), a Parquet row, None for plain text and malformed lines."""
    return _records(path, read, exact=True)


def _records(path, read: ReadConfig | None, exact: bool) -> Iterator[tuple[object, dict | None]]:
    import datasets

    # The environment variables above only count if datasets was not imported before this module;
    # without offline mode it looks hosts up even for local files.
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its reader's failures are handled here
    read = read or ReadConfig()
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    fmt = detect_format(path, read.format)
    if path.stat().st_size == 0:
        return  # an empty file holds no documents (datasets' json reader fails on it)
    files = [str(path)]
    if fmt == "jsonl":
        # The json builder decodes with `encoding_errors` only when the codec name is not the
        # literal "utf-8"; "utf8" is the same codec, so bad bytes become U+FFFD instead of failing.
        kwargs = dict(path="json", encoding="utf8", encoding_errors="replace")
    elif fmt == "parquet":
        kwargs = dict(path="parquet")
    elif fmt == "text":
        # A line document is the line without its newline; paragraphs and files keep theirs.
        kwargs = dict(path="text", sample_by=read.text_unit, encoding_errors="replace",
                      keep_linebreaks=read.text_unit != "line")
    else:
        raise DataError(f"{path}: unknown format {fmt!r}")
    field = "text" if fmt == "text" else read.text_field
    if fmt == "jsonl" and exact:
        yield from _json_lines(path, field, skip=0)
        return
    read_so_far = 0
    try:
        ds = datasets.load_dataset(data_files=files, split="train", streaming=True, **kwargs)
        for record in ds:
            yield record.get(field), None if fmt == "text" else record
            read_so_far += 1
    except DataError:
        raise
    except Exception as exc:
        if fmt != "jsonl":
            raise DataError(f"{path}: cannot read as {fmt}: {type(exc).__name__}: {exc}") from exc
        # The records yielded so far are the file's first valid ones (pyarrow fails a whole block).
        yield from _json_lines(path, field, skip=read_so_far)


def _json_lines(path: Path, field: str, skip: int) -> Iterator[tuple[object, dict | None]]:
    """The file's (text, record) pairs line by line after its first ``skip`` valid ones; a line without a
    JSON object comes out as (``Malformed``, None). Lines end at "\\n" only (U+2028 may stand inside a JSON string)."""
    valid = malformed = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            line = raw.decode("utf8", errors="replace").strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                record = Malformed(line_no, str(exc))
            if isinstance(record, dict):
                valid += 1
                if valid > skip:
                    yield record.get(field), record
                continue
            if not isinstance(record, Malformed):
                record = Malformed(line_no, f"a JSON {type(record).__name__}, not an object")
            malformed += 1
            if malformed <= _MALFORMED_LOGGED:
                log.warning("%s line %d: malformed JSON (%s); skipped and counted", path, line_no, record.error)
            yield record, None
    if valid == 0:
        raise DataError(f"{path}: not JSON lines: none of its {malformed} lines holds a JSON object")
    if malformed > _MALFORMED_LOGGED:
        log.warning("%s: %d malformed lines in all, skipped and counted", path, malformed)


def classify(text: object, min_chars: int = 1, max_chars: int | None = None) -> str | None:
    """Why a document is skipped (``malformed_json``, ``no_text``, ``empty``, ``non_utf8``, ``too_short``,
    ``too_long``), or None."""
    if isinstance(text, Malformed):
        return "malformed_json"
    if not isinstance(text, str):
        return "no_text"
    if max_chars is not None and len(text) > max_chars:
        return "too_long"
    if not text.strip():
        return "empty"
    if REPLACEMENT_CHAR in text:
        return "non_utf8"
    if len(text) < min_chars:
        return "too_short"
    return None


def iter_texts(paths: list[Path], read: ReadConfig | None = None, max_chars: int | None = None) -> Iterator[str]:
    """The usable documents of several files, skipping what ``classify`` rejects."""
    for path in paths:
        for text in iter_documents(path, read):
            if classify(text, max_chars=max_chars) is None:
                yield text
