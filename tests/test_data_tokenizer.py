import json
import pickle

import pytest
from test_data_support import CODE_SAMPLE, hf_tokenizer_json, train_tiny_tokenizer

from orthon.core.errors import DataError
from orthon.data.tokenizer import (BOS_ID, CHAT_TOKENS, EOS_ID, PAD_ID, HFTokenizer, SentencePieceTokenizer,
                                   load_tokenizer, sample_lines, train_sentencepiece)


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_sentencepiece_round_trips_code_and_unicode_exactly(sp_path):
    tok = load_tokenizer(sp_path)
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 512
    for text in [CODE_SAMPLE, "  two leading spaces\n\n\nand blank lines\t\t", "Q: 37+45=? A: 82",
                 "Nous écrivons en français", "emoji 🙂 falls back to bytes", "数字"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(["a b", CODE_SAMPLE]) == [tok.encode("a b"), tok.encode(CODE_SAMPLE)]


def test_sentencepiece_special_ids(sp_path):
    tok = load_tokenizer(sp_path)
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (EOS_ID, BOS_ID, PAD_ID)
    # newline and tab are pieces of their own; digits are split one by one
    newline = tok.token_to_id("\n")
    assert newline is not None and tok.encode("a\nb").count(newline) == 1
    assert len(tok.encode("12345")) == 5
    assert tok.token_to_id("<no such piece>") is None


def test_special_tokens_are_single_pieces(tmp_path):
    lines = ["hello world", "<|user|> hi <think> ok </think>"] * 50 + [f"line {i}" for i in range(200)]
    path = train_sentencepiece(lines, tmp_path / "chat.model", 300, special_tokens=CHAT_TOKENS, threads=1)
    tok = load_tokenizer(path)
    for t in CHAT_TOKENS:
        assert tok.encode(t) == [tok.token_to_id(t)]


def test_training_is_deterministic(tmp_path):
    a = train_tiny_tokenizer(tmp_path / "a", vocab_size=400, seed=3)
    b = train_tiny_tokenizer(tmp_path / "b", vocab_size=400, seed=3)
    # (the .model also records its output path, so compare the learnt pieces and scores)
    assert a.with_suffix(".vocab").read_text() == b.with_suffix(".vocab").read_text()
    assert not list(tmp_path.rglob("*.tmp*"))  # written under temporary names, then renamed


def test_tokenizer_pickles_for_worker_processes(sp_path):
    tok = load_tokenizer(sp_path)
    again = pickle.loads(pickle.dumps(tok))
    assert again.encode(CODE_SAMPLE) == tok.encode(CODE_SAMPLE)


def test_hf_tokenizer_json(tmp_path):
    path = hf_tokenizer_json(tmp_path / "tokenizer.json")
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tok.token_to_id("<|endoftext|>")  # first of the usual names it holds
    assert tok.bos_id == tok.token_to_id("<s>")
    assert tok.decode(tok.encode(CODE_SAMPLE)) == CODE_SAMPLE
    assert load_tokenizer(tmp_path).vocab_size == tok.vocab_size  # a directory holding tokenizer.json
    # tokenizer_config.json beside the file names the eos token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert load_tokenizer(path).eos_id == tok.token_to_id("</s>")
    assert load_tokenizer(path, eos_token="<s>").eos_id == tok.token_to_id("<s>")
    assert pickle.loads(pickle.dumps(load_tokenizer(path))).eos_id == tok.token_to_id("</s>")


def test_bad_tokenizer_files_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no such tokenizer"):
        load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a sentencepiece model"):
        load_tokenizer(tmp_path / "junk.model")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "junk.json")
    with pytest.raises(DataError, match="no training text"):
        train_sentencepiece([], tmp_path / "x.model", 100)


def test_sample_lines_is_seeded_and_bounded():
    docs = [f"doc {d}\n\n" + "\n".join(f"line {d}.{i}" for i in range(50)) for d in range(20)]
    a, b, c = sample_lines(docs, 100, 0), sample_lines(docs, 100, 0), sample_lines(docs, 100, 1)
    assert a == b and a != c and len(a) == 100
    assert all(line.strip() for line in a)  # blank lines are never sampled
    assert len(sample_lines(docs, 10_000, 0)) == 20 * 51
