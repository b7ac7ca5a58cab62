"""Stop strings: generation ends once the response's text contains one of them (SGLang's ``stop``).

Stop tokens end a response at a token id; a stop string ends it at text, which a tool-calling rollout
or an evaluation often needs ("</tool_call>", "\\n\\n") where no single token spells it. As in SGLang,
the check reads the decoded text of the response only (never the prompt), after each new token; the
token whose text completes the string is the last one of the response, kept with its log-prob, and
the result names the string (``GenerationResult.matched_stop``). The answer's text is cut before the
string unless the caller asks to keep it (``trim_at_stop``).

Each check decodes only the response's last tokens: enough of them to hold the longest stop string
(a character takes at most 4 byte tokens) plus a few, so a string that the newest token completes
always lies inside the window, whatever its length in tokens, and the cost per step does not grow
with the response.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

# Tokens decoded beyond 4 a character: a piece that decodes with a leading space dropped (sentencepiece
# strips it at the start of a text) or to nothing must not hide a string's first characters.
_SLACK_TOKENS = 4


def first_stop(text: str, stops: Sequence[str]) -> str | None:
    """The first of ``stops`` (in the caller's order, as SGLang checks them) that occurs in ``text``."""
    return next((s for s in stops if s in text), None)


def trim_at_stop(text: str, stop: str | None) -> str:
    """``text`` up to (without) the first occurrence of ``stop``; unchanged when it does not occur."""
    at = -1 if not stop else text.find(stop)
    return text if at < 0 else text[:at]


def response_text(result, decode) -> str:
    """A GenerationResult's response as text for a reader: without the stop token or the stop string
    that ended it (``decode``: the tokenizer's)."""
    if result.matched_stop is not None:
        return trim_at_stop(decode(result.tokens), result.matched_stop)
    return decode(result.tokens[:-1] if result.finish_reason == "stop" else result.tokens)


def settled_text(text: str, stops: Sequence[str]) -> str:
    """The part of a growing response's text that can be shown: not a character still being decoded (a
    trailing U+FFFD), nor the last characters that may yet begin a stop string."""
    text = text.rstrip("\ufffd")
    hold = max((len(s) - 1 for s in stops), default=0)
    return text[: len(text) - hold] if hold else text


class StopStringWatch:
    """The rows of a decode wave that have stop strings, checked after each step."""

    def __init__(self, stops_by_row: Sequence[Sequence[str]], decode: Callable[[list[int]], str] | None):
        self.rows: dict[int, tuple[tuple[str, ...], int]] = {}
        self.decode = decode
        self.matched: dict[int, str] = {}  # wave row -> the stop string that ended it
        self.add(0, stops_by_row)

    def add(self, first_row: int, stops_by_row: Sequence[Sequence[str]]) -> None:
        """Watch rows ``first_row``, ``first_row + 1``, ... for their stop strings (rows joining a wave)."""
        for row, stops in enumerate(stops_by_row, first_row):
            if stops:
                if self.decode is None:
                    raise ValueError("stop strings need a tokenizer to read the response's text")
                self.rows[row] = (tuple(stops), 4 * max(map(len, stops)) + _SLACK_TOKENS)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def check(self, live: torch.Tensor, out_tokens: torch.Tensor, counts, skip: torch.Tensor) -> torch.Tensor:
        """(len(live),) bool: which live rows' responses (``out_tokens[row, :count]``, ``counts`` the
        tokens each has made, or one int for all) now contain one of their stop strings; records the string of each. Rows
        where ``skip`` is set are not read."""
        hits = torch.zeros(len(live), dtype=torch.bool)
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else [counts] * len(live)
        for i, (row, count, skipped) in enumerate(zip(live.tolist(), counts, skip.tolist())):
            entry = self.rows.get(row)
            if entry is None or skipped:
                continue
            stops, window = entry
            text = self.decode(out_tokens[row, max(0, count - window): count].tolist())
            found = first_stop(text, stops)
            if found is not None:
                self.matched[row] = found
                hits[i] = True
        return hits.to(live.device)
