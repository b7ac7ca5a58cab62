"""Quality filters: plug-in scorers named by dotted path.

A scorer is any callable ``text -> float`` (higher is better), named as
``package.module.function`` or ``package.module:function``. A class named that
way is instantiated with the filter's kwargs and its instances called; a
function gets the kwargs as keyword arguments on every call. A document is kept
when every filter scores it at or above that filter's ``min_score``.

``heuristic_quality`` is the built-in scorer: the fraction of simple
document-level rules (word count, word length, symbol share, repeated lines,
line length, control characters) that a document passes, in [0, 1].
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Callable, Sequence

from orthon.data.config import FilterConfig
from orthon.core.errors import ConfigError
from orthon.core.plugins import resolve as resolve_plugin

_WORD = re.compile(r"\w+")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def heuristic_quality(
    text: str,
    *,
    min_words: int = 5,
    max_mean_word_length: float = 20.0,
    min_alnum_space_fraction: float = 0.5,
    max_duplicate_line_fraction: float = 0.5,
    max_line_chars: int = 5000,
    max_control_fraction: float = 0.01,
) -> float:
    """Fraction of six rules the document passes (1.0: all).

    1. at least ``min_words`` words;
    2. mean word length at most ``max_mean_word_length`` (catches base64, hashes, minified blobs);
    3. letters, digits and whitespace make up at least ``min_alnum_space_fraction`` of the characters;
    4. at most ``max_duplicate_line_fraction`` of non-blank lines repeat an earlier line;
    5. no line longer than ``max_line_chars``;
    6. control characters (other than tab/newline/CR) at most ``max_control_fraction`` of the text.
    """
    n = len(text)
    if n == 0:
        return 0.0
    words = _WORD.findall(text)
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    mean_word = sum(map(len, words)) / len(words) if words else 0.0
    alnum_space = sum(1 for ch in text if ch.isalnum() or ch.isspace()) / n
    duplicate = (len(lines) - len(set(lines))) / len(lines) if lines else 0.0
    longest = max((len(line) for line in text.split("\n")), default=0)
    rules = [
        len(words) >= min_words,
        mean_word <= max_mean_word_length,
        alnum_space >= min_alnum_space_fraction,
        duplicate <= max_duplicate_line_fraction,
        longest <= max_line_chars,
        len(_CONTROL.findall(text)) / n <= max_control_fraction,
    ]
    return sum(rules) / len(rules)


def resolve(dotted: str) -> object:
    """The scorer at ``package.module.name`` or ``package.module:name``."""
    return resolve_plugin(dotted, "filter")


def load_scorer(config: FilterConfig) -> Callable[[str], float]:
    obj = resolve(config.path)
    if inspect.isclass(obj):
        obj = obj(**config.kwargs)
    elif config.kwargs:
        obj = functools.partial(obj, **config.kwargs)
    if not callable(obj):
        raise ConfigError(f"{config.path!r}: scorer is not callable")
    return obj


class FilterChain:
    """Several scorers; ``reject(text)`` is the name of the first filter a document fails, or None."""

    def __init__(self, configs: Sequence[FilterConfig]):
        self.configs = list(configs)
        self.scorers = [load_scorer(c) for c in self.configs]
        self.names = [c.path.replace(":", ".").rsplit(".", 1)[-1] for c in self.configs]

    def reject(self, text: str) -> str | None:
        for config, scorer, name in zip(self.configs, self.scorers, self.names):
            score = float(scorer(text))
            if not score >= config.min_score:  # also rejects NaN
                return f"filtered:{name}"
        return None

    def __bool__(self) -> bool:
        return bool(self.scorers)
