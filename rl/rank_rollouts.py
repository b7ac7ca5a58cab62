"""Synchronous rollouts shared by the data-parallel ranks of a torchrun job.

Rank 0's RolloutManager draws each round's prompts, as in one process; ``RankRollouts.roll`` hands each
rank a contiguous share of them, every rank generates and scores its share on its own engine (each a
copy of the policy, updated every iteration from the rank's own DDP weights), and rank 0 gathers the
samples, with the rollout plug-ins' counters and the reward statistics, so that it stores and logs what
one process would. A prompt's requests draw their seeds from its index in the prompt stream, so the
samples do not depend on the world size. The other ranks ``serve`` until rank 0 says the iteration's
rounds are done. An error on any rank reaches rank 0 as that round's error (an engine down as
EngineUnavailable, retried there), so no rank is left waiting.
"""
from __future__ import annotations

import collections

from orthon.core import distributed
from orthon.core.errors import EngineUnavailable
from orthon.rl.rewards.registry import COUNTS

STOP = "stop"


def shares(items: list, world: int) -> list[list]:
    """``items`` cut into ``world`` contiguous runs, as even as can be (the first ones longer)."""
    size, extra = divmod(len(items), world)
    bounds = [r * size + min(r, extra) for r in range(world + 1)]
    return [items[bounds[r]: bounds[r + 1]] for r in range(world)]


class RankRollouts:
    def __init__(self, manager, rank: int, world: int):
        self.manager, self.rank, self.world = manager, rank, world

    def _roll_share(self, items: list) -> tuple:
        """(samples, counter increments, reward-count increments, reward's last problem, error or None)."""
        manager, stats = self.manager, self.manager.reward.stats
        counters, reward, failures = collections.Counter(manager.counters), stats.as_dict(), stats.failures
        samples, error = [], None
        try:
            samples = manager._roll(items) if items else []
        except Exception as exc:  # noqa: BLE001 - sent to rank 0, which raises it for the round
            error = (isinstance(exc, EngineUnavailable), f"rank {self.rank}: {type(exc).__name__}: {exc}")
        after = stats.as_dict()
        problem = after["last_problem"] if stats.failures > failures else ""
        return samples, manager.counters - counters, {k: after[k] - reward[k] for k in COUNTS}, problem, error

    def roll(self, items: list) -> list:
        """Rank 0: every rank's share of ``items`` rolled, in ``items``' order."""
        parts = shares(items, self.world)
        distributed.broadcast_object(parts)
        own = self._roll_share(parts[0])
        results = distributed.gather_object(own)
        samples = []
        for rank, (part, counters, rewards, problem, error) in enumerate(results):
            if error is not None:
                unavailable, message = error
                raise (EngineUnavailable if unavailable else RuntimeError)(message)
            samples += part
            if rank:  # rank 0's own counts are in its manager already
                self.manager.counters.update(counters)
                self.manager.reward.stats.add(rewards, problem)
        return samples

    def serve(self) -> None:
        """Ranks > 0: roll the shares rank 0 hands out until it says the iteration's rounds are done."""
        while (parts := distributed.broadcast_object(None)) != STOP:
            distributed.gather_object(self._roll_share(parts[self.rank]))

    def stop(self) -> None:
        """Rank 0: the iteration's rounds are done."""
        distributed.broadcast_object(STOP)
