"""The rollout side of RL: prompts -> scored groups in the Data Buffer, synchronously or in the background.

The RolloutManager owns the prompt source (the task), the Data Buffer, the rollout plug-in
(``rl.rollout``) and the reward; it talks to the engines only through the Engine protocol (one
in-process engine, an HTTP client of one server, or of the router in front of several). The same
object serves both modes of the loop (slime's ``train.py`` and ``train_async.py``):

- ``sync``: ``collect_groups`` generates rounds of ``prompts_per_iteration`` prompts and returns when
  the iteration's groups are ready; nothing is generated while the trainer trains.
- ``async``: ``start()`` runs ``rollout_workers`` producer threads that keep up to ``max_ahead_groups``
  groups generated or in flight, each with the newest weights the engines hold; ``collect_groups``
  takes ready groups as they come. A group sampled ``max_staleness`` or more weight versions before
  the trainer's is dropped or kept, by ``stale_groups``, and counted either way.

Every prompt carries its index in the prompt stream, and its G requests draw seeds ``base + index x G +
k``, so a sample's randomness does not depend on which thread or engine ran it. A prompt whose engine
failed (``EngineUnavailable``) or whose group came back aborted is queued again and regenerated whole:
a group is never half-filled. ``state_dict`` holds the buffer (partial groups too), the prompt stream's
position, the prompts in flight (regenerated first after a resume) and the counters.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from dataclasses import dataclass

import torch

from orthon.core.errors import CheckpointError, EngineUnavailable
from orthon.core.plugins import resolve
from orthon.engine.sampling import SamplingParams
from orthon.rl.buffer import DataBuffer
from orthon.rl.rewards.registry import SafeReward
from orthon.rl.rollout import RolloutContext
from orthon.rl.sample import Sample, SampleStatus
from orthon.rl.tasks import Prompt

SEED_STRIDE = 1_000_003  # the run seed's offset in the request seeds (as the synchronous loop always drew them)


@dataclass
class _Item:
    index: int  # position in the prompt stream
    prompt: Prompt
    attempts: int = 0


class RolloutManager:
    def __init__(self, cfg, tokenizer, engine, seed: int, reward=None, log=print):
        """``cfg``: the RLConfig; ``engine``: anything that speaks the Engine protocol."""
        self.cfg, self.tokenizer, self.engine, self.seed, self.log = cfg, tokenizer, engine, seed, log
        self.task = resolve(cfg.task, "rl.task")(tokenizer, seed=seed, **cfg.task_args)
        self.reward = reward or (SafeReward.from_config(cfg.reward) if cfg.reward else SafeReward(self.task.reward_fn))
        self.rollout_fn = resolve(cfg.rollout, "rl.rollout")
        self.group_size = cfg.buffer.num_repeat_per_sample
        self.buffer = DataBuffer(self.group_size, self.task.task_type)
        self.eval_prompts = self.task.eval_set()
        self.drawn = 0  # prompts taken from the task so far (the next one's index)
        self.counters = collections.Counter()  # retries, aborted groups, stale groups, ...
        self._queue: collections.deque[_Item] = collections.deque()  # to generate before new prompts
        self._in_flight: dict[str, _Item] = {}
        self._cond = threading.Condition()
        self._workers: list[threading.Thread] = []
        self._stopping = False
        # Synchronous rounds' rolls: this process's engine alone, or shared by the ranks of a torchrun
        # job (orthon.rl.rank_rollouts.RankRollouts.roll).
        self.roll_round = self._roll

    # ------------------------------------------------------------ generation
    def sampling(self, greedy: bool = False, seed: int | None = None, logprob_mode: str = "policy") -> SamplingParams:
        cfg = self.cfg
        return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0 if greedy else cfg.temperature,
                              top_p=1.0 if greedy else cfg.top_p, stop_token_ids=self.task.stop_token_ids, seed=seed,
                              logprob_mode=logprob_mode, stop=tuple(cfg.stop))

    def _draw(self, n: int) -> list[_Item]:
        items = [_Item(self.drawn + i, p) for i, p in enumerate(self.task.sample(n))]
        self.drawn += n
        return items

    def _roll(self, items: list[_Item]) -> list[Sample]:
        """Generate and score the groups of ``items`` (consecutive indices share one call, so one
        engine batch holds them all)."""
        samples = []
        start = 0
        while start < len(items):
            end = start + 1
            while end < len(items) and items[end].index == items[end - 1].index + 1:
                end += 1
            seed = self.seed * SEED_STRIDE + items[start].index * self.group_size
            ctx = self._context(self.sampling(seed=seed), self.group_size, self.counters)
            samples += self.rollout_fn(ctx, [item.prompt for item in items[start:end]])
            start = end
        return samples

    def _context(self, sampling: SamplingParams, group_size: int, counters: collections.Counter) -> RolloutContext:
        """What a rollout plug-in gets: the engine, tokenizer and reward, this call's sampling and group
        size, the plug-in's settings, and the counters its events go to."""
        return RolloutContext(self.engine, self.tokenizer, self.reward, sampling, group_size,
                              self.cfg.reward.concurrency if self.cfg.reward else 1, self.cfg.rollout_args, counters)

    def _store(self, items: list[_Item], samples: list[Sample]) -> None:
        """Samples into the buffer; a prompt with an aborted sample is queued again instead, whole."""
        by_id = collections.defaultdict(list)
        for sample in samples:
            by_id[sample.instance_id].append(sample)
        with self._cond:
            for item in items:
                group = by_id.get(item.prompt.instance_id, [])
                if any(s.status is SampleStatus.ABORTED for s in group):
                    self.counters["aborted_groups"] += 1
                    self._queue.appendleft(item)
                else:
                    self.buffer.add_many(group)
            self._cond.notify_all()

    def generate(self, n: int) -> dict:
        """One synchronous round: ``n`` prompts (queued ones first), each sampled G times, into the buffer."""
        with self._cond:
            items = [self._queue.popleft() for _ in range(min(n, len(self._queue)))]
            items += self._draw(n - len(items))
        items.sort(key=lambda item: item.index)
        for attempt in range(self.cfg.max_retries + 1):
            try:
                samples = self.roll_round(items)
                break
            except EngineUnavailable as exc:
                self.counters["engine_retries"] += 1
                if attempt == self.cfg.max_retries:
                    raise
                self.log(f"rollout: {exc}; retrying")
                time.sleep(min(2.0**attempt, 10.0))
        self._store(items, samples)
        return {"rollout_failed": sum(1 for s in samples if s.status is SampleStatus.FAILED)}

    # ------------------------------------------------------------ asynchronous production
    def start(self) -> None:
        """Start the producer threads (async mode); idempotent."""
        with self._cond:
            self._stopping = False
        while len(self._workers) < self.cfg.rollout_workers:
            worker = threading.Thread(target=self._produce, name=f"rollout-{len(self._workers)}", daemon=True)
            self._workers.append(worker)
            worker.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop producing; prompts in flight finish into the buffer (or the queue)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join(timeout)
        self._workers = [w for w in self._workers if w.is_alive()]

    def _ahead(self) -> int:
        counts = self.buffer.counters()
        return counts.ready_groups + counts.pending_groups + len(self._in_flight)

    def _produce(self) -> None:
        max_ahead = self.cfg.max_ahead_groups or 2 * self.cfg.prompts_per_iteration
        while True:
            with self._cond:
                while not self._stopping and self._ahead() >= max_ahead:
                    self._cond.wait()
                if self._stopping:
                    return
                item = self._queue.popleft() if self._queue else self._draw(1)[0]
                self._in_flight[item.prompt.instance_id] = item
            try:
                samples = self._roll([item])
            except Exception as exc:  # an engine down (retried elsewhere) or a broken plug-in: never lose the prompt
                item.attempts += 1
                self.counters["engine_retries" if isinstance(exc, EngineUnavailable) else "rollout_errors"] += 1
                with self._cond:
                    self._in_flight.pop(item.prompt.instance_id, None)
                    if item.attempts > self.cfg.max_retries and not isinstance(exc, EngineUnavailable):
                        self.counters["prompts_abandoned"] += 1
                        self.log(f"rollout: prompt {item.prompt.instance_id} abandoned after {item.attempts} errors: {exc}")
                    else:
                        self._queue.appendleft(item)
                    self._cond.notify_all()
                time.sleep(min(0.1 * 2.0 ** min(item.attempts, 6), 5.0))
                continue
            with self._cond:
                self._in_flight.pop(item.prompt.instance_id, None)
            self._store([item], samples)

    # ------------------------------------------------------------ groups for the trainer
    def collect_groups(self, version: int = 0, timeout: float | None = None) -> tuple[list[list[Sample]], dict]:
        """The iteration's groups and statistics over every group examined. ``version``: the trainer's
        weight version (for staleness). With ``drop_zero_std_groups``, groups whose G rewards are all
        equal are examined and dropped, and up to ``max_sampling_rounds`` x ``prompts_per_iteration``
        groups are examined to fill the iteration (DAPO's dynamic sampling); informative groups beyond
        ``prompts_per_iteration`` are dropped and counted."""
        cfg = self.cfg
        want, budget = cfg.prompts_per_iteration, cfg.prompts_per_iteration * cfg.max_sampling_rounds
        examined, kept, failed, rounds, staleness = [], [], 0, 0, []
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(kept) < want and len(examined) < budget:
            if self._workers:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                ready = self.buffer.wait_ready(1, timeout=left)
            else:
                if rounds == cfg.max_sampling_rounds:
                    break
                failed += self.generate(want)["rollout_failed"]
                rounds += 1
                ready = self.buffer.take_ready()
            with self._cond:
                self._cond.notify_all()  # room ahead for the producers
            for group in ready:
                lag = version - min(s.policy_version for s in group)
                if lag > cfg.max_staleness:
                    self.counters[f"stale_groups_{cfg.stale_groups}"] += 1
                    if cfg.stale_groups == "drop":
                        continue
                staleness.append(lag)
                examined.append(group)
                rewards = [s.reward for s in group]
                if not cfg.drop_zero_std_groups or min(rewards) != max(rewards):
                    kept.append(group)
        if self._workers and not kept and timeout is not None and time.monotonic() >= deadline:
            raise EngineUnavailable(f"rollout: no group ready after {timeout:.0f}s (counters: {dict(self.counters)}); "
                                    "are the engines up?")
        extra = max(0, len(kept) - want) if cfg.drop_zero_std_groups else 0
        rewards = torch.tensor([[s.reward for s in g] for g in examined], dtype=torch.float32).reshape(-1, self.group_size)
        lengths = [s.response_length for g in examined for s in g]
        failed += sum(s.status is SampleStatus.FAILED for g in examined for s in g) if self._workers else 0
        stats = {"rollout_failed": failed, "groups_examined": len(examined),
                 "reward_mean": rewards.mean().item() if len(examined) else math.nan,
                 "groups_all_equal": float((rewards.amax(-1) == rewards.amin(-1)).float().mean()) if len(examined) else math.nan,
                 "response_length": sum(lengths) / max(len(lengths), 1),
                 "staleness_mean": sum(staleness) / max(len(staleness), 1), "staleness_max": max(staleness, default=0),
                 "staleness_counts": {str(k): v for k, v in sorted(collections.Counter(staleness).items())}}
        if cfg.drop_zero_std_groups:
            stats.update(sampling_rounds=rounds, groups_kept=len(kept) - extra, groups_extra_dropped=extra)
        stats.update(self.counters)
        stats.update({f"buffer_{k}": v for k, v in self.buffer.counters().as_dict().items()})
        stats.update({f"reward_{k}": v for k, v in self.reward.stats.as_dict().items() if isinstance(v, (int, float))})
        return kept[: len(kept) - extra], stats

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out rewards: the mean over eval_samples sampled answers per prompt (a fixed seed, so every
        evaluation draws the same uniforms) and the greedy answer's. The prompts are answered as training
        answers them, through the rollout plug-in (a tool task's evaluation runs its tools), or through
        the plug-in's ``for_evaluation`` where it names one (OPD: no teacher is needed to score)."""
        rollout = getattr(self.rollout_fn, "for_evaluation", self.rollout_fn)

        def mean_reward(sampling, group_size: int) -> float:
            # Its own counters: evaluation's tool calls and parse errors stay out of training's.
            samples = rollout(self._context(sampling, group_size, collections.Counter()), self.eval_prompts)
            return sum(s.reward for s in samples) / len(samples)

        # No log-probs are read here: an engine that rescores its samples skips these.
        return {"eval_reward": mean_reward(self.sampling(seed=self.seed + 7_919, logprob_mode="none"),
                                           self.cfg.eval_samples),
                "eval_greedy": mean_reward(self.sampling(greedy=True, logprob_mode="none"), 1)}

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """JSON-able. Taken while producers run, it is a consistent cut: prompts in flight are not in the
        buffer yet, so a resumed run regenerates them (first, in stream order) and nothing is lost or
        trained twice."""
        with self._cond:
            todo = sorted([*self._queue, *self._in_flight.values()], key=lambda item: item.index)
            return {"task": self.task.state_dict(), "drawn": self.drawn, "buffer": self.buffer.state_dict(),
                    "queue": [[item.index, dataclasses.asdict(item.prompt)] for item in todo],
                    "counters": dict(self.counters), "reward_stats": self.reward.stats.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self.task.load_state_dict(state["task"])
            self.drawn = state["drawn"]
            self.buffer.load_state_dict(state["buffer"])
            self._queue = collections.deque(_Item(index, Prompt(**prompt)) for index, prompt in state["queue"])
            self.counters = collections.Counter(state["counters"])
            self.reward.stats.load(state["reward_stats"])


def rollout_state(state: dict) -> dict:
    """The rollout manager's part of an RL trainer state: ``state["rollout"]``, or for a checkpoint written
    by the synchronous loop before the manager existed, the same built from its top-level task, buffer and
    reward counts (no prompt in flight, the task's stream position as the number drawn)."""
    if "rollout" in state:
        return state["rollout"]
    missing = [key for key in ("task", "buffer", "reward_stats") if key not in state]
    if missing:
        raise CheckpointError(f"RL checkpoint has no rollout state: neither 'rollout' nor {missing}")
    return {"task": state["task"], "drawn": int(state["task"].get("issued", 0)), "buffer": state["buffer"],
            "queue": [], "counters": {}, "reward_stats": state["reward_stats"]}
