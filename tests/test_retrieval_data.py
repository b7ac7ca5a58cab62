"""The retrieval corpus over a small word vocabulary: the word tokenizer (one token a word, exact round
trip), the document styles (every needle restated, token budgets held), and the built-in corpus they
make (kinds, stores, the default blend without the mid-training kind)."""
import json
import random
import re
from collections import Counter

import pytest

from orthon.core.errors import ConfigError, DataError
from orthon.data import retrieval
from orthon.data.builtin import prepare_builtin
from orthon.data.config import BuiltinConfig, RetrievalCorpusConfig
from orthon.data.recall import EXCLUDED_NAMES
from orthon.data.retrieval import (FILLER_WORDS, NAME_WORDS, WORDS, count_tokens, filler_sentence,
                                   make_copy_document, make_haystack_document, make_kv_document,
                                   make_retrieval_document)
from orthon.data.store import TokenStore
from orthon.data.tokenizer import load_tokenizer
from orthon.data.word_tokenizer import SPECIAL_TOKENS, split_pattern, word_vocabulary, write_word_tokenizer

PAIR = re.compile(r"^([A-Z_]+) = (\d{5})$")
SENTENCE = re.compile(r"(here we go\.|there and back again\.|the [a-z]+ is [a-z]+\.|the [a-z]+ and the [a-z]+ are [a-z]+\.)")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = write_word_tokenizer(tmp_path_factory.mktemp("tok") / "words.json", WORDS, retrieval.SYMBOLS)
    return load_tokenizer(path)


def test_word_tokenizer_ids_and_pieces(tok):
    vocab = word_vocabulary(WORDS, retrieval.SYMBOLS)
    assert tok.vocab_size == len(vocab) == 4 + 15 + len(NAME_WORDS) + len(FILLER_WORDS) == 103
    assert vocab[:4] == list(SPECIAL_TOKENS) and (tok.eos_id, tok.bos_id, tok.pad_id) == (2, 1, 3)
    ids = {w: tok.token_to_id(w) for w in vocab}
    assert sorted(ids.values()) == list(range(len(vocab)))  # ids in vocabulary order
    # Every word and symbol is one token; PASSKEY is the two trained words PASS KEY.
    assert tok.encode("\nPASSKEY = 71432\n") == [ids[t] for t in ["\n", "PASS", "KEY", " ", "=", " ",
                                                                 "7", "1", "4", "3", "2", "\n"]]
    assert tok.encode("INDEX_ID") == [ids["INDEX"], ids["_"], ids["ID"]]  # the longer word wins over its prefix
    assert tok.encode("the sky is blue.") == [ids[t] for t in ["the", " ", "sky", " ", "is", " ", "blue", "."]]
    # An unknown run of letters is one <unk>; an unknown character too.
    assert tok.encode("the FOO sky%") == [ids["the"], ids[" "], 0, ids[" "], ids["sky"], 0]


def test_word_tokenizer_rejects_bad_entries(tmp_path):
    with pytest.raises(DataError, match="symbol 'ab'"):
        word_vocabulary(["WORD"], ["ab"])
    with pytest.raises(DataError, match="word 'A_B'"):
        word_vocabulary(["A_B"], [" "])
    assert split_pattern(["ID", "INDEX", "A"]).startswith("INDEX|ID|A|")


@pytest.mark.parametrize("seed", range(3))
def test_documents_round_trip_and_count_exactly(tok, seed):
    rng = random.Random(seed)
    for _ in range(200):
        _, doc = make_retrieval_document(rng, {"kv": 1, "copy": 1, "haystack": 1}, 16, 300)
        ids = tok.encode(doc)
        assert tok.decode(ids) == doc and 0 not in ids
        assert count_tokens(doc) == len(ids)


def test_kv_document_restates_every_pair_shuffled():
    rng = random.Random(0)
    sizes = []
    for tokens in (16, 64, 127, 511):
        for _ in range(20):
            lines = make_kv_document(rng, tokens).splitlines()
            half = len(lines) // 2
            assert len(lines) == 2 * half and all(PAIR.match(x) for x in lines)
            assert sorted(lines[:half]) == sorted(lines[half:])
            names = [PAIR.match(x)[1] for x in lines[:half]]
            assert len(set(names)) == half and not set(names) & EXCLUDED_NAMES
            assert all(w in NAME_WORDS for n in names for w in n.split("_"))
            sizes.append((tokens, half))
    # One pair per 24 tokens (a name averages 3 tokens), at least one.
    assert {half for tokens, half in sizes} == {1, 2, 5, 21}


def test_copy_document_lines_are_spans_written_twice(tok):
    rng = random.Random(1)
    pieces, lengths = Counter(), []
    for tokens in (8, 40, 127):
        for _ in range(30):
            doc = make_copy_document(rng, tokens)
            lines = doc.splitlines()
            for line in lines:
                ids = tok.encode(line)
                half = len(ids) // 2
                assert len(ids) == 2 * half and ids[:half] == ids[half:]  # token for token, the span twice
                assert 0 not in ids and tok.token_to_id("\n") not in ids and 4 <= half <= 48
                pieces.update(ids)
                lengths.append(half)
            first_line = count_tokens(lines[0]) + 1
            assert count_tokens(doc) <= max(tokens, first_line)  # only a first line may pass the budget
    assert len(pieces) > 90  # nearly every word, digit and symbol appears
    assert min(lengths) == 4 and max(lengths) > 40


