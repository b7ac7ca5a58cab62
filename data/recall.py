"""Generated retrieval documents, three styles, each made from real code:

- code (``make_recall_document``): a window of a code file with a few definitions
  ``\\nNAME = 48213\\n`` inserted at random line boundaries, each restated, name and value alike, at a
  later line boundary, the distance log-uniform in lines: retrieval over any distance, in code;
- kv (``make_kv_document``): a list of ``NAME = 48213`` lines, then the same lines shuffled:
  associative recall, the value found by its name alone;
- copy (``make_copy_document``): lines of words, each followed by its exact repeat: the plainest
  signal for an induction (copy) head.

Long-context mid-training mixes in synthetic retrieval so that a model learns to use far context, not
only nearby text. In every style the value (or repeated word) is unpredictable except by copying it
from earlier in the document.

Names are drawn from ``NAME_WORDS`` (one to three words joined by ``_``) and, in the kv style, from the
code's identifiers; ``PASSKEY``, the name that the passkey evaluation (``orthon.midtrain.eval``) asks
about, is never drawn, so that evaluation tests whether retrieval generalises to a new name.
"""
from __future__ import annotations

import math
import random
import re

NAME_WORDS = (
    "ALPHA", "BETA", "GAMMA", "DELTA", "OMEGA", "SIGMA", "API", "AUTH", "SECRET", "TOKEN", "CODE", "PIN",
    "PORT", "HOST", "USER", "GROUP", "MAGIC", "SEED", "LIMIT", "COUNT", "INDEX", "OFFSET", "SERIAL",
    "ORDER", "TICKET", "ROOM", "BADGE", "VAULT", "LOCK", "DOOR", "GATE", "ZONE", "CELL", "NODE", "SLOT",
    "BLOCK", "ID", "NUM", "REF", "TAG", "MARK", "SIGN", "BASE", "ROOT", "MAIN", "LAST", "FIRST", "NEXT",
)
EXCLUDED_NAMES = frozenset({"PASSKEY", "PASS_KEY"})
SMALL_VOCAB = NAME_WORDS + tuple("0123456789")


def make_name(rng: random.Random, words: tuple[str, ...] = NAME_WORDS) -> str:
    """One to three of ``words`` joined by ``_``, never one of EXCLUDED_NAMES."""
    while True:
        name = "_".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
        if name not in EXCLUDED_NAMES:
            return name


def make_recall_document(rng: random.Random, code: str, min_chars: int = 300, max_chars: int = 12_000,
                         chars_per_pair: int = 400, digits: int = 5) -> str:
    """A window of ``code`` (its length log-uniform in [min_chars, max_chars], cut at line boundaries)
    with ``max(1, len // chars_per_pair)`` definitions and their restatements inserted."""
    lines = code.splitlines()
    if not lines:
        raise ValueError("make_recall_document: empty code")
    target = math.exp(rng.uniform(math.log(min_chars), math.log(max_chars)))
    window = _window(rng, lines, target)  # wraps around: a short file still fills the window
    size = sum(len(line) + 1 for line in window)
    n_pairs = max(1, int(size // chars_per_pair))
    # Slots are line boundaries 0..len(window); a definition goes at slot a, its restatement at b > a
    # (both inserted before line a / b of the window), so the restatement always comes later.
    inserts: dict[int, list[str]] = {}
    names: set[str] = set()
    for _ in range(n_pairs):
        name = make_name(rng)
        while name in names:  # one value per name within a document
            name = make_name(rng)
        names.add(name)
        value = "".join(rng.choice("0123456789") for _ in range(digits))
        a = rng.randrange(len(window))
        # The distance in lines is log-uniform: near restatements (learnable within a short training
        # sequence) are as common per octave as far ones (which only long sequences contain).
        b = min(len(window), a + math.ceil(math.exp(rng.uniform(0.0, math.log(len(window) - a + 1)))))
        inserts.setdefault(a, []).append(f"{name} = {value}")
        inserts.setdefault(b, []).append(f"{name} = {value}")
    out = []
    for i in range(len(window) + 1):
        out += inserts.get(i, [])
        if i < len(window):
            out.append(window[i])
    return "\n".join(out) + "\n"


_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,24}\b")


def make_copy_document(rng: random.Random, code: str, min_words: int = 4, max_words: int = 48,
                       blocks: int = 4, small_vocab_share: float = 0.5) -> str:
    """``blocks`` lines of random words, each line followed by its exact repeat. The repeat is
    predictable only by copying the line above, token by token: the plainest signal for an induction
    head, over natural tokens and within a short training sequence."""
    identifiers = _identifiers(code) or list(NAME_WORDS)
    out = []
    for _ in range(blocks):
        n = round(math.exp(rng.uniform(math.log(min_words), math.log(max_words))))
        # Half the lines draw from a small vocabulary (NAME_WORDS and digits, about 60 tokens, the
        # pieces recall values are made of), where copying needs only a small token-to-same-token map;
        # the other half from the code's identifiers, so copying is not tied to that vocabulary.
        vocab = SMALL_VOCAB if rng.random() < small_vocab_share else identifiers
        line = " ".join(rng.choice(vocab) for _ in range(n))
        out += [line, line]
    return "\n".join(out) + "\n"


def make_kv_document(rng: random.Random, code: str, min_pairs: int = 2, max_pairs: int = 16, digits: int = 5) -> str:
    """A list of ``NAME = 48213`` lines, then every line again in a shuffled order: associative
    recall, the value after a restated name found by the name alone. Names mix ``NAME_WORDS``
    compounds with identifiers taken from ``code``, so the lookup is not tied to a small set of names."""
    identifiers = _identifiers(code)
    n = round(math.exp(rng.uniform(math.log(min_pairs), math.log(max_pairs))))
    pairs: dict[str, str] = {}
    while len(pairs) < n:
        name = rng.choice(identifiers) if identifiers and rng.random() < 0.5 else make_name(rng)
        pairs.setdefault(name, "".join(rng.choice("0123456789") for _ in range(digits)))
    lines = [f"{k} = {v}" for k, v in pairs.items()]
    restated = lines[:]
    rng.shuffle(restated)
    return "\n".join(lines + restated) + "\n"


def _identifiers(code: str) -> list[str]:
    """The code's distinct identifiers (3 to 25 characters), sorted, the passkey's names left out."""
    return sorted(set(_IDENTIFIER.findall(code)) - EXCLUDED_NAMES)


def _window(rng: random.Random, lines: list[str], chars: float) -> list[str]:
    """Whole lines from a random start (wrapping around) until they hold ``chars`` characters."""
    start = rng.randrange(len(lines))
    out, size = [], 0
    for line in lines[start:] + lines[:start]:
        if size >= chars:
            break
        out.append(line)
        size += len(line) + 1
    return out


RECALL_STYLES = ("code", "kv", "copy")


def make_mixed_recall_document(rng: random.Random, code: str, mix: dict[str, float]) -> str:
    """One recall document of a style drawn with the shares in ``mix`` ({style: share})."""
    styles = [s for s in RECALL_STYLES if mix.get(s, 0) > 0]
    style = rng.choices(styles, weights=[mix[s] for s in styles])[0]
    return {"code": make_recall_document, "kv": make_kv_document, "copy": make_copy_document}[style](rng, code)
