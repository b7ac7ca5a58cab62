"""Typed configs of the data pipeline (filled from YAML by orthon.core.config.build).

- ``TokenizerTrainConfig``: ``orthon tokenizer train``.
- ``PrepareConfig``: ``orthon data prepare`` (text files -> token store).
- ``DedupConfig``: ``orthon data dedup`` (MinHash-LSH near-duplicate removal).
- ``BuiltinConfig``: the built-in corpus of the embedded default.
- ``DataConfig``: what the training loop reads (stores, blend weights, seq_len, seed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from orthon.data.recall import RECALL_STYLES
from orthon.data.retrieval import STYLES as RETRIEVAL_STYLES
from orthon.core.errors import ConfigError

SourceFormat = Literal["auto", "jsonl", "parquet", "text"]
# How a plain text file is cut into documents (the `sample_by` of datasets' text builder).
TextUnit = Literal["line", "paragraph", "document"]


@dataclass
class FilterConfig:
    """A quality scorer loaded by dotted path; a document is kept when score >= min_score."""

    path: str
    min_score: float
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.path:
            raise ConfigError("path: must name a scorer, e.g. orthon.data.filters.heuristic_quality")


@dataclass
class ReadConfig:
    """How source files are read into documents."""

    format: SourceFormat = "auto"
    text_field: str = "text"
    text_unit: TextUnit = "line"


@dataclass
class TokenizerTrainConfig:
    inputs: list[str] = field(default_factory=list)
    output: str = "tokenizer.model"
    vocab_size: int = 4096
    model_type: Literal["bpe", "unigram"] = "bpe"
    # Lines sampled (seeded reservoir) from the inputs as training sentences.
    max_sentences: int = 300_000
    character_coverage: float = 0.9995
    seed: int = 0
    threads: int = 0  # 0: all cores
    special_tokens: list[str] = field(default_factory=list)
    read: ReadConfig = field(default_factory=ReadConfig)

    def __post_init__(self):
        if self.vocab_size < 16:
            raise ConfigError(f"vocab_size: must be at least 16, got {self.vocab_size}")
        if self.max_sentences < 1:
            raise ConfigError(f"max_sentences: must be positive, got {self.max_sentences}")
        if not 0.9 <= self.character_coverage <= 1.0:
            raise ConfigError(f"character_coverage: must be in [0.9, 1], got {self.character_coverage}")


@dataclass
class PrepareConfig:
    inputs: list[str] = field(default_factory=list)
    out_dir: str = ""
    tokenizer: str = ""
    read: ReadConfig = field(default_factory=ReadConfig)
    workers: int = 0  # 0: one per CPU core (one per 4 MB for small inputs); 1: tokenise in this process
    # A shard (the unit of resume) closes after this many MB of input text.
    shard_mb: float = 64.0
    batch_docs: int = 256  # documents per task sent to a worker
    min_chars: int = 1
    # Longer documents (a 100 MB line of minified data, say) are skipped and counted.
    max_chars: int = 10_000_000
    filters: list[FilterConfig] = field(default_factory=list)
    overwrite: bool = False

    def __post_init__(self):
        if self.workers < 0:
            raise ConfigError(f"workers: must be >= 0, got {self.workers}")
        if self.shard_mb <= 0:
            raise ConfigError(f"shard_mb: must be positive, got {self.shard_mb}")
        if self.batch_docs < 1:
            raise ConfigError(f"batch_docs: must be positive, got {self.batch_docs}")
        if self.min_chars < 1 or self.max_chars < self.min_chars:
            raise ConfigError(f"max_chars: need 1 <= min_chars <= max_chars, got {self.min_chars}, {self.max_chars}")


@dataclass
class DedupConfig:
    inputs: list[str] = field(default_factory=list)
    output: str = "deduped.jsonl"
    threshold: float = 0.8  # estimated Jaccard similarity at or above which a document is a near-duplicate
    num_perm: int = 128
    ngram: int = 5  # word n-gram shingles
    seed: int = 1
    read: ReadConfig = field(default_factory=ReadConfig)

    def __post_init__(self):
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"threshold: must be in (0, 1], got {self.threshold}")
        if self.num_perm < 16:
            raise ConfigError(f"num_perm: must be at least 16, got {self.num_perm}")
        if self.ngram < 1:
            raise ConfigError(f"ngram: must be positive, got {self.ngram}")


@dataclass
class RetrievalCorpusConfig:
    """The generated retrieval corpus over a small word vocabulary (``orthon.data.retrieval``): in place of
    the code-and-arithmetic corpus when ``builtin.retrieval`` is given. Lengths are in tokens."""

    docs: int = 100_000  # training documents of the styles in ``mix``, min_tokens..max_tokens long
    mix: dict[str, float] = field(default_factory=lambda: {"kv": 1.0, "copy": 1.0, "haystack": 2.0})
    min_tokens: int = 16
    max_tokens: int = 127  # one less than the training length: a document and its end-of-document token
    # A "long" kind for mid-training: documents of the same mix, max_tokens + 1..long_max_tokens long.
    long_docs: int = 0
    long_max_tokens: int = 0
    filler_tokens: int = 100_000  # held-out filler text (the "filler" kind): the passkey evaluation's haystack
    digits: int = 5  # digits of a value

    def __post_init__(self):
        if set(self.mix) - set(RETRIEVAL_STYLES) or any(w < 0 for w in self.mix.values()) \
                or not sum(self.mix.values()) > 0:
            raise ConfigError(f"mix: non-negative shares of {list(RETRIEVAL_STYLES)}, not all 0, got {self.mix}")
        if self.docs < 1:
            raise ConfigError(f"docs: must be positive, got {self.docs}")
        if not 8 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"max_tokens: need 8 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        if self.long_docs < 0 or (self.long_docs and self.long_max_tokens <= self.max_tokens):
            raise ConfigError(f"long_max_tokens: long documents (long_docs {self.long_docs}) need long_max_tokens above "
                              f"max_tokens ({self.max_tokens}), got {self.long_max_tokens}")
        if self.filler_tokens < 1024:
            raise ConfigError(f"filler_tokens: need at least 1024 (the evaluation's haystack), got {self.filler_tokens}")
        if not 1 <= self.digits <= 12:
            raise ConfigError(f"digits: must be in 1..12, got {self.digits}")

    def train_kinds(self) -> list[str]:
        return [s for s in RETRIEVAL_STYLES if self.mix.get(s, 0) > 0] + (["long"] if self.long_docs else [])


@dataclass
class BuiltinConfig:
    """The built-in corpus: Python standard library source + generated arithmetic (+ generated recall
    documents, ``orthon.data.recall``, when ``recall_docs`` > 0)."""

    vocab_size: int = 4096
    seed: int = 0
    arithmetic_problems: int = 100_000
    problems_per_doc: int = 32
    max_difficulty: int = 3
    recall_docs: int = 0  # recall documents made from the training code (0: no "recall" kind)
    # Shares of the recall documents by style (orthon.data.recall): "code" (definitions restated in a
    # code window), "kv" (a list of pairs, restated shuffled), "copy" (lines of words, each repeated).
    recall_mix: dict[str, float] = field(default_factory=lambda: {"code": 1.0, "kv": 1.0, "copy": 3.0})
    # A tokenizer to reuse ("": train one on the corpus), e.g. the one of a run being continued, whose
    # embeddings are tied to its token ids.
    tokenizer: str = ""
    include_stdlib: bool = True
    max_code_mb: float = 0.0  # 0: the whole standard library
    valid_fraction: float = 0.01
    workers: int = 0
    # Blend weights by kind ("code", "arithmetic", "recall") for training; empty: in proportion to their tokens.
    # With ``retrieval``: the kinds named here are the blend (the "long" kind is mid-training's, not named).
    weights: dict[str, float] = field(default_factory=dict)
    # The generated retrieval corpus and its word tokenizer instead of code and arithmetic (None: off).
    retrieval: RetrievalCorpusConfig | None = None

    def __post_init__(self):
        if not 0.0 <= self.valid_fraction < 0.5:
            raise ConfigError(f"valid_fraction: must be in [0, 0.5), got {self.valid_fraction}")
        if self.arithmetic_problems < 0 or self.problems_per_doc < 1:
            raise ConfigError("arithmetic_problems: must be >= 0 (and problems_per_doc >= 1)")
        if self.max_difficulty < 1:
            raise ConfigError(f"max_difficulty: must be >= 1, got {self.max_difficulty}")
        if self.recall_docs < 0 or (self.recall_docs and not self.include_stdlib):
            raise ConfigError(f"recall_docs: must be >= 0, and needs include_stdlib (the documents are cut from "
                              f"the code), got {self.recall_docs}")
        if set(self.recall_mix) - set(RECALL_STYLES) or any(w < 0 for w in self.recall_mix.values()) \
                or not sum(self.recall_mix.values()) > 0:
            raise ConfigError(f"recall_mix: non-negative shares of {list(RECALL_STYLES)}, not all 0, got {self.recall_mix}")
        if self.retrieval is not None:
            kinds = set(self.retrieval.train_kinds())
            if set(self.weights) - kinds or not all(w > 0 for w in self.weights.values()):
                raise ConfigError(f"weights: positive weights for some of {sorted(kinds)}, got {self.weights}")
        elif self.weights:
            kinds = {"code", "arithmetic"} if self.include_stdlib else {"arithmetic"}
            kinds |= {"recall"} if self.recall_docs else set()
            if set(self.weights) != kinds:
                raise ConfigError(f"weights: give one weight for each of {sorted(kinds)}, got {sorted(self.weights)}")
            if not all(w > 0 for w in self.weights.values()):
                raise ConfigError(f"weights: must be positive, got {self.weights}")


@dataclass
class StoreSource:
    """One prepared token store in a blend."""

    path: str
    weight: float = 1.0
    name: str = ""

    def __post_init__(self):
        if not self.weight > 0:
            raise ConfigError(f"weight: must be positive, got {self.weight}")


@dataclass
class DataConfig:
    """What the training loop reads."""

    sources: list[StoreSource] = field(default_factory=list)
    valid: list[StoreSource] = field(default_factory=list)
    tokenizer: str = ""
    seq_len: int = 256
    seed: int = 1234
    shuffle: bool = True
    # Samples per epoch of the blend; 0: the sum of the sources' packed sample counts.
    num_samples: int = 0
    # The blend's source pattern repeats every blend_cycle samples (weights are exact per cycle).
    blend_cycle: int = 10_000
    # Stop attention at document boundaries; the target after an end-of-document token is then ignored.
    document_mask: bool = False

    def __post_init__(self):
        if self.seq_len < 1:
            raise ConfigError(f"seq_len: must be positive, got {self.seq_len}")
        if self.num_samples < 0:
            raise ConfigError(f"num_samples: must be >= 0, got {self.num_samples}")
        if self.blend_cycle < 1:
            raise ConfigError(f"blend_cycle: must be positive, got {self.blend_cycle}")
