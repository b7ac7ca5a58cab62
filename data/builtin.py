"""The built-in corpus of the embedded default: nothing to download.

Two kinds of text:

- code: the Python standard library installed on this machine (its ``.py``
  files, without tests, ``site-packages`` and IDLE), one document per file,
  headed by a ``# path`` comment;
- arithmetic: generated lines such as ``Q: 37+45=? A: 82`` (``arithmetic.py``,
  the same generator the RL task uses), ``problems_per_doc`` per document;
- recall (``recall_docs`` > 0): synthetic retrieval documents made from the code
  (``recall.py``), in the styles and shares of ``recall_mix``: code windows with
  ``NAME = 48213`` lines restated later, key-value lists restated shuffled, and
  lines of words each repeated; the train split's made from train code and the
  held-out split's from held-out code.

With ``retrieval`` set (``RetrievalCorpusConfig``), the corpus is instead generated retrieval documents
over a small word vocabulary (``retrieval.py``: kinds kv, copy, haystack, and long for mid-training;
filler in the held-out split only, the passkey evaluation's haystack), and the tokenizer is that
vocabulary's fixed word tokenizer (``word_tokenizer.py``), nothing trained.

``tokenizer`` reuses a given tokenizer instead of training one, so that a run
continued from another (``train.init_from``) can add kinds to its corpus and keep
the token ids its embeddings were trained on.

``prepare_builtin(out_dir)`` does everything: writes the corpus as JSON lines
(train and a held-out split), trains a sentencepiece tokenizer on it, and
prepares one token store per kind and split. Each step is skipped on a rerun
with the same settings.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sysconfig
import time
import zlib
from pathlib import Path

from orthon.data import retrieval
from orthon.data.arithmetic import make_document
from orthon.data.config import BuiltinConfig, DataConfig, PrepareConfig, ReadConfig, RetrievalCorpusConfig, StoreSource
from orthon.core.files import atomic_path, atomic_write_json, exclusive
from orthon.data.prepare import prepare
from orthon.data.recall import make_mixed_recall_document
from orthon.data.store import read_manifest
from orthon.data.tokenizer import CHAT_TOKENS, load_tokenizer, sample_lines, train_sentencepiece
from orthon.data.word_tokenizer import write_word_tokenizer

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "ensurepip"}
_CODE_PARTS = 4  # train code files, so that prepare has parallel work from the first file on
KINDS = ("code", "arithmetic", "recall", *retrieval.STYLES, "long", "filler")
MIDTRAIN_KINDS = ("long",)  # prepared for mid-training, not in the pretraining blend by default
HAYSTACK_KIND = "filler"  # held-out only: the passkey evaluation's haystack


@dataclasses.dataclass
class BuiltinPaths:
    root: Path
    tokenizer: Path
    train_stores: dict[str, Path]  # kind -> store directory
    valid_stores: dict[str, Path]
    corpus: dict[str, list[Path]]  # "train"/"valid" -> JSON-lines files
    report: dict

    def data_config(self, seq_len: int = 256, weights: dict[str, float] | None = None, seed: int = 1234,
                    **kwargs) -> DataConfig:
        """A DataConfig blending the kinds in ``weights`` (by default every kind but MIDTRAIN_KINDS, in
        proportion to their sizes: weight = tokens); held out: the same kinds and the haystack kind."""
        tokens = self.report["tokens"]
        weights = weights or {kind: float(tokens[f"train/{kind}"]) for kind in self.train_stores
                              if kind not in MIDTRAIN_KINDS}
        return DataConfig(
            sources=[StoreSource(str(self.train_stores[k]), w, k) for k, w in weights.items()],
            valid=[StoreSource(str(p), 1.0, k) for k, p in self.valid_stores.items()
                   if k in weights or k == HAYSTACK_KIND],
            tokenizer=str(self.tokenizer), seq_len=seq_len, seed=seed, **kwargs)


def stdlib_sources(max_mb: float = 0.0) -> list[tuple[str, str]]:
    """(relative path, source) of the standard library's .py files, sorted by path, up to ``max_mb`` MB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    out, total = [], 0
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few files are in other encodings; the corpus is only UTF-8
        if not text.strip():
            continue
        out.append((path.relative_to(root).as_posix(), text))
        total += len(text.encode())
        if max_mb and total >= max_mb * 1e6:
            break
    return out


