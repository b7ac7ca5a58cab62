"""Generated retrieval documents over a small vocabulary: the built-in corpus of a model built to retrieve
(``configs/retrieval_tiny.yaml``).

Every word is one token of the fixed word tokenizer (``orthon.data.word_tokenizer`` over ``WORDS`` and
``SYMBOLS``, about a hundred tokens), so a short context holds many retrieval items and a copy
(induction) head forms in few steps (the code-and-arithmetic corpus at 4,096 pieces needs several times
more). Documents are sized in tokens (``count_tokens``), so a corpus can be made for a training length:

- kv: ``NAME = 48213`` lines, then every line again in a shuffled order: associative recall, the value
  found by its name among the other pairs;
- copy: spans of random pieces, each written twice in a row: the plainest induction signal;
- haystack: filler sentences with one to three needle lines ``NAME = 48213`` at random depths, and at the
  end the needles restated in a random order: the passkey task, with other names;
- filler: sentences alone, the haystack the passkey evaluation (``orthon.midtrain.eval``) inserts its
  needle into.

Names are one to three ``NAME_WORDS`` joined by ``_`` (``orthon.data.recall.make_name``); the words
include ``PASS`` and ``KEY`` but a name is never ``PASSKEY`` (nor ``PASS_KEY``): the evaluation asks
for ``PASSKEY`` (the tokens ``PASS KEY``, never adjacent in training), a name the model has not seen.
"""
from __future__ import annotations

import math
import random
import re

from orthon.data.recall import NAME_WORDS as CODE_NAME_WORDS
from orthon.data.recall import make_name
from orthon.data.word_tokenizer import split_pattern

NAME_WORDS = CODE_NAME_WORDS + ("PASS", "KEY")
NOUNS = ("grass", "sky", "sun", "sea", "tree", "road", "house", "river", "stone", "cloud", "bird", "wind")
ADJECTIVES = ("green", "blue", "yellow", "calm", "tall", "long", "old", "wide", "grey", "white", "small", "fast")
FILLER_WORDS = NOUNS + ADJECTIVES + ("the", "is", "are", "and", "here", "we", "go", "there", "back", "again")
WORDS = NAME_WORDS + FILLER_WORDS
DIGITS = "0123456789"
SYMBOLS = tuple(DIGITS) + (" ", "\n", "=", "_", ".")
COPY_PIECES = WORDS + tuple(s for s in SYMBOLS if s != "\n")  # what copy lines are made of
STYLES = ("kv", "copy", "haystack")

_PIECE = re.compile(split_pattern(WORDS))


def count_tokens(text: str) -> int:
    """Tokens of ``text`` under the word tokenizer of WORDS and SYMBOLS (exact for text made of them)."""
    return len(_PIECE.findall(text))


def make_value(rng: random.Random, digits: int) -> str:
    return "".join(rng.choice(DIGITS) for _ in range(digits))


def _pairs(rng: random.Random, n: int, digits: int) -> list[str]:
    """``n`` lines ``NAME = 48213`` with distinct names."""
    names: dict[str, None] = {}
    while len(names) < n:
        names[make_name(rng, NAME_WORDS)] = None
    return [f"{name} = {make_value(rng, digits)}" for name in names]


def filler_sentence(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return "here we go."
    if kind == 1:
        return "there and back again."
    if kind == 2:
        return f"the {rng.choice(NOUNS)} is {rng.choice(ADJECTIVES)}."
    return f"the {rng.choice(NOUNS)} and the {rng.choice(NOUNS)} are {rng.choice(ADJECTIVES)}."


def filler_sentences(rng: random.Random, tokens: int) -> list[str]:
    """Sentences that, joined by spaces, hold at most ``tokens`` tokens (at least one sentence), stopping
    at the first that would not fit."""
    out, used = [], -1
    while True:
        sentence = filler_sentence(rng)
        used += count_tokens(sentence) + 1
        if out and used > tokens:
            return out
        out.append(sentence)


def make_filler_document(rng: random.Random, tokens: int) -> str:
    """Filler sentences, at most ``tokens`` tokens with the closing newline."""
    return " ".join(filler_sentences(rng, tokens - 1)) + "\n"


def make_kv_document(rng: random.Random, tokens: int, digits: int = 5) -> str:
    """Pairs, then all of them again shuffled; as many pairs as fit ``tokens`` (at least one)."""
    per_pair = 2 * (3 + 3 + digits + 1)  # name (two words and "_" on average), " = ", value, newline; twice
    lines = _pairs(rng, max(1, tokens // per_pair), digits)
    restated = lines[:]
    rng.shuffle(restated)
    return "\n".join(lines + restated) + "\n"


def make_copy_document(rng: random.Random, tokens: int, min_pieces: int = 4, max_pieces: int = 48) -> str:
    """Lines, each a span of random pieces (words, digits, symbols; their count log-uniform in
    [min_pieces, max_pieces]) written twice in a row without a separator, until the next line would
    pass ``tokens`` (at least one line).

    Nothing marks where the repeat starts and nothing separates the pieces, so the repeat is
    predictable only by the plain induction circuit (current token -> its earlier occurrence -> the
    token after it): not by a fixed offset (a line repeated on the next line can be copied from the
    same position one line up), nor by matching the token two back (as spaced words need)."""
    out, used = [], 0
    while True:
        n = round(math.exp(rng.uniform(math.log(min_pieces), math.log(max_pieces))))
        span = "".join(rng.choice(COPY_PIECES) for _ in range(n))
        cost = count_tokens(span + span) + 1
        if out and used + cost > tokens:
            break
        out.append(span + span)
        used += cost
    return "\n".join(out) + "\n"


def make_haystack_document(rng: random.Random, tokens: int, digits: int = 5, max_needles: int = 3) -> str:
    """Filler sentences with 1..max_needles needle lines at random sentence boundaries (uniform in depth),
    then the needles restated in a random order, about ``tokens`` tokens in all."""
    needles = _pairs(rng, rng.randint(1, max_needles), digits)
    # Each needle: its line and a newline twice (placed, restated), and one more newline where placed.
    needle_tokens = sum(2 * count_tokens(line) + 3 for line in needles)
    sentences = filler_sentences(rng, tokens - needle_tokens)
    at: dict[int, list[str]] = {}
    for line in needles:
        at.setdefault(rng.randint(0, len(sentences)), []).append(line)
    text = ""
    for i in range(len(sentences) + 1):
        if i in at:
            text += "\n" + "\n".join(at[i]) + "\n"
        elif 0 < i < len(sentences):
            text += " "
        if i < len(sentences):
            text += sentences[i]
    questions = needles[:]
    rng.shuffle(questions)
    return text.rstrip("\n") + "\n" + "\n".join(questions) + "\n"


def make_retrieval_document(rng: random.Random, mix: dict[str, float], min_tokens: int, max_tokens: int,
                            digits: int = 5) -> tuple[str, str]:
    """(style, document): the style drawn with the shares in ``mix``, the length uniform in
    [min_tokens, max_tokens] tokens."""
    styles = [s for s in STYLES if mix.get(s, 0) > 0]
    style = rng.choices(styles, weights=[mix[s] for s in styles])[0]
    tokens = rng.randint(min_tokens, max_tokens)
    if style == "copy":  # spans up to half the document: long documents copy over long distances
        return style, make_copy_document(rng, tokens, max_pieces=max(48, tokens // 2))
    make = make_kv_document if style == "kv" else make_haystack_document
    return style, make(rng, tokens, digits)
