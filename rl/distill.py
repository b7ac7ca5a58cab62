"""On-policy distillation (OPD): the student samples, each prompt's own teacher scores the tokens.

``MixedTask`` is the prompt source: one task per teacher (``rl.opd.teachers``), prompts drawn from
the sets by their ratios with a seeded generator, each prompt tagged with its set (``Prompt.source``,
and the set's name leads its instance id). ``opd_rollout`` is the rollout plug-in: the student
samples ``group_size`` (1 in the recipe) responses per prompt through the engine, each set's prompts
through that set's own rollout (single-turn, or a tool set's multi-turn rollout), then the teacher of
the prompt's set, and only that teacher, gives the fp32 log-prob of every response token
(``Sample.teacher_log_probs``; a tool observation's tokens are scored too but masked out of the loss).
The policy step turns them into per-token advantages (form 2: sg[log pi_T - log pi_S]; reverse KL,
mode seeking) with no outcome reward. Teachers run in the
rollout's process (``orthon.pretrain.logprobs.sequence_log_probs`` on their weights, loaded once).
"""
from __future__ import annotations

import ast
import dataclasses
import random
import threading

import torch

from orthon.core.errors import ConfigError
from orthon.core.plugins import resolve
from orthon.rl.logprobs import sample_log_probs
from orthon.rl.rollout import RolloutContext, single_turn
from orthon.rl.sample import Sample
from orthon.rl.tasks import Prompt


class MixedTask:
    """Prompts from several tasks by ratio (one per OPD teacher). ``sets``: [{name, task, task_args, ratio}]."""

    task_type = "opd"

    def __init__(self, tokenizer, seed: int = 0, sets=(), eval_size: int | None = None):
        if not sets:
            raise ConfigError("MixedTask: needs at least one prompt set (rl.opd.teachers)")
        self.names = [s["name"] for s in sets]
        self.tasks = {s["name"]: resolve(s["task"], f"teacher {s['name']}: task")(tokenizer, seed=seed + i, **s.get("task_args", {}))
                      for i, s in enumerate(sets)}
        total = float(sum(s.get("ratio", 1.0) for s in sets))
        self.weights = [s.get("ratio", 1.0) / total for s in sets]
        self.rng = random.Random(seed * 65_537 + 11)
        first = self.tasks[self.names[0]]
        self.stop_token_ids = first.stop_token_ids
        self.eval_size = eval_size

    def _tag(self, name: str, prompt: Prompt) -> Prompt:
        return Prompt(f"{name}/{prompt.instance_id}", prompt.text, prompt.ids, [name, prompt.label], source=name)

    def sample(self, n: int) -> list[Prompt]:
        names = self.rng.choices(self.names, weights=self.weights, k=n)
        return [self._tag(name, self.tasks[name].sample(1)[0]) for name in names]

    def eval_set(self) -> list[Prompt]:
        return [self._tag(name, p) for name, task in self.tasks.items() for p in task.eval_set()[: self.eval_size]]

    def reward_fn(self, response: str, label) -> float:
        """The reward of the prompt's own task (labels carry their set's name)."""
        name, inner = label
        return self.tasks[name].reward_fn(response, inner)

    def state_dict(self) -> dict:
        return {"rng": repr(self.rng.getstate()), "tasks": {n: t.state_dict() for n, t in self.tasks.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(ast.literal_eval(state["rng"]))  # state_dict's repr() of the state tuple
        for name, task_state in state["tasks"].items():
            self.tasks[name].load_state_dict(task_state)


_teachers: dict[str, torch.nn.Module] = {}
_teachers_lock = threading.Lock()


def teacher_model(weights: str) -> torch.nn.Module:
    """A teacher's model, loaded once per process and kept frozen."""
    from orthon.pretrain.weights import load_weights

    with _teachers_lock:
        if weights not in _teachers:
            _teachers[weights] = load_weights(weights).eval().requires_grad_(False)
        return _teachers[weights]


@torch.no_grad()
def teacher_log_probs(model, samples: list[Sample]) -> list[torch.Tensor]:
    """The teacher's fp32 log-prob of each sample's response tokens."""
    out = sample_log_probs(model, samples)
    return [out.log_probs[b, : s.response_length].float().clone() for b, s in enumerate(samples)]


def opd_rollout(ctx: RolloutContext, prompts) -> list[Sample]:
    """The student's samples (``student_samples``), then every sample scored by its prompt's teacher.
    ``ctx.options["teachers"]``: {set name: weights directory} (the trainer fills it from rl.opd)."""
    teachers = ctx.options.get("teachers") or {}
    samples = student_samples(ctx, prompts)
    by_teacher: dict[str, list[Sample]] = {}
    for prompt, sample in zip((p for p in prompts for _ in range(ctx.group_size)), samples):
        if prompt.source not in teachers:
            raise ConfigError(f"OPD: prompt {prompt.instance_id} comes from set {prompt.source!r}, which has no teacher "
                              f"(teachers: {sorted(teachers)})")
        sample.metadata["teacher"] = prompt.source
        if sample.response_length:
            by_teacher.setdefault(prompt.source, []).append(sample)
    for name, group in by_teacher.items():
        for sample, lp in zip(group, teacher_log_probs(teacher_model(teachers[name]), group)):
            sample.teacher_log_probs = lp
            sample.validate()
    return samples


def student_samples(ctx: RolloutContext, prompts) -> list[Sample]:
    """``group_size`` samples of each prompt, in the prompts' order, each set's prompts answered through
    its own rollout plug-in with its own settings (``ctx.options["rollouts"]``: {set name: [dotted path,
    settings]}; single-turn for a set without one)."""
    rollouts = ctx.options.get("rollouts") or {}
    by_set: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_set.setdefault(prompt.source, []).append(i)
    G = ctx.group_size
    out: list[Sample | None] = [None] * (len(prompts) * G)
    for name, rows in by_set.items():
        path, settings = rollouts.get(name, (None, {}))
        rollout = resolve(path, f"rl.opd.teachers.{name}.rollout") if path else single_turn
        got = rollout(dataclasses.replace(ctx, options=dict(settings)), [prompts[i] for i in rows])
        for j, i in enumerate(rows):
            out[i * G:(i + 1) * G] = got[j * G:(j + 1) * G]
    return out


# Held-out rewards need the student's answers only, not the teachers' scores.
opd_rollout.for_evaluation = student_samples
