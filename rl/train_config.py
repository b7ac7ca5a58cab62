"""RLConfig: the RL loop's own settings (`orthon rl`). How the policy trains (optimizer, LR schedule,
micro-batch size, checkpoints, seed, run directory) is the training recipe's optim / schedule / train
sections, as for pretraining; see orthon.rl.recipe for RL's defaults of those."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orthon.core.errors import ConfigError
from orthon.engine.in_process import EngineConfig
from orthon.rl.config import BufferConfig, LossConfig, RewardConfig


@dataclass
class RLConfig:
    iterations: int = 40
    prompts_per_iteration: int = 16
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
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
    # Held-out evaluation: eval_reward is the policy's mean reward over eval_samples draws per prompt at
    # the rollout temperature (what RL maximises); eval_greedy the reward of the greedy answer.
    eval_samples: int = 4
    task: str = "orthon.rl.tasks.ArithmeticTask"
    task_args: dict[str, Any] = field(default_factory=lambda: {"difficulty": 2, "eval_size": 200})
    # The rollout plug-in (dotted path): prompts -> scored Samples (orthon.rl.rollout).
    rollout: str = "orthon.rl.rollout.single_turn"
    # None: the task's own binary reward; else a RewardConfig name ("math", "code", dotted path).
    reward: RewardConfig | None = None
    buffer: BufferConfig = field(default_factory=lambda: BufferConfig(num_repeat_per_sample=8, task_type="arithmetic"))
    loss: LossConfig = field(default_factory=LossConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        for name in ("iterations", "prompts_per_iteration", "updates_per_iteration", "eval_samples",
                     "max_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.max_sampling_rounds > 1 and not self.drop_zero_std_groups:
            raise ConfigError("max_sampling_rounds: refill rounds only make sense with drop_zero_std_groups: true")
