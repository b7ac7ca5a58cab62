"""Typed configs of the RL core: buffer, loss, OPD, rewards, DP scheduling.

Defaults are the GLM-5 recipe (README, "The recipe") (GLM-5): G = 32 samples per prompt,
IcePop beta = 2, asymmetric clip 0.2 / 0.28, KL coefficient 0, binary rewards,
OPD form 2 with lambda = 1.0, group size 1 and batch 1024.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from orthon.core.errors import ConfigError


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ConfigError(f"{name}: must be positive, got {value}")


@dataclass
class BufferConfig:
    """The Data Buffer: a group of one prompt is ready when it holds G samples (the buffer's task type is
    the task's own, ``Task.task_type``)."""

    num_repeat_per_sample: int = 32  # G

    def __post_init__(self):
        _positive(self, "num_repeat_per_sample")


@dataclass
class LossConfig:
    """GRPO advantage and the IcePop + asymmetric-clip policy loss."""

    # std_G(r) of the advantage: "unbiased" (divide by G-1, torch's default) or "population" (by G).
    advantage_std: Literal["unbiased", "population"] = "unbiased"
    icepop_beta: float = 2.0  # tokens with rho outside [1/beta, beta] get zero gradient
    eps_low: float = 0.2
    eps_high: float = 0.28
    kl_coef: float = 0.0
    aggregation: Literal["token", "sequence"] = "token"
    # "one": GLM-5's m_t in {0, 1}. "rho": peers' pop(rho) = rho on kept tokens (see orthon.rl.loss).
    keep_weight: Literal["one", "rho"] = "one"

    def __post_init__(self):
        if not self.icepop_beta > 1.0:
            raise ConfigError(f"icepop_beta: must be > 1, got {self.icepop_beta}")
        if not 0.0 <= self.eps_low < 1.0:
            raise ConfigError(f"eps_low: must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0.0:
            raise ConfigError(f"eps_high: must be >= 0, got {self.eps_high}")
        if not self.kl_coef >= 0.0:
            raise ConfigError(f"kl_coef: must be >= 0, got {self.kl_coef}")


@dataclass
class TeacherConfig:
    """One OPD teacher: its weights (a weights directory, e.g. an earlier stage's final/) and its prompts."""

    name: str = "teacher"
    weights: str = ""
    task: str = "orthon.rl.tasks.ArithmeticTask"
    task_args: dict[str, Any] = field(default_factory=dict)
    ratio: float = 1.0  # relative share of the prompts
    # How the student answers this set's prompts (a rollout plug-in and its settings): single-turn, or a
    # tool set's multi-turn rollout, whose observation tokens the teacher scores but nothing trains on.
    rollout: str = "orthon.rl.rollout.single_turn"
    rollout_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: must be non-empty and without '/', got {self.name!r}")
        _positive(self, "ratio")


@dataclass
class OPDConfig:
    """On-policy distillation (the GLM-5 recipe (README, "The recipe"))."""

    # "sampled": form 2, A' = sg[log pi_T(a) - log pi_S(a)] (GLM-5's choice).
    # "kl_penalty": form 1, A' = A - coef * KL(pi_T || pi_S) exact over the vocabulary.
    form: Literal["sampled", "kl_penalty"] = "sampled"
    coef: float = 1.0  # lambda
    # Direction of the form-1 KL; the recipe writes KL(teacher || student).
    kl_direction: Literal["teacher_student", "student_teacher"] = "teacher_student"
    group_size: int = 1
    batch_size: int = 1024  # samples an iteration: with teachers, prompts_per_iteration = batch_size / group_size
    # The teachers, each with its own prompt set; prompts are drawn from the sets by their ratios and
    # every prompt is scored by the teacher of its set (data-level mixing, never logit averaging).
    teachers: list[TeacherConfig] = field(default_factory=list)

    def __post_init__(self):
        _positive(self, "group_size", "batch_size")
        if not self.coef >= 0.0:
            raise ConfigError(f"coef: must be >= 0, got {self.coef}")
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ConfigError(f"teachers: names must differ, got {names}")


@dataclass
class RewardConfig:
    """Binary outcome rewards; ``name`` is "math", "code" or a dotted path to a function."""

    name: str = "math"
    timeout_s: float = 30.0  # per call; a reward that runs longer gives 0 and is counted
    binary: bool = True  # a value other than 0 or 1 is invalid (0, counted)
    code_timeout_s: float = 10.0  # CPU and wall limit of one code-test run in the sandbox (orthon.rl.sandbox)
    code_memory_mb: int = 1024  # address-space limit of each of its processes
    latency_s: float = 0.0  # added to every call (benchmarks: the cost of a sandboxed check)
    concurrency: int = 8  # rewards of one rollout batch scored at once (threads; workers with cluster.reward_workers)

    def __post_init__(self):
        if not self.name:
            raise ConfigError("name: must be 'math', 'code' or a dotted path")
        _positive(self, "timeout_s", "code_timeout_s", "code_memory_mb", "concurrency")
        if not self.latency_s >= 0:
            raise ConfigError(f"latency_s: must be >= 0, got {self.latency_s}")


@dataclass
class DPScheduleConfig:
    """Pack samples into token-capacity micro-batches, then spread micro-batches over DP ranks."""

    # Tokens a micro-batch may hold. With "padded" packing that is samples x the longest sample (orthon's
    # RL step right-pads a micro-batch to its longest sample), so it bounds activation memory; a sample
    # longer than this runs alone (and is counted: oversized_samples).
    micro_batch_tokens: int = 16384
    # "padded": runs of the samples sorted by length (the least padding), for right-padded batches.
    # "first_fit" / "flops" fill by the sum of lengths, for packed sequences (no padding): first_fit +
    # karmarkar_karp balances ranks best on heavy-tailed lengths (bench/dp_schedule.py), first-fit
    # leaving light micro-batches that Karmarkar-Karp uses to even out the ranks, while "flops" makes
    # micro-batches alike (what a pipeline wants) and leaves it none.
    packing: Literal["padded", "first_fit", "flops"] = "padded"
    distribution: Literal["round_robin", "karmarkar_karp"] = "karmarkar_karp"
    # FLOPs of a sample of length L taken as L * (1 + L / attention_crossover_tokens): the length at
    # which attention costs as much per token as the linear layers. GLM-5 with dense attention:
    # 2 * 40e9 active params / (78 layers * (16384 + 16384) qk+v width) ~ 31k (see dp_schedule).
    attention_crossover_tokens: float = 32768.0
    # Every rank gets the same number of micro-batches (FSDP and pipelines need it).
    equal_micro_batches: bool = True

    def __post_init__(self):
        _positive(self, "micro_batch_tokens", "attention_crossover_tokens")


@dataclass
class ClusterConfig:
    """RL on a Ray cluster (orthon.rl.cluster): engine servers, the rollout manager and the trainer as
    Ray actors; rollouts reach the engines through sglang-router."""

    enabled: bool = False
    address: str | None = None  # None: start a local Ray cluster; "auto" or "ray://host:port": join one
    engines: int = 2  # `orthon serve` processes (SGLang servers on a GPU cluster)
    # The policy's trainer as this many Ray actors in one torch.distributed group (slime's training
    # actors), data parallel by train.parallel (ddp, or fsdp: FSDP2 shards); rank 0 holds the engine
    # fleet and talks to the rollout manager.
    trainer_ranks: int = 1
    trainer_threads: int = 1  # CPUs (torch threads) of each trainer rank
    trainer_gpus: bool = False  # each trainer rank on a GPU of its own (Ray sets CUDA_VISIBLE_DEVICES)
    engine_threads: int = 1  # torch threads of each engine server
    engine_max_batch_size: int = 64
    engine_prefix_cache_tokens: int = 65536  # each engine's prefix cache (orthon serve --prefix-cache-tokens)
    router: bool = True  # sglang-router in front of the engines (session affinity by routing key)
    reward_workers: int = 0  # Ray actors scoring rewards; 0: the rollout manager's threads score
    # How new weights reach the engines (orthon.rl.weight_sync); with delta: true only the changed bytes
    # travel (the engines must hold the previous version's exact bytes).
    weight_sync: Literal["disk", "distributed", "shared"] = "disk"
    delta: bool = True
    check_weights: bool = False  # after every sync, compare a hash per tensor of every engine with the trainer's
    # Where the trainer ranks hold shards, the distributed path without delta gathers and broadcasts the
    # weights in parts of this many bytes, so rank 0 never holds more (slime's bucket by bucket).
    part_bytes: int = 1 << 30
    health_interval_s: float = 2.0  # how often the monitor polls each engine
    health_failures: int = 2  # consecutive failed polls before an engine is restarted
    request_timeout_s: float = 120.0  # one generate call; then the engine counts as unavailable
    startup_timeout_s: float = 180.0
    # Where the run's services listen and its weight-update groups meet: "local" on 127.0.0.1 (every actor
    # on one machine); "node" on each node's address as Ray knows it (engines reachable from the trainer's
    # node, the router from the rollout manager's, each update group at its broadcasting rank's node);
    # "auto": node when the Ray cluster has more than one node. Disk weight sync needs run_dir on a
    # filesystem every node shares.
    network: Literal["auto", "local", "node"] = "auto"

    def __post_init__(self):
        _positive(self, "engines", "engine_threads", "trainer_ranks", "trainer_threads", "engine_max_batch_size",
                  "part_bytes", "health_interval_s", "health_failures", "request_timeout_s", "startup_timeout_s")
        for name in ("reward_workers", "engine_prefix_cache_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")

    @property
    def gathers_whole(self) -> bool:
        """Whether weight sync needs the whole model gathered on trainer rank 0 where the ranks hold shards:
        the shared path (one set of buckets); disk and distributed take the shards a part at a time, or
        with delta each rank's delta of its rows (orthon.rl.weight_sync)."""
        return self.weight_sync == "shared"


@dataclass
class SFTConfig:
    """The SFT stage (orthon.rl.sft): conversations, loss on the assistant's tokens only."""

    # A JSONL file of {"messages": [...]}, or a dotted path to fn(tokenizer, n, seed) -> conversations.
    data: str = "orthon.rl.tool_tasks.tool_demonstrations"
    examples: int = 2000  # conversations a generator makes (a file gives what it has)
    steps: int = 200
    batch_size: int = 16
    clear_thinking: bool = False

    def __post_init__(self):
        _positive(self, "examples", "steps", "batch_size")
