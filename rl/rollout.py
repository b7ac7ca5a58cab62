"""Rollout plug-ins: how a batch of prompts becomes scored Samples.

``rl.rollout`` names the function by dotted path (as slime's ``--rollout-function-path``), so a
multi-turn, tool-using rollout plugs in without editing the loop. A rollout function takes the
RolloutContext and the prompts (each to be sampled ``group_size`` times) and returns every Sample,
finished and scored; it talks to the engine only through the Engine protocol (``generate``).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from orthon.rl.sample import Sample, SampleStatus, to_sample


@dataclass
class RolloutContext:
    engine: object  # an orthon Engine: generate(prompts, sampling) -> results
    tokenizer: object
    reward: Callable[[str, str], float]  # (response text, label) -> 0 or 1
    sampling: object  # the SamplingParams of this round (its seed makes the round reproducible)
    group_size: int
    reward_concurrency: int = 1
    options: dict = field(default_factory=dict)  # rl.rollout_args: the plug-in's own settings
    stats: Counter | None = None  # the plug-in's counters (truncations, parse errors, ...) go here


def count_prompt_tokens(ctx: RolloutContext, results) -> None:
    """The engine calls' prompt tokens, and those the engine took from its prefix cache (the next turns
    of multi-turn sessions, a group's repeats), into the plug-in's counters."""
    if ctx.stats is not None:
        ran = [r for r in results if r.ok]
        ctx.stats["prompt_tokens"] += sum(len(r.prompt) for r in ran)
        ctx.stats["prompt_tokens_cached"] += sum(r.cached_tokens for r in ran)


def single_turn(ctx: RolloutContext, prompts) -> list[Sample]:
    """One generation per sample: G samples of each prompt, each scored by the binary reward. The whole
    response is the model's, so the loss mask is all ones; a request the engine rejected is FAILED
    with reward 0 (counted by the buffer, never trained on)."""
    requests = [p for p in prompts for _ in range(ctx.group_size)]
    results = ctx.engine.generate([p.ids for p in requests], ctx.sampling)
    count_prompt_tokens(ctx, results)
    samples = [to_sample(result, Sample(prompt.instance_id, prompt.ids, metadata={"label": prompt.label}))
               for prompt, result in zip(requests, results)]
    scored = [s for s in samples if s.status is not SampleStatus.FAILED]
    rewards = score([(ctx.tokenizer.decode(s.response_tokens), s.metadata["label"]) for s in scored], ctx)
    for sample in samples:
        sample.reward = 0.0
    for sample, reward in zip(scored, rewards):
        sample.reward = reward
    return samples


def score(pairs: list[tuple[str, object]], ctx: RolloutContext) -> list[float]:
    """``ctx.reward`` of each (response text, label), up to ``ctx.reward_concurrency`` at once (a
    sandboxed check spends most of its time waiting)."""
    if ctx.reward_concurrency <= 1 or len(pairs) <= 1:
        return [ctx.reward(text, label) for text, label in pairs]
    with ThreadPoolExecutor(min(ctx.reward_concurrency, len(pairs)), thread_name_prefix="reward") as pool:
        return list(pool.map(lambda pair: ctx.reward(*pair), pairs))