def test_haystack_document_places_and_restates_each_needle():
    rng = random.Random(2)
    counts = Counter()
    for _ in range(200):
        tokens = rng.randint(40, 511)
        doc = make_haystack_document(rng, tokens)
        lines = doc.splitlines()
        needles = [x for x in lines if PAIR.match(x)]
        k = len(needles) // 2
        counts[k] += 1
        tail = lines[-k:]
        assert 1 <= k <= 3 and all(PAIR.match(x) for x in tail)
        placed = [x for x in lines[:-k] if PAIR.match(x)]
        assert sorted(placed) == sorted(tail)  # each needle once in the text, once at the end
        filler = " ".join(x for x in lines[:-k] if not PAIR.match(x))
        assert SENTENCE.sub("", filler).strip() == ""  # everything else is filler sentences
        # The needles' lines (twice) and newlines; a sentence holds at most 14 tokens and a space, and a
        # placed needle's newlines take the place of one space.
        needle_tokens = sum(2 * count_tokens(x) + 3 for x in tail)
        if tokens >= needle_tokens + 15:
            assert tokens - 15 - k <= count_tokens(doc) <= tokens  # filled to within one sentence of the budget
        else:  # the needles alone pass the budget: one sentence still holds them
            assert len(SENTENCE.findall(filler)) == 1
    assert set(counts) == {1, 2, 3}


def test_mix_shares_and_lengths():
    rng = random.Random(3)
    styles, lengths = Counter(), []
    for _ in range(3000):
        style, doc = make_retrieval_document(rng, {"kv": 1.0, "copy": 0.0, "haystack": 3.0}, 40, 127)
        styles[style] += 1
        if style == "haystack":
            lengths.append(count_tokens(doc))
    assert set(styles) == {"kv", "haystack"}
    assert styles["haystack"] / 3000 == pytest.approx(0.75, abs=0.03)
    # Lengths uniform in [40, 127] (mean 83.5), each filled to within one sentence, a short budget raised
    # to what its needles need.
    assert max(lengths) <= 127 and 75 < sum(lengths) / len(lengths) < 87


def test_filler_sentences_follow_the_grammar():
    rng = random.Random(4)
    sentences = [filler_sentence(rng) for _ in range(400)]
    assert all(SENTENCE.fullmatch(s) for s in sentences)
    assert len(set(sentences)) > 50


def test_builtin_retrieval_corpus(tmp_path):
    cfg = RetrievalCorpusConfig(docs=300, long_docs=20, long_max_tokens=300, filler_tokens=3000)
    paths = prepare_builtin(tmp_path, vocab_size=128, seed=0, log=None, retrieval=cfg, valid_fraction=0.1, workers=1)
    assert set(paths.train_stores) == {"kv", "copy", "haystack", "long"}
    assert set(paths.valid_stores) == {"kv", "copy", "haystack", "long", "filler"}
    tok = load_tokenizer(paths.tokenizer)
    assert paths.tokenizer.name == "tokenizer_words.json" and tok.vocab_size == 103
    # Each store holds its kind's documents, decoding back to the generated text.
    for split, kind in (("train", "haystack"), ("valid", "filler"), ("train", "long")):
        docs = [json.loads(x)["text"] for x in (tmp_path / "corpus" / split / f"{kind}.jsonl").open()]
        store = TokenStore((paths.train_stores if split == "train" else paths.valid_stores)[kind])
        assert store.n_docs == len(docs) and tok.decode(store.doc(len(docs) // 2)) == docs[len(docs) // 2]
    n_train = sum(TokenStore(paths.train_stores[k]).n_docs for k in ("kv", "copy", "haystack"))
    assert n_train == 300 and TokenStore(paths.train_stores["long"]).n_docs == 20
    assert TokenStore(paths.valid_stores["filler"]).n_tokens == pytest.approx(3000, abs=60)
    long_lengths = [len(TokenStore(paths.train_stores["long"]).doc(i)) for i in range(20)]
    assert min(long_lengths) > 100 and max(long_lengths) > 200  # budgets above the pretraining documents'
    # The default blend leaves the mid-training kind out; held out: the blend's kinds and the haystack.
    data = paths.data_config(seq_len=64)
    assert [s.name for s in data.sources] == ["kv", "copy", "haystack"]
    assert [s.name for s in data.valid] == ["kv", "copy", "haystack", "filler"]
    data = paths.data_config(seq_len=64, weights={"haystack": 2.0, "long": 1.0})
    assert [(s.name, s.weight) for s in data.sources] == [("haystack", 2.0), ("long", 1.0)]
    assert [s.name for s in data.valid] == ["haystack", "long", "filler"]


def test_retrieval_config_validation():
    with pytest.raises(ConfigError, match="mix"):
        RetrievalCorpusConfig(mix={"kv": 1.0, "code": 1.0})
    with pytest.raises(ConfigError, match="long_max_tokens"):
        RetrievalCorpusConfig(long_docs=10, long_max_tokens=100)
    with pytest.raises(ConfigError, match="max_tokens"):
        RetrievalCorpusConfig(min_tokens=200, max_tokens=127)
    with pytest.raises(ConfigError, match="weights"):
        BuiltinConfig(retrieval=RetrievalCorpusConfig(), weights={"kv": 1.0, "long": 1.0})  # no long documents
    with pytest.raises(ConfigError, match="weights"):
        BuiltinConfig(retrieval=RetrievalCorpusConfig(), weights={"code": 1.0})
    BuiltinConfig(retrieval=RetrievalCorpusConfig(long_docs=1, long_max_tokens=511), weights={"long": 1.0})
