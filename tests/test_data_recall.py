"""Key-value recall documents: every definition is restated later, nothing of the code is lost, and the
built-in corpus carries them as their own kind."""
import json
import random
import re

import pytest

from orthon.data.builtin import prepare_builtin, stdlib_sources
from orthon.data.config import BuiltinConfig
from orthon.data.recall import EXCLUDED_NAMES, NAME_WORDS, SMALL_VOCAB, make_copy_document, make_kv_document, make_recall_document
from orthon.data.store import TokenStore
from orthon.data.tokenizer import load_tokenizer
from orthon.core.errors import ConfigError

PAIR = re.compile(r"^([A-Z_]+) = (\d{5})$")
PAIR_ANY = re.compile(r"^(\w+) = (\d{5})$")


def _pairs(doc: str) -> list[tuple[int, str, str]]:
    return [(i, m[1], m[2]) for i, line in enumerate(doc.splitlines()) if (m := PAIR.match(line))]


def _style(doc: str) -> str | None:
    """Which generator made a recall document, from its shape."""
    lines = doc.splitlines()
    half = len(lines) // 2
    if len(lines) == 2 * half and all(PAIR_ANY.match(x) for x in lines) and sorted(lines[:half]) == sorted(lines[half:]):
        return "kv"
    if len(lines) % 2 == 0 and lines[::2] == lines[1::2] and not any(PAIR_ANY.match(x) for x in lines):
        return "copy"
    return "code" if _pairs(doc) else None


