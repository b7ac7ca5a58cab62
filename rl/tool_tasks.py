"""Built-in tasks whose answers need a tool, and demonstrations of the tool for SFT.

``ToolArithmeticTask``: products of two 3-5 digit numbers ("Q: 4821*739=? A:"), which the tiny models
cannot do by heart but a calculator call answers; the reward is the arithmetic task's (the first
integer of the final answer). ``tool_demonstrations`` writes conversations that solve such problems
with one ``calculator`` call and copy its output into the answer: SFT on them teaches the call
format, after which agentic RL (orthon.rl.multi_turn) trains when and how to call.
"""
from __future__ import annotations

import random

from orthon.rl.chat import Message
from orthon.rl.tasks import ArithmeticTask, Prompt


def big_product(rng: random.Random, min_digits: int = 3, max_digits: int = 5) -> tuple[str, str]:
    a = rng.randint(10 ** (min_digits - 1), 10 ** rng.randint(min_digits, max_digits) - 1)
    b = rng.randint(10 ** (min_digits - 1), 10 ** rng.randint(min_digits, max_digits) - 1)
    return f"Q: {a}*{b}=? A:", str(a * b)


class ToolArithmeticTask(ArithmeticTask):
    task_type = "tool_arithmetic"

    def __init__(self, tokenizer, seed: int = 0, eval_size: int = 200, min_digits: int = 3, max_digits: int = 5):
        super().__init__(tokenizer, seed=seed, difficulty=2, eval_size=eval_size)
        self.min_digits, self.max_digits = min_digits, max_digits

    def _prompt(self, rng: random.Random, instance_id: str) -> Prompt:
        text, answer = big_product(rng, self.min_digits, self.max_digits)
        return Prompt(instance_id, text, self.tokenizer.encode(text), answer)


def tool_demonstration(question: str, answer: str) -> list[Message]:
    expression = question.removeprefix("Q: ").removesuffix("=? A:")
    return [Message("user", question),
            Message("assistant", f"```python tool_name=calculator\nprint({expression})\n```", thinking=""),
            Message("observation", answer),
            Message("assistant", answer, thinking="")]


def tool_demonstrations(tokenizer, n: int, seed: int = 0, min_digits: int = 3, max_digits: int = 5) -> list[list[Message]]:
    """``n`` conversations solving big products with one calculator call (seeded; never the held-out set's
    problems, which ToolArithmeticTask draws from another seed)."""
    rng = random.Random(seed * 31 + 17)
    return [tool_demonstration(*big_product(rng, min_digits, max_digits)) for _ in range(n)]
