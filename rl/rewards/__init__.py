"""Binary outcome rewards (the GLM-5 recipe (README, "The recipe")): math, code, and custom ones by dotted path."""
from orthon.rl.rewards.code import code_reward, extract_code, run_tests
from orthon.rl.rewards.math import extract_answer, math_reward
from orthon.rl.rewards.registry import RewardStats, SafeReward, resolve_reward

__all__ = [
    "RewardStats", "SafeReward", "code_reward", "extract_answer", "extract_code",
    "math_reward", "resolve_reward", "run_tests",
]