@pytest.mark.parametrize("seed", range(20))
def test_each_definition_is_restated_later_with_its_value(seed):
    rng = random.Random(seed)
    code = stdlib_sources(1.0)[seed][1]
    doc = make_recall_document(rng, code, chars_per_pair=300)
    pairs = _pairs(doc)
    by_name: dict[str, list[tuple[int, str]]] = {}
    for line, name, value in pairs:
        by_name.setdefault(name, []).append((line, value))
    assert by_name and all(len(v) == 2 for v in by_name.values())  # a definition and one restatement
    assert all(a[1] == b[1] and a[0] < b[0] for a, b in by_name.values())
    assert not set(by_name) & EXCLUDED_NAMES
    # Removing the inserted lines gives back a contiguous (wrapped) run of the code's lines.
    kept = [line for line in doc.splitlines() if not PAIR.match(line)]
    lines = code.splitlines()
    starts = [i for i in range(len(lines)) if (lines[i:] + lines[:i])[: len(kept)] == kept]
    assert starts, "the code lines left after removing the pairs are not a contiguous run of the code"
    # The window holds about max(1, chars // 300) pairs.
    assert len(by_name) == max(1, (sum(len(x) + 1 for x in kept)) // 300)


def test_window_lengths_span_the_range():
    rng = random.Random(0)
    code = "\n".join(f"x_{i} = {i}" for i in range(5000))
    sizes = [len(make_recall_document(rng, code, min_chars=200, max_chars=20_000)) for _ in range(300)]
    assert min(sizes) < 600 and max(sizes) > 12_000  # log-uniform: short and long windows both occur


def test_builtin_corpus_with_recall_kind(tmp_path):
    paths = prepare_builtin(tmp_path, vocab_size=600, seed=0, log=None, arithmetic_problems=500, max_code_mb=0.3,
                            valid_fraction=0.05, recall_docs=40, workers=1)
    assert set(paths.train_stores) == set(paths.valid_stores) == {"code", "arithmetic", "recall"}
    docs = [json.loads(line)["text"] for line in (tmp_path / "corpus/train/recall.jsonl").open()]
    assert len(docs) == 40
    styles = [_style(d) for d in docs]
    assert None not in styles
    assert all(styles.count(s) >= 2 for s in ("code", "kv", "copy"))  # the default mix 1:1:3 gives each
    assert styles.count("copy") > styles.count("kv")
    tok = load_tokenizer(paths.tokenizer)
    store = TokenStore(paths.train_stores["recall"])
    assert store.n_docs == 40 and tok.decode(store.doc(7)) == docs[7]
    cfg = paths.data_config(weights={"code": 1.0, "arithmetic": 1.0, "recall": 2.0})
    assert {s.name: s.weight for s in cfg.sources} == {"code": 1.0, "arithmetic": 1.0, "recall": 2.0}


def test_recall_config_validation():
    with pytest.raises(ConfigError, match="recall_mix"):
        BuiltinConfig(recall_docs=5, recall_mix={"code": 1.0, "haystack": 1.0})
    with pytest.raises(ConfigError, match="recall_mix"):
        BuiltinConfig(recall_docs=5, recall_mix={"code": 0.0})
    with pytest.raises(ConfigError, match="recall_docs"):
        BuiltinConfig(recall_docs=-1)
    with pytest.raises(ConfigError, match="recall_docs"):
        BuiltinConfig(recall_docs=5, include_stdlib=False)
    with pytest.raises(ConfigError, match="weights"):
        BuiltinConfig(recall_docs=5, weights={"code": 1.0, "arithmetic": 1.0})
    BuiltinConfig(recall_docs=5, weights={"code": 1.0, "arithmetic": 1.0, "recall": 0.5})


def test_restatement_distances_are_log_uniform():
    """Near restatements (learnable in a short training sequence) and far ones (only a long one holds
    both lines) both occur: the distance in lines is log-uniform, not uniform over the window."""
    rng = random.Random(0)
    code = "\n".join(f"x_{i} = {i}" for i in range(20_000))
    near = far = total = 0
    for _ in range(200):
        doc = make_recall_document(rng, code, min_chars=20_000, max_chars=20_001, chars_per_pair=2_000)
        first: dict[str, int] = {}
        for line, name, _ in _pairs(doc):
            if name in first:
                gap = line - first[name]
                near, far, total = near + (gap <= 8), far + (gap > 300), total + 1
            else:
                first[name] = line
    # A window of ~1,800 lines, definitions uniform in it: log-uniform distances put about a third of the
    # restatements within 8 lines (a uniform draw would put under 1% there) and still some beyond 300.
    assert 0.2 < near / total < 0.5 and far / total > 0.1


CODE_WITH_NAMES = "def parse_header(stream, limit):\n    PASSKEY = 1\n    return stream.read(limit) + other_value\n"


@pytest.mark.parametrize("seed", range(10))
def test_copy_document_repeats_each_line_of_code_identifiers(seed):
    rng = random.Random(seed)
    doc = make_copy_document(rng, CODE_WITH_NAMES, min_words=3, max_words=30, blocks=5)
    lines = doc.splitlines()
    assert len(lines) == 10 and doc.endswith("\n")
    words = {"def", "parse_header", "stream", "limit", "return", "read", "other_value"}  # never PASSKEY
    for first, repeat in zip(lines[::2], lines[1::2]):
        assert first == repeat  # the repeat is the line itself, token for token
        # each line draws from one vocabulary: the code's identifiers or the small one
        assert 3 <= len(first.split()) <= 30
        assert set(first.split()) <= words or set(first.split()) <= set(SMALL_VOCAB)


def test_copy_lines_share_the_small_vocabulary():
    rng = random.Random(3)
    lines = [x for _ in range(100) for x in make_copy_document(rng, CODE_WITH_NAMES, min_words=6).splitlines()[::2]]
    small = sum(set(x.split()) <= set(SMALL_VOCAB) for x in lines) / len(lines)
    assert 0.4 < small < 0.6  # small_vocab_share 0.5
    assert all(set(x.split()) <= set(SMALL_VOCAB) for x in make_copy_document(rng, CODE_WITH_NAMES, small_vocab_share=1.0).splitlines())


def test_copy_line_lengths_are_log_uniform():
    rng = random.Random(0)
    n = [len(line.split()) for _ in range(200) for line in make_copy_document(rng, CODE_WITH_NAMES).splitlines()[::2]]
    assert min(n) == 4 and max(n) == 48
    assert 0.25 < sum(k <= 10 for k in n) / len(n) < 0.5  # log-uniform: ~37% at <= 10 words (uniform: 16%)


@pytest.mark.parametrize("seed", range(10))
def test_kv_document_restates_every_pair_shuffled(seed):
    rng = random.Random(seed)
    doc = make_kv_document(rng, CODE_WITH_NAMES, min_pairs=6, max_pairs=12)
    lines = doc.splitlines()
    half = len(lines) // 2
    defined, restated = lines[:half], lines[half:]
    assert len(lines) == 2 * half and 6 <= half <= 12
    assert sorted(defined) == sorted(restated)  # every pair once more, with the same value
    pairs = dict(line.split(" = ") for line in defined)
    assert len(pairs) == half and all(re.fullmatch(r"\d{5}", v) for v in pairs.values())  # one value per name
    assert not set(pairs) & EXCLUDED_NAMES  # the passkey's name stays held out, even where the code has it
    code_names = {"def", "parse_header", "stream", "limit", "return", "read", "other_value"}
    assert all(k in code_names or set(k.split("_")) <= set(NAME_WORDS) for k in pairs)


def test_kv_names_mix_code_identifiers_and_name_words():
    rng = random.Random(1)
    names = [line.split(" = ")[0] for _ in range(50) for line in make_kv_document(rng, CODE_WITH_NAMES).splitlines()]
    from_code = sum(n in {"parse_header", "stream", "limit", "return", "read", "other_value"} for n in names)
    assert 0.2 < from_code / len(names) < 0.6
