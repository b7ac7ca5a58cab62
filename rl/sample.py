"""Sample: one trajectory of one prompt, as rollout hands it to training.

``tokens`` holds prompt + response ids; the last ``response_length`` of them
are the response. ``loss_mask``, ``rollout_log_probs`` and ``teacher_log_probs``
are per response token (length ``response_length``), as in slime: the prompt
never enters the loss, and inside the response the mask is 1 only on
model-generated tokens (tool observations are 0). ``rollout_log_probs`` are the
fp32 log-probs the engine recorded when it sampled each token ("token in,
token out"), so training never recomputes pi_rollout.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from orthon.engine.protocol import GenerationResult


class SampleStatus(str, enum.Enum):
    PENDING = "pending"  # not generated yet
    COMPLETED = "completed"  # stopped on a stop token
    TRUNCATED = "truncated"  # hit max new tokens or the context length
    ABORTED = "aborted"  # generation stopped from outside (e.g. a weight update)
    FAILED = "failed"  # could not be generated (prompt too long, engine error)


def _as_fp32(name: str, value: Any) -> torch.Tensor:
    """Per-token log-probs as a 1-D float32 tensor; a tensor of another float dtype is refused
    because converting it would hide that the engine did not record fp32."""
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            raise ValueError(f"{name}: must be float32 (recorded in fp32), got {value.dtype}")
        out = value.detach().cpu()
    elif isinstance(value, np.ndarray):
        if value.dtype != np.float32:
            raise ValueError(f"{name}: must be float32 (recorded in fp32), got numpy {value.dtype}")
        out = torch.from_numpy(value.copy())
    else:
        out = torch.tensor(list(value), dtype=torch.float32)
    if out.dim() != 1:
        raise ValueError(f"{name}: must be 1-D (one value per response token), got shape {tuple(out.shape)}")
    # A tiny positive value is float round-off of log(1); anything larger is not a log-prob.
    if not torch.isfinite(out).all() or (out > 1e-4).any():
        raise ValueError(f"{name}: log-probs must be finite and <= 0")
    return out


@dataclass
class Sample:
    instance_id: str  # the prompt's id: the G samples of one prompt share it
    tokens: list[int]
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: torch.Tensor | None = None  # fp32, [response_length]
    reward: float | None = None
    session_id: str | None = None  # multi-turn: routes every turn to the same engine
    policy_version: int = 0  # weight version the rollout engine sampled with
    status: SampleStatus = SampleStatus.PENDING
    teacher_log_probs: torch.Tensor | None = None  # fp32, [response_length]; OPD form 2
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.status, str) and not isinstance(self.status, SampleStatus):
            try:
                self.status = SampleStatus(self.status)
            except ValueError:
                names = [s.value for s in SampleStatus]
                raise ValueError(f"status: {self.status!r} is not one of {names}") from None
        self.tokens = list(self.tokens)
        self.loss_mask = list(self.loss_mask)
        if self.rollout_log_probs is not None:
            self.rollout_log_probs = _as_fp32("rollout_log_probs", self.rollout_log_probs)
        if self.teacher_log_probs is not None:
            self.teacher_log_probs = _as_fp32("teacher_log_probs", self.teacher_log_probs)
        self.validate()

    def validate(self) -> "Sample":
        """Check the invariants; raise ValueError naming the field. Call again after editing."""
        where = f"sample {self.instance_id!r}"
        if not isinstance(self.instance_id, str) or not self.instance_id:
            raise ValueError(f"instance_id: must be a non-empty string, got {self.instance_id!r}")
        if not isinstance(self.status, SampleStatus):
            raise ValueError(f"{where}: status must be a SampleStatus, got {self.status!r}")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in self.tokens):
            raise ValueError(f"{where}: tokens must be non-negative integers")
        n = self.response_length
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(self.tokens):
            raise ValueError(f"{where}: response_length {n!r} must be an int in [0, len(tokens)={len(self.tokens)}]")
        if self.status is SampleStatus.PENDING and n:
            raise ValueError(f"{where}: a pending sample has no response yet (response_length {n})")
        if len(self.loss_mask) != n:
            raise ValueError(f"{where}: loss_mask has {len(self.loss_mask)} entries, response_length is {n}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"{where}: loss_mask entries must be 0 or 1")
        for name in ("rollout_log_probs", "teacher_log_probs"):
            value = getattr(self, name)
            if value is not None and value.numel() != n:
                raise ValueError(f"{where}: {name} has {value.numel()} entries, response_length is {n}")
        if self.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and self.rollout_log_probs is None:
            raise ValueError(f"{where}: a {self.status.value} sample needs rollout_log_probs")
        if self.reward is not None:
            if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
                raise ValueError(f"{where}: reward must be a finite number or None, got {self.reward!r}")
            self.reward = float(self.reward)
        if isinstance(self.policy_version, bool) or not isinstance(self.policy_version, int) or self.policy_version < 0:
            raise ValueError(f"{where}: policy_version must be an int >= 0, got {self.policy_version!r}")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"{where}: metadata must be a dict, got {type(self.metadata).__name__}")
        return self

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def with_response(self, response: Sequence[int], log_probs: Any, *, status: SampleStatus = SampleStatus.COMPLETED,
                      policy_version: int | None = None) -> "Sample":
        """A finished copy of this (pending) sample with ``response`` appended."""
        if self.status is not SampleStatus.PENDING:
            raise ValueError(f"sample {self.instance_id!r}: already {self.status.value}, cannot add a response")
        response = list(response)
        return replace(self, tokens=self.tokens + response, response_length=len(response),
                       loss_mask=[1] * len(response), rollout_log_probs=log_probs, status=status,
                       teacher_log_probs=None, metadata=dict(self.metadata),
                       policy_version=self.policy_version if policy_version is None else policy_version)


def sample_to_dict(sample: Sample) -> dict:
    """A JSON-able copy (log-probs as lists of floats: fp32 values survive the round trip exactly)."""
    out = {f.name: getattr(sample, f.name) for f in fields(sample)}
    out["status"] = sample.status.value
    for name in ("rollout_log_probs", "teacher_log_probs"):
        if out[name] is not None:
            out[name] = out[name].tolist()
    return out


# An engine's finish reason (orthon.engine.protocol.FinishReason) as a Sample status.
FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "context": SampleStatus.TRUNCATED,
                 "abort": SampleStatus.ABORTED, "rejected": SampleStatus.FAILED}


def to_sample(result: "GenerationResult", sample: Sample) -> Sample:
    """The finished copy of a pending Sample from the engine's result for its prompt: the response with
    its rollout log-probs, the status of the finish reason and the weight version that sampled it; a
    rejected request gives a FAILED sample whose metadata["error"] says why."""
    if sample.tokens != list(result.prompt):
        raise ValueError(f"sample {sample.instance_id!r}: its tokens are not this result's prompt")
    status = FINISH_STATUS[result.finish_reason]
    if status is SampleStatus.FAILED:
        return Sample(instance_id=sample.instance_id, tokens=list(sample.tokens), session_id=sample.session_id,
                      status=SampleStatus.FAILED, policy_version=result.weight_version,
                      metadata={**sample.metadata, "error": result.error})
    return sample.with_response(result.tokens, result.log_probs, status=status, policy_version=result.weight_version)


def branches(sample: Sample) -> list[Sample]:
    """The sample and the extra training branches of its session, if it forked (orthon.rl.trajectory):
    each branch trains on the tokens generated in it, with the sample's reward (one outcome per session)."""
    forks = [Sample(sample.instance_id, f["tokens"], response_length=f["response_length"], loss_mask=f["loss_mask"],
                    rollout_log_probs=torch.tensor(f["rollout_log_probs"], dtype=torch.float32), reward=sample.reward,
                    session_id=sample.session_id, policy_version=sample.policy_version, status=sample.status,
                    metadata={"fork_of": sample.session_id})
             for f in sample.metadata.get("forks", ())]
    return [sample, *forks]
