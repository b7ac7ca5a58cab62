"""Verifiable tasks for RL, plug-ins by dotted path (``rl.task``): each turns prompts into token ids,
names its stop tokens and scores a response with a binary reward.

``ArithmeticTask`` is the built-in one: the integer arithmetic the built-in pretraining corpus
contains (``"Q: 37+45=? A:"`` -> ``" 82"``), so the tiny pretrained model can already solve part of it.
"""
from __future__ import annotations

import ast
import random
from dataclasses import dataclass

from orthon.data.arithmetic import check_answer, make_problem


@dataclass
class Prompt:
    instance_id: str
    text: str
    ids: list[int]
    label: str
    source: str = ""  # the prompt set it came from (OPD: names its teacher)


def arithmetic_reward(response: str, label: str) -> float:
    """1 when the first integer of the response is the answer, else 0."""
    return 1.0 if check_answer(response, label) else 0.0


def newline_stop_ids(tokenizer) -> tuple[int, ...]:
    """Every piece that contains a newline: a one-line answer ends at the first."""
    return tuple(i for i in range(tokenizer.vocab_size) if "\n" in tokenizer.decode([i]))


class GeneratedTask:
    """Prompts from a seeded generator (a subclass's ``_prompt(rng, instance_id)``): training prompts
    continue one stream, resumable with ``state_dict``; the eval set is the same every time."""

    def __init__(self, tokenizer, seed: int = 0, eval_size: int = 200):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self._eval_rng_seed = seed + 1_000_003
        self.eval_size = eval_size
        self.issued = 0

    def _prompt(self, rng: random.Random, instance_id: str) -> Prompt:
        raise NotImplementedError

    def sample(self, n: int) -> list[Prompt]:
        prompts = [self._prompt(self.rng, f"train-{self.issued + i}") for i in range(n)]
        self.issued += n
        return prompts

    def eval_set(self) -> list[Prompt]:
        rng = random.Random(self._eval_rng_seed)
        return [self._prompt(rng, f"eval-{i}") for i in range(self.eval_size)]

    def state_dict(self) -> dict:
        return {"rng": repr(self.rng.getstate()), "issued": self.issued}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(ast.literal_eval(state["rng"]))  # state_dict's repr() of the state tuple
        self.issued = state["issued"]


class ArithmeticTask(GeneratedTask):
    task_type = "arithmetic"
    reward_fn = staticmethod(arithmetic_reward)

    def __init__(self, tokenizer, seed: int = 0, difficulty: int = 2, eval_size: int = 200, min_difficulty: int = 1):
        """Problems of a difficulty drawn uniformly from [min_difficulty, difficulty] (see make_problem)."""
        if not 1 <= min_difficulty <= difficulty:
            raise ValueError(f"ArithmeticTask: need 1 <= min_difficulty <= difficulty, got {min_difficulty}, {difficulty}")
        super().__init__(tokenizer, seed, eval_size)
        self.difficulty = difficulty
        self.min_difficulty = min_difficulty
        self.stop_token_ids = newline_stop_ids(tokenizer)

    def _prompt(self, rng: random.Random, instance_id: str) -> Prompt:
        text, answer = make_problem(rng, rng.randint(self.min_difficulty, self.difficulty))
        return Prompt(instance_id, text, self.tokenizer.encode(text), answer)
