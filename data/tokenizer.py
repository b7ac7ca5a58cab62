"""Tokenizers: one interface over sentencepiece models and Hugging Face tokenizer.json files.

``train_sentencepiece`` trains a byte-fallback BPE model whose normalisation
is the identity and whose whitespace is kept as is, so code round-trips
exactly: ``decode(encode(text)) == text``. Newlines and tabs are their own
pieces (sentencepiece trains on lines, so a newline could not be learnt).
``load_tokenizer`` opens either kind by path.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Iterable, Sequence

from orthon.core.errors import DataError
from orthon.core.files import tmp_path

# Special ids of a trained sentencepiece model.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# Role and thinking markers of the chat format (the GLM-5 recipe); single tokens in the built-in tokenizer.
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>"]
# End-of-document tokens tried, in order, when an HF tokenizer has no configured eos token.
_HF_EOS_NAMES = ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "<|im_end|>"]
_HF_BOS_NAMES = ["<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>"]
# sentencepiece skips longer training sentences; longer lines are cut to this many characters.
_MAX_SENTENCE_CHARS = 8192


class Tokenizer:
    """The interface everything uses: encode/decode, vocab_size, eos_id, bos_id, pad_id."""

    path: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    pad_id: int | None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"path": self.path, "kind": type(self).__name__, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "bos_id": self.bos_id, "pad_id": self.pad_id}


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self.path = str(path)
        self._sp = spm.SentencePieceProcessor(model_file=self.path)
        self.vocab_size = int(self._sp.get_piece_size())
        self.eos_id = int(self._sp.eos_id())
        if self.eos_id < 0:
            raise DataError(f"{path}: sentencepiece model has no eos token (needed as end-of-document)")
        self.bos_id = _or_none(self._sp.bos_id())
        self.pad_id = _or_none(self._sp.pad_id())

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One thread: parallelism is the caller's (data prepare runs one process per core).
        return self._sp.encode(list(texts), num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else int(i)

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (or a directory holding one) through the ``tokenizers`` library.

    The eos token is ``eos_token`` if given, else the one named in a
    ``tokenizer_config.json`` beside the file, else the first of the usual
    end-of-text names that the vocabulary holds.
    """

    def __init__(self, path: str | Path, eos_token: str | None = None):
        from tokenizers import Tokenizer as _HF

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"{file}: no such tokenizer file")
        self.path = str(file)
        self._eos_token = eos_token
        try:
            self._tok = _HF.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception on malformed files
            raise DataError(f"{file}: not a valid tokenizer.json: {exc}") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        config = _read_json(file.parent / "tokenizer_config.json")
        eos_names = [eos_token] if eos_token else [_token_name(config.get("eos_token"))] + _HF_EOS_NAMES
        self.eos_id = self._first_id(eos_names)
        if self.eos_id is None:
            raise DataError(f"{file}: no end-of-document token found (tried {eos_names}); pass eos_token")
        self.bos_id = self._first_id([_token_name(config.get("bos_token"))] + _HF_BOS_NAMES)
        self.pad_id = self._first_id([_token_name(config.get("pad_token")), "<pad>", "<|pad|>"])

    def _first_id(self, names) -> int | None:
        for name in names:
            if name:
                i = self._tok.token_to_id(name)
                if i is not None:
                    return int(i)
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __getstate__(self):
        return {"path": self.path, "eos_token": self._eos_token}

    def __setstate__(self, state):
        self.__init__(state["path"], state["eos_token"])


def load_tokenizer(path: str | Path, eos_token: str | None = None) -> Tokenizer:
    """A sentencepiece ``.model`` or an HF ``tokenizer.json`` (file or directory)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such tokenizer (train one with `orthon tokenizer train`)")
    if path.is_dir() or path.suffix == ".json":
        return HFTokenizer(path, eos_token)
    try:
        return SentencePieceTokenizer(path)
    except (RuntimeError, OSError) as exc:
        raise DataError(f"{path}: not a sentencepiece model: {exc}") from None


def sample_lines(documents: Iterable[str], max_lines: int, seed: int) -> list[str]:
    """A seeded uniform sample (reservoir) of at most ``max_lines`` non-blank lines."""
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for doc in documents:
        for line in doc.split("\n"):
            if not line.strip():
                continue
            line = line[:_MAX_SENTENCE_CHARS]
            if len(sample) < max_lines:
                sample.append(line)
            else:
                j = rng.randrange(seen + 1)
                if j < max_lines:
                    sample[j] = line
            seen += 1
    return sample


def train_sentencepiece(
    sentences: Sequence[str],
    output: str | Path,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    character_coverage: float = 0.9995,
    special_tokens: Sequence[str] = (),
    seed: int = 0,
    threads: int = 0,
) -> Path:
    """Train on ``sentences`` (lines); writes ``output`` (.model) and its .vocab beside it, atomically."""
    import sentencepiece as spm

    if not sentences:
        raise DataError("no training text: every input was empty")
    output = Path(output)
    if output.suffix != ".model":
        output = output.with_suffix(".model")
    output.parent.mkdir(parents=True, exist_ok=True)
    prefix = tmp_path(output.with_suffix(""))
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_prefix=str(prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            # Keep text exactly as written: no NFKC, no whitespace collapsing (code needs its indentation).
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            byte_fallback=True,
            user_defined_symbols=["\n", "\t", *special_tokens],
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
            max_sentence_length=4 * _MAX_SENTENCE_CHARS,
            input_sentence_size=0,
            num_threads=threads or os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise DataError(f"sentencepiece training failed: {exc}") from None
    os.replace(prefix.with_name(prefix.name + ".vocab"), output.with_suffix(".vocab"))
    os.replace(prefix.with_name(prefix.name + ".model"), output)
    return output


def _or_none(i: int) -> int | None:
    return None if i < 0 else int(i)


def _token_name(value) -> str | None:
    if isinstance(value, dict):  # {"content": "</s>", ...} in some tokenizer_config.json files
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def train_from_files(cfg) -> Path:
    """``orthon tokenizer train``: sample lines from the inputs (a TokenizerTrainConfig) and train."""
    from orthon.data.sources import expand_inputs, iter_texts

    files = expand_inputs(cfg.inputs)
    lines = sample_lines(iter_texts(files, cfg.read), cfg.max_sentences, cfg.seed)
    return train_sentencepiece(lines, cfg.output, cfg.vocab_size, model_type=cfg.model_type,
                               character_coverage=cfg.character_coverage, special_tokens=cfg.special_tokens,
                               seed=cfg.seed, threads=cfg.threads)
