"""Generated key-value recall documents: real code with ``NAME = 48213`` lines restated later.

Long-context mid-training data mixes in synthetic retrieval (key-value lookups across a long
document) so that a model learns to use far context, not only nearby text. A recall document here is
a window of a code file with a few definitions ``\\nNAME = 48213\\n`` inserted at random line
boundaries; each definition is restated, name and value alike, at a later line boundary, the
distance log-uniform in lines. The value after a restated name is unpredictable except by copying it
from the definition, so the document rewards an induction (copy) head over whatever distance
separates the two.

Names are drawn from ``NAME_WORDS`` (one to three words joined by ``_``); ``PASSKEY``, the name that
the passkey evaluation (``orthon.midtrain.eval``) asks about, is never drawn, so that evaluation
tests whether copying generalises to a new name.
"""
from __future__ import annotations

import math
import random

NAME_WORDS = (
    "ALPHA", "BETA", "GAMMA", "DELTA", "OMEGA", "SIGMA", "API", "AUTH", "SECRET", "TOKEN", "CODE", "PIN",
    "PORT", "HOST", "USER", "GROUP", "MAGIC", "SEED", "LIMIT", "COUNT", "INDEX", "OFFSET", "SERIAL",
    "ORDER", "TICKET", "ROOM", "BADGE", "VAULT", "LOCK", "DOOR", "GATE", "ZONE", "CELL", "NODE", "SLOT",
    "BLOCK", "ID", "NUM", "REF", "TAG", "MARK", "SIGN", "BASE", "ROOT", "MAIN", "LAST", "FIRST", "NEXT",
)
EXCLUDED_NAMES = frozenset({"PASSKEY", "PASS_KEY"})


def make_name(rng: random.Random) -> str:
    while True:
        name = "_".join(rng.choice(NAME_WORDS) for _ in range(rng.randint(1, 3)))
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
    start = rng.randrange(len(lines))
    window, size = [], 0
    for line in lines[start:] + lines[:start]:  # wrap around: a short file still fills the window
        if size >= target:
            break
        window.append(line)
        size += len(line) + 1
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
