"""RLConfig: the RL loop's own settings (`orthon rl`). How the policy trains (optimizer, LR schedule,
micro-batch size, checkpoints, seed, run directory) is the training recipe's optim / schedule / train
sections, as for pretraining; see orthon.rl.recipe for RL's defaults of those."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from orthon.core.errors import ConfigError
from orthon.engine.in_process import EngineConfig
from orthon.rl.config import BufferConfig, ClusterConfig, DPScheduleConfig, LossConfig, OPDConfig, RewardConfig


@dataclass
class RLConfig:
    iterations: int = 40
    prompts_per_iteration: int = 16
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    # Rollouts also end once their text contains one of these (slime's --rollout-stop; the task's stop
    # tokens still apply). The token completing the string is the response's last, trained on.
    stop: list[str] = field(default_factory=list)
    # Optimizer steps per rollout (slime's num_steps_per_rollout): the iteration's groups split into this
    # many equal shares, one step each. 1: fully on-policy.
    updates_per_iteration: int = 1
    # DAPO's dynamic-sampling filter (without refill): groups whose G rewards are all equal have zero
    # advantage, so they add nothing to the gradient but their tokens to the loss's normaliser. Dropped,
    # the step size stays that of the informative groups as more prompts saturate.
    drop_zero_std_groups: bool = False
    # With drop_zero_std_groups, DAPO's refill: up to this many rollout rounds of prompts_per_iteration
    # prompts per iteration, until prompts_per_iteration informative groups are gathered (extra ones are
    # dropped and counted). 1: no refill, the step trains on however many informative groups one round gave.
    max_sampling_rounds: int = 1
    eval_interval: int = 5
    # "sync": generate the iteration's groups, then train on them (nothing generates during training).
    # "async": producer threads keep generating with the newest weights while the trainer trains; the
    # trainer takes ready groups as they come (orthon.rl.rollout_manager).
    mode: Literal["sync", "async"] = "sync"
    rollout_workers: int = 4  # async: prompts generated concurrently (each one group of G requests)
    max_ahead_groups: int = 0  # async: groups ready or in flight at most; 0: 2 x prompts_per_iteration
    # A group sampled by weights more than max_staleness versions older than the trainer's is stale:
    # "drop" discards it, "keep" trains on it; both count it (stale_groups_drop / stale_groups_keep).
    max_staleness: int = 2
    stale_groups: Literal["drop", "keep"] = "drop"
    # slime's debug modes: "rollout_only" generates and saves each iteration's groups (rollouts_dir)
    # without training; "train_only" trains on groups saved so, without generating.
    debug: Literal["none", "rollout_only", "train_only"] = "none"
    rollouts_dir: str = ""  # "": <run_dir>/rollouts
    # The longest the trainer waits for an iteration's groups (async) before it stops with an error
    # naming the rollout counters (every engine down, say), instead of waiting forever.
    collect_timeout_s: float = 1800.0
    max_retries: int = 3  # a prompt's rollout errors before it is abandoned (engine failures always retry)
    # Held-out evaluation: eval_reward is the policy's mean reward over eval_samples draws per prompt at
    # the rollout temperature (what RL maximises); eval_greedy the reward of the greedy answer.
    eval_samples: int = 4
    task: str = "orthon.rl.tasks.ArithmeticTask"
    task_args: dict[str, Any] = field(default_factory=lambda: {"difficulty": 2, "eval_size": 200})
    # The rollout plug-in (dotted path): prompts -> scored Samples (orthon.rl.rollout).
    rollout: str = "orthon.rl.rollout.single_turn"
    rollout_args: dict[str, Any] = field(default_factory=dict)  # the plug-in's own settings (RolloutContext.options)
    # None: the task's own binary reward; else a RewardConfig name ("math", "code", dotted path).
    reward: RewardConfig | None = None
    buffer: BufferConfig = field(default_factory=lambda: BufferConfig(num_repeat_per_sample=8))
    loss: LossConfig = field(default_factory=LossConfig)
    # How an update's samples become micro-batches and, under torchrun, which data-parallel rank runs
    # each (orthon.rl.dp_schedule); a micro-batch also holds at most train.micro_batch_size samples.
    dp_schedule: DPScheduleConfig = field(default_factory=DPScheduleConfig)
    # On-policy distillation (orthon.rl.distill): with teachers, each sampled token's advantage is
    # the teacher's log-ratio (form 2) or the outcome advantage minus the exact KL (form 1).
    opd: OPDConfig | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self):
        for name in ("iterations", "prompts_per_iteration", "updates_per_iteration", "eval_samples",
                     "max_sampling_rounds", "rollout_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if not all(isinstance(t, str) and t for t in self.stop):
            raise ConfigError(f"stop: must be a list of non-empty strings, got {self.stop!r}")
        if not self.collect_timeout_s > 0:
            raise ConfigError(f"collect_timeout_s: must be positive, got {self.collect_timeout_s}")
        for name in ("max_ahead_groups", "max_staleness", "max_retries"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.opd is not None and self.opd.teachers:  # distillation: its prompt source, rollout and batch
            self.task = "orthon.rl.distill.MixedTask"
            self.task_args = {"sets": [{"name": t.name, "task": t.task, "task_args": dict(t.task_args), "ratio": t.ratio}
                                       for t in self.opd.teachers], "eval_size": self.task_args.get("eval_size")}
            self.rollout = "orthon.rl.distill.opd_rollout"
            self.rollout_args = {**self.rollout_args, "teachers": {t.name: t.weights for t in self.opd.teachers},
                                 "rollouts": {t.name: [t.rollout, dict(t.rollout_args)] for t in self.opd.teachers}}
            self.buffer.num_repeat_per_sample = self.opd.group_size
            if self.opd.batch_size % self.opd.group_size:
                raise ConfigError(f"opd.batch_size: must be a multiple of opd.group_size ({self.opd.group_size}), "
                                  f"got {self.opd.batch_size}")
            self.prompts_per_iteration = self.opd.batch_size // self.opd.group_size
        if self.max_sampling_rounds > 1 and not self.drop_zero_std_groups:
            raise ConfigError("max_sampling_rounds: refill rounds only make sense with drop_zero_std_groups: true")