def _is_valid(key: str, fraction: float) -> bool:
    return zlib.crc32(key.encode()) % 10_000 < fraction * 10_000


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def build_corpus(out_dir: str | Path, cfg: BuiltinConfig) -> dict[str, list[Path]]:
    """Write the corpus as JSON lines under ``out_dir/{train,valid}``; returns the files by split."""
    out = Path(out_dir)
    code = stdlib_sources(cfg.max_code_mb) if cfg.include_stdlib else []
    code_train = [f"# {rel}\n{src}" for rel, src in code if not _is_valid(rel, cfg.valid_fraction)]
    code_valid = [f"# {rel}\n{src}" for rel, src in code if _is_valid(rel, cfg.valid_fraction)]
    if cfg.valid_fraction and not code_valid and len(code_train) > 1:
        code_valid.append(code_train.pop())  # a small corpus still gets a held-out code document
    n_docs = -(-cfg.arithmetic_problems // cfg.problems_per_doc)
    n_valid = max(1, round(n_docs * cfg.valid_fraction)) if n_docs and cfg.valid_fraction else 0
    train_rng, valid_rng = random.Random(cfg.seed), random.Random(cfg.seed + 1_000_003)
    arith_train = [make_document(train_rng, cfg.problems_per_doc, cfg.max_difficulty) for _ in range(n_docs)]
    arith_valid = [make_document(valid_rng, cfg.problems_per_doc, cfg.max_difficulty) for _ in range(n_valid)]
    files: dict[str, list[Path]] = {"train": [], "valid": []}
    if cfg.recall_docs and code_train:
        n_valid_recall = max(1, round(cfg.recall_docs * cfg.valid_fraction)) if code_valid else 0
        recall_rng = random.Random(cfg.seed + 2_000_003)
        for split, n, docs in (("train", cfg.recall_docs, code_train), ("valid", n_valid_recall, code_valid)):
            if n:
                texts = [make_mixed_recall_document(recall_rng, recall_rng.choice(docs), cfg.recall_mix) for _ in range(n)]
                files[split].append(_write_jsonl(out / split / "recall.jsonl", texts))
    step = -(-len(code_train) // _CODE_PARTS) if code_train else 0
    for i in range(0, len(code_train), max(step, 1)):
        files["train"].append(_write_jsonl(out / "train" / f"code_{i // step:02d}.jsonl", code_train[i : i + step]))
    if arith_train:
        files["train"].append(_write_jsonl(out / "train" / "arithmetic.jsonl", arith_train))
    if code_valid:
        files["valid"].append(_write_jsonl(out / "valid" / "code.jsonl", code_valid))
    if arith_valid:
        files["valid"].append(_write_jsonl(out / "valid" / "arithmetic.jsonl", arith_valid))
    return files


def build_retrieval_corpus(out_dir: str | Path, cfg: RetrievalCorpusConfig, seed: int,
                           valid_fraction: float) -> dict[str, list[Path]]:
    """The retrieval corpus as JSON lines, one file per kind and split (``orthon.data.retrieval``)."""
    out = Path(out_dir)
    files: dict[str, list[Path]] = {"train": [], "valid": []}
    for split, offset in (("train", 0), ("valid", 1_000_003)):
        rng = random.Random(seed + offset)
        share = 1.0 if split == "train" else valid_fraction
        docs: dict[str, list[str]] = {}
        for _ in range(max(1, round(cfg.docs * share))):
            style, doc = retrieval.make_retrieval_document(rng, cfg.mix, cfg.min_tokens, cfg.max_tokens, cfg.digits)
            docs.setdefault(style, []).append(doc)
        if cfg.long_docs:
            # Longer than any pretraining document: each one needs the longer context.
            docs["long"] = [retrieval.make_retrieval_document(rng, cfg.mix, cfg.max_tokens + 1, cfg.long_max_tokens,
                                                              cfg.digits)[1]
                            for _ in range(max(1, round(cfg.long_docs * share)))]
        if split == "valid":
            docs[HAYSTACK_KIND] = [retrieval.make_filler_document(rng, 1000) for _ in range(-(-cfg.filler_tokens // 1000))]
        files[split] = [_write_jsonl(out / split / f"{kind}.jsonl", texts) for kind, texts in sorted(docs.items())]
    return files


def _kind(path: Path) -> str:
    stem = path.stem
    if stem in KINDS:
        return stem
    return next((k for k in ("arithmetic", "recall") if stem.startswith(k)), "code")


def prepare_builtin(out_dir: str | Path, vocab_size: int = 4096, seed: int = 0, log=print,
                    **overrides) -> BuiltinPaths:
    """Build the corpus, train the tokenizer, prepare the stores; returns where everything is.

    ``overrides`` are further BuiltinConfig fields (``arithmetic_problems``, ``max_code_mb``, ...).
    One process builds at a time: the ranks of a torchrun job all call this, and the first builds while
    the others wait, then reuse what it built (two builders would delete each other's unfinished files).
    """
    with exclusive(Path(out_dir) / ".lock"):
        return _prepare_builtin(out_dir, vocab_size, seed, log, **overrides)


def _prepare_builtin(out_dir, vocab_size: int, seed: int, log, **overrides) -> BuiltinPaths:
    log = log or (lambda _msg: None)
    cfg = BuiltinConfig(vocab_size=vocab_size, seed=seed, **overrides)
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    settings = dataclasses.asdict(cfg)
    settings.pop("workers")
    done_path = root / "builtin.json"
    done = json.loads(done_path.read_text()) if done_path.is_file() else {}
    seconds: dict[str, float] = {}

    t = time.perf_counter()
    corpus_settings = {k: v for k, v in settings.items() if k != "vocab_size"}
    if done.get("corpus_settings") == corpus_settings and done.get("corpus") and all(
            Path(p).is_file() for paths in done["corpus"].values() for p in paths):
        corpus = {split: [Path(p) for p in paths] for split, paths in done["corpus"].items()}
        corpus_reused = True
    else:
        corpus_reused = False
        done = {}
        corpus = (build_retrieval_corpus(root / "corpus", cfg.retrieval, seed, cfg.valid_fraction) if cfg.retrieval
                  else build_corpus(root / "corpus", cfg))
        atomic_write_json(done_path, {"corpus_settings": corpus_settings,
                                      "corpus": {s: [str(p) for p in ps] for s, ps in corpus.items()}})
    seconds["corpus"] = time.perf_counter() - t
    log(f"built-in corpus: {sum(p.stat().st_size for ps in corpus.values() for p in ps) / 1e6:.1f} MB "
        + ("(reused: already built)" if corpus_reused else f"in {seconds['corpus']:.1f}s"))

    t = time.perf_counter()
    default_name = "tokenizer_words.json" if cfg.retrieval else f"tokenizer_{vocab_size}.model"
    tokenizer = Path(cfg.tokenizer) if cfg.tokenizer else root / default_name
    retrained = not (tokenizer.is_file() and done.get("tokenizer_settings") == settings)
    if cfg.tokenizer:
        _check_given_tokenizer(tokenizer, vocab_size, exact=not cfg.retrieval)
    elif retrained and cfg.retrieval:
        write_word_tokenizer(tokenizer, retrieval.WORDS, retrieval.SYMBOLS)
        _check_given_tokenizer(tokenizer, vocab_size, exact=False)
    elif retrained:
        lines = sample_lines(_texts(corpus["train"]), 200_000, seed)
        train_sentencepiece(lines, tokenizer, vocab_size, special_tokens=CHAT_TOKENS, seed=seed)
    if retrained:
        done = {"corpus_settings": corpus_settings, "tokenizer_settings": settings,
                "corpus": {s: [str(p) for p in ps] for s, ps in corpus.items()}}
        atomic_write_json(done_path, done)
    seconds["tokenizer"] = time.perf_counter() - t
    log(f"tokenizer ({load_tokenizer(tokenizer).vocab_size} pieces): {tokenizer} "
        + (f"in {seconds['tokenizer']:.1f}s" if retrained and not cfg.tokenizer else "(reused)"))

    t = time.perf_counter()
    stores: dict[str, dict[str, Path]] = {"train": {}, "valid": {}}
    tokens: dict[str, int] = {}
    for split in ("train", "valid"):
        for kind in KINDS:
            inputs = [str(p) for p in corpus[split] if _kind(p) == kind]
            if not inputs:
                continue
            store = root / "stores" / f"{split}_{kind}"
            report = prepare(PrepareConfig(inputs=inputs, out_dir=str(store), tokenizer=str(tokenizer),
                                           read=ReadConfig(format="jsonl"), workers=cfg.workers,
                                           overwrite=retrained),
                             log=None)
            stores[split][kind] = store
            tokens[f"{split}/{kind}"] = read_manifest(store)["totals"]["n_tokens"]
            log(f"store {split}/{kind}: {tokens[f'{split}/{kind}']} tokens "
                + (f"({report.mb_per_s:.1f} MB/s)" if report.shards_written else "(reused: already prepared)"))
    seconds["prepare"] = time.perf_counter() - t

    report = {"settings": settings, "tokens": tokens, "seconds": {k: round(v, 2) for k, v in seconds.items()}}
    atomic_write_json(done_path, {**done, **report})
    return BuiltinPaths(root=root, tokenizer=tokenizer, train_stores=stores["train"], valid_stores=stores["valid"],
                        corpus=corpus, report=report)


def _check_given_tokenizer(path: Path, vocab_size: int, exact: bool = True) -> None:
    """A trained tokenizer must have builtin.vocab_size pieces; a word tokenizer at most that many."""
    if not path.is_file():
        raise FileNotFoundError(f"builtin.tokenizer: {path} does not exist")
    size = load_tokenizer(path).vocab_size
    if size > vocab_size or (exact and size != vocab_size):
        raise ValueError(f"builtin.tokenizer: {path} has {size} pieces, builtin.vocab_size is {vocab_size}"
                         + ("" if exact else " (must be at least the tokenizer's)"))


def _texts(files: list[Path]):
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]
