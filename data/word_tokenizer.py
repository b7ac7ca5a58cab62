"""A fixed word-level tokenizer over a small vocabulary, written as a Hugging Face ``tokenizer.json``.

For generated corpora whose every word is known in advance (``orthon.data.retrieval``): each
vocabulary word is one token, every other character (digit, space, newline, punctuation) its own
token, and decoding concatenates the pieces, so ``decode(encode(text)) == text`` for text made of the
vocabulary. Nothing is trained: the same word list always gives the same ids. A word missing from the
list becomes ``<unk>`` (one per run of letters).

The file loads through ``orthon.data.tokenizer.load_tokenizer`` like any ``tokenizer.json``; the
special tokens take the ids of the sentencepiece models (unk 0, bos 1, eos 2, pad 3).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from orthon.core.errors import DataError
from orthon.core.files import atomic_write_text

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, as data.tokenizer's UNK/BOS/EOS/PAD_ID
_WORD = re.compile(r"[A-Za-z]+")


def word_vocabulary(words: Sequence[str], symbols: Sequence[str]) -> list[str]:
    """Special tokens, then ``symbols`` (single characters), then ``words`` (runs of letters), each once."""
    for s in symbols:
        if len(s) != 1 or _WORD.fullmatch(s):
            raise DataError(f"word tokenizer: symbol {s!r} must be one character that is not a letter")
    for w in words:
        if not _WORD.fullmatch(w):
            raise DataError(f"word tokenizer: word {w!r} must be letters only")
    return list(dict.fromkeys([*SPECIAL_TOKENS, *symbols, *words]))


def split_pattern(words: Sequence[str]) -> str:
    """The pre-tokenizer's regex: known words (longest first, so that ``INDEX`` wins over ``ID``), then any
    other run of letters (one unknown word), then any single other character."""
    known = sorted({w for w in words}, key=lambda w: (-len(w), w))
    return "|".join([*map(re.escape, known), "[A-Za-z]+", r"[^A-Za-z]"])


def write_word_tokenizer(path: str | Path, words: Sequence[str], symbols: Sequence[str]) -> Path:
    """Write the tokenizer.json of ``word_vocabulary(words, symbols)`` to ``path`` (atomically)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = word_vocabulary(words, symbols)
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(split_pattern(words)), behavior="isolated")
    tok.decoder = decoders.Fuse()  # pieces join with nothing between them: spaces are tokens of their own
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, tok.to_str(pretty=True))
    return path
