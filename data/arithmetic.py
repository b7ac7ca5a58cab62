"""Generated integer arithmetic: text for the built-in corpus and a verifiable task for RL.

A problem is a prompt ``"Q: 37+45=? A:"`` and its answer ``"82"``; the corpus
line is ``"Q: 37+45=? A: 82"``. ``check_answer`` is the binary outcome reward
(1 pass, 0 fail) that the RL work uses on the same problems.
"""
from __future__ import annotations

import random
import re

_INTEGER = re.compile(r"-?\d+")


def make_problem(rng: random.Random, difficulty: int = 2) -> tuple[str, str]:
    """One problem at ``difficulty`` d >= 1: ``(prompt, answer)``.

    Both operands of + and - have 1..d digits (the larger comes first, so a
    difference is never negative); a product has a first operand of 1..d digits
    and a second of 1..ceil(d/2) digits, and appears only from d = 2 on. The
    draw uses only ``rng``, so a seeded ``random.Random`` gives the same problems.
    """
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")
    ops = "+-" if difficulty == 1 else "+-*"
    op = ops[rng.randrange(len(ops))]
    a = _operand(rng, difficulty)
    if op == "*":
        b = _operand(rng, (difficulty + 1) // 2)
        result = a * b
    else:
        b = _operand(rng, difficulty)
        if op == "-" and b > a:
            a, b = b, a
        result = a + b if op == "+" else a - b
    return f"Q: {a}{op}{b}=? A:", str(result)


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def format_example(prompt: str, answer: str) -> str:
    """The corpus line of a problem: ``"Q: 37+45=? A: 82"``."""
    return f"{prompt} {answer}"


def make_document(rng: random.Random, n_problems: int, max_difficulty: int = 3) -> str:
    """``n_problems`` lines of random difficulty in 1..max_difficulty, one problem per line."""
    lines = []
    for _ in range(n_problems):
        prompt, answer = make_problem(rng, rng.randint(1, max_difficulty))
        lines.append(format_example(prompt, answer))
    return "\n".join(lines) + "\n"


def extract_answer(response: str) -> str | None:
    """The first integer in a model's response (``" 82\\nQ: ..."`` -> ``"82"``), or None."""
    match = _INTEGER.search(response)
    return match.group(0) if match else None


def check_answer(response: str, answer: str) -> bool:
    """Outcome reward: the first integer of the response equals the answer."""
    got = extract_answer(response)
    return got is not None and int(got) == int(answer)
