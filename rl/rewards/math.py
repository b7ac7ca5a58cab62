"""Binary math reward: 1.0 if the response's final answer equals the label, else 0.0.

The final answer is the last ``\\boxed{...}`` (or ``\\fbox{...}``); failing
that, what follows the last "answer:" / "answer is" / "####" on its line;
failing that, the last number in the text. Equality is decided by
Hugging Face's ``math-verify`` (LaTeX and plain expressions, sets, intervals,
units) when it is installed, after a cheap normalised exact match; without
it, by exact match and then a small, whitelisted sympy comparison.

math-verify times its own parsing with signal.alarm, which only works in the
main thread; in any other thread its timeouts are switched off and the
caller's timeout (orthon.rl.rewards.registry) is the guard.
"""
from __future__ import annotations

import re
import threading

try:  # optional: the maintained verifier (pip install math-verify)
    import math_verify
except ImportError:  # pragma: no cover - exercised where math-verify is absent
    math_verify = None

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_MARK = re.compile(r"(?:final\s+answer|answer)\s*(?:is\s*:?|:|=)\s*|####\s*", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with balanced braces."""
    found = None
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found = text[start:i]
                    break
    return found


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None if it states none."""
    if not isinstance(text, str) or not text.strip():
        return None
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    marks = list(_ANSWER_MARK.finditer(text))
    if marks:
        rest = text[marks[-1].end():].split("\n", 1)[0].strip().strip("$").strip()
        rest = rest.rstrip(".").strip()
        if rest:
            return rest
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(" ", "") if numbers else None


def normalize(answer: str) -> str:
    """Spelling-only normalisation for exact match: spaces, $, \\left/\\right, thousands commas,
    \\text{}, a trailing period, \\dfrac/\\tfrac -> \\frac, and trailing zeros of decimals."""
    s = str(answer).strip().strip("$").strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)
    s = re.sub(r"^(-?\d+\.\d*?)0+$", r"\1", s)
    return s


# Sympy fallback: only text made of these pieces is handed to sympy's parser (it evaluates its
# input with eval, so model output must not reach it unchecked).
_SAFE_EXPR = re.compile(r"^[0-9a-z.+\-*/^() ]+$")
_SAFE_WORDS = re.compile(r"[a-z]{2,}")


def _latex_to_plain(s: str) -> str:
    s = normalize(s)
    for _ in range(5):  # nested fractions
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("{", "(").replace("}", ")")
    return s


def _sympy_equal(a: str, b: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import parse_expr

    exprs = []
    for text in (a, b):
        plain = _latex_to_plain(text)
        if len(plain) > 200 or not _SAFE_EXPR.match(plain):
            return False
        if any(w not in ("sqrt", "pi") for w in _SAFE_WORDS.findall(plain)):
            return False
        try:
            exprs.append(parse_expr(plain.replace("^", "**"), evaluate=True))
        except Exception:
            return False
    try:
        diff = sympy.simplify(exprs[0] - exprs[1])
        if diff == 0:
            return True
        value = complex(diff.evalf()) if not diff.free_symbols else None
        return value is not None and abs(value) <= 1e-6 * max(1.0, abs(complex(exprs[1].evalf())))
    except Exception:
        return False


def _verify(label: str, candidate: str) -> bool | None:
    """math-verify's verdict, or None when it is absent or fails."""
    if math_verify is None:
        return None
    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None
    try:
        gold = math_verify.parse(f"\\boxed{{{label}}}", parsing_timeout=timeout)
        pred = math_verify.parse(f"\\boxed{{{candidate}}}", parsing_timeout=timeout)
        if not gold or not pred:
            return None
        return bool(math_verify.verify(gold, pred, timeout_seconds=timeout))
    except Exception:
        return None


def answers_match(candidate: str, label: str) -> bool:
    """Whether two final answers are mathematically the same."""
    if normalize(candidate) == normalize(label):
        return True
    verdict = _verify(label, candidate)
    if verdict is not None:
        return verdict
    return _sympy_equal(candidate, label)


def math_reward(response: str, label) -> float:
    """1.0 if the final answer of ``response`` equals ``label`` (a string or number), else 0.0."""
    candidate = extract_answer(response)
    if candidate is None:
        return 0.0
    label = str(label)
    boxed_label = _last_boxed(label)
    if boxed_label is not None:
        label = boxed_label
    return 1.0 if answers_match(candidate, label.strip()) else 0.0
