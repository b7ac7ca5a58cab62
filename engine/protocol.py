"""The ``Engine`` protocol: what every generation backend offers, and what it returns per request.

An engine continues token-id prompts and records, per request, the response tokens with the fp32
log-prob of every sampled token, why generation ended and which weights produced it; it takes new
weights (``update_weights``) and drops its cached state on request (``flush``). The in-process engine
(``orthon.engine.in_process.InProcessEngine``) is the reference implementation; an out-of-process
backend (an inference server) implements the same five members. Nothing here knows about RL: rl maps
a ``GenerationResult`` onto its Sample (``orthon.rl.sample.to_sample``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Protocol, Sequence, Union, get_args, runtime_checkable

import torch

from orthon.engine.sampling import SamplingParams

# Why a request ended:
#   "stop"     it sampled one of its stop tokens (the last response token), or a token that completed
#              one of its stop strings (``matched_stop`` names it);
#   "length"   it reached its max_new_tokens;
#   "context"  it reached the engine's context length before max_new_tokens;
#   "abort"    generation was stopped from outside (e.g. a weight update of a server that aborts
#              requests in flight); the tokens so far are returned;
#   "rejected" the request was not run (bad prompt); ``error`` says why, no tokens.
FinishReason = Literal["stop", "length", "context", "abort", "rejected"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


@dataclass
class GenerationResult:
    prompt: list[int]
    tokens: list[int]  # the response (ends with the stop token when finish_reason is "stop")
    log_probs: torch.Tensor  # fp32, one per response token
    finish_reason: FinishReason
    weight_version: int  # the engine's weight_version when the request ran
    seed: int | None = None  # the seed its draws came from (drawn by the engine when the request had none)
    error: str | None = None  # set on rejected requests
    matched_stop: str | None = None  # the stop string that ended the response (finish_reason "stop")
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache (SGLang's meta_info)

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason: {self.finish_reason!r} is not one of {FINISH_REASONS}")

    @property
    def ok(self) -> bool:
        """The request ran (any finish reason but "rejected")."""
        return self.finish_reason != "rejected"


@runtime_checkable
class WeightDelta(Protocol):
    """A delta weight payload (``orthon.engine.delta.DeltaPayload`` is orthon's).

    ``apply_to(state_dict)`` is handed the engine's current weights, a mapping from the model's
    state_dict names, and from the HF layout's names of routed experts (one tensor each, views of the
    stacks), to tensors (read them, do not modify them), and returns the new values of the
    tensors the delta changes: a ``{name: tensor}`` mapping or (name, tensor) pairs. The engine then
    checks and copies them in exactly like a state-dict update, so a bad delta changes nothing.

    Optional members an engine honours: ``base_version`` (int; the delta applies only to an engine
    holding that weight version, any other refuses it unchanged), ``version`` (int; the version the
    engine holds afterwards) and ``apply_in_place(state_dict)`` (writes the new bytes straight into
    the given tensors' storage after checking everything, instead of ``apply_to``)."""

    def apply_to(self, state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]:
        ...


# What update_weights takes: named tensors (a state dict, or (name, tensor) pairs: a bucket of one; by the
# model's state_dict names or the HF layout's, routed experts one tensor each, as SGLang takes them), a
# path (a weights directory: HF layout config.json + safetensors shards, or orthon's recipe.yaml +
# model.safetensors; or one .safetensors file), or a WeightDelta.
WeightsSource = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]], str, os.PathLike, WeightDelta]


@runtime_checkable
class Engine(Protocol):
    """A generation backend. ``isinstance(x, Engine)`` checks that the members exist."""

    weight_version: int  # changes with every update_weights (an explicit version is taken as given)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 routing_keys: Sequence[str | None] | None = None) -> list[GenerationResult]:
        """Continue every prompt (token ids); one result per prompt, in order. ``sampling``: one
        SamplingParams for all, or one per prompt. ``routing_keys``: one per prompt (a session id):
        behind a router, requests with one key go to one engine, whose prefix cache holds the
        session. Bad requests come back "rejected", never raise."""
        ...

    def update_weights(self, weights: WeightsSource, version: int | None = None) -> int:
        """Load new weights (see ``WeightsSource``); every name and shape is checked before anything
        changes. Returns the new weight_version: ``version`` when given, else the old one + 1."""
        ...

    def health(self) -> dict[str, Any]:
        """A JSON-able report: at least {"ok": bool, "weight_version": int}."""
        ...

    def flush(self) -> None:
        """Drop cached state (prefix / KV caches, packed decode weights); results do not change."""
        ...
