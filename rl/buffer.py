"""The Data Buffer between rollout and training.

``dict[instance_id, list[Sample]]``: the G = num_repeat_per_sample samples of
one prompt form a group; a group is ready once it holds G samples, and the
trainer consumes each ready group exactly once (on-policy, no replay). A
buffer serves one task type; starting a new rollout task rebuilds it.

Thread-safe: rollout workers add from their threads while the trainer takes
ready groups from its own, optionally blocking until enough are ready.
A sample arriving for a group that was consumed or dropped (a straggler of the
asynchronous loop), or one too many for a full group, is refused and counted,
never stored.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace

from orthon.rl.sample import Sample, SampleStatus, sample_to_dict


@dataclass(frozen=True)
class BufferCounters:
    """Groups by state, plus the samples refused."""

    pending_groups: int  # hold 1..G-1 samples
    ready_groups: int  # hold G samples, not consumed yet
    consumed_groups: int  # handed to the trainer since the last rebuild
    dropped_groups: int  # discarded without training (drop())
    rejected_samples: int  # late (group consumed/dropped) or surplus (group full)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class DataBuffer:
    def __init__(self, group_size: int, task_type: str):
        self._lock = threading.Condition()
        self._setup(group_size, task_type)

    def _setup(self, group_size: int, task_type: str) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"group_size: must be a positive int, got {group_size!r}")
        if not isinstance(task_type, str) or not task_type:
            raise ValueError(f"task_type: must be a non-empty string, got {task_type!r}")
        self.group_size = group_size
        self.task_type = task_type
        self._pending: dict[str, list[Sample]] = {}
        self._ready: OrderedDict[str, list[Sample]] = OrderedDict()  # in the order they became ready
        self._closed: set[str] = set()  # consumed or dropped: later samples are refused
        self._consumed = 0
        self._dropped = 0
        self._rejected = 0

    def add(self, sample: Sample) -> bool:
        """Store a finished sample in its group; False (counted) if the group is closed or full."""
        if not isinstance(sample, Sample):
            raise TypeError(f"DataBuffer.add: expected a Sample, got {type(sample).__name__}")
        if sample.status is SampleStatus.PENDING:
            raise ValueError(f"sample {sample.instance_id!r}: still pending; only generated samples enter the buffer")
        task = sample.metadata.get("task_type", self.task_type)
        if task != self.task_type:
            raise ValueError(
                f"sample {sample.instance_id!r}: task_type {task!r} in a buffer for {self.task_type!r}; "
                "rebuild the buffer to start another task"
            )
        key = sample.instance_id
        with self._lock:
            if key in self._closed or key in self._ready:
                self._rejected += 1
                return False
            group = self._pending.setdefault(key, [])
            group.append(sample)
            if len(group) == self.group_size:
                self._ready[key] = self._pending.pop(key)
                self._lock.notify_all()
            return True

    def add_many(self, samples) -> int:
        """Add each sample; the number stored."""
        return sum(self.add(s) for s in samples)

    def take_ready(self, max_groups: int | None = None) -> list[list[Sample]]:
        """Remove and return up to ``max_groups`` ready groups (oldest first), without waiting."""
        with self._lock:
            return self._take(max_groups)

    def wait_ready(self, num_groups: int, timeout: float | None = None) -> list[list[Sample]]:
        """Block until ``num_groups`` groups are ready, then take exactly that many.

        On timeout returns what is ready (possibly fewer, possibly none) so the caller can decide.
        """
        if num_groups <= 0:
            raise ValueError(f"num_groups: must be positive, got {num_groups}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while len(self._ready) < num_groups:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._lock.wait(remaining)
            return self._take(num_groups)

    def _take(self, max_groups: int | None) -> list[list[Sample]]:
        count = len(self._ready) if max_groups is None else min(max_groups, len(self._ready))
        groups = []
        for _ in range(count):
            key, group = self._ready.popitem(last=False)
            self._closed.add(key)
            groups.append(group)
        self._consumed += count
        return groups

    def drop(self, instance_id: str) -> bool:
        """Discard a pending or ready group (e.g. its prompt failed); its later samples are refused."""
        with self._lock:
            group = self._pending.pop(instance_id, None)
            if group is None:
                group = self._ready.pop(instance_id, None)
            if group is None:
                return False
            self._closed.add(instance_id)
            self._dropped += 1
            return True

    def counters(self) -> BufferCounters:
        with self._lock:
            return BufferCounters(
                pending_groups=len(self._pending),
                ready_groups=len(self._ready),
                consumed_groups=self._consumed,
                dropped_groups=self._dropped,
                rejected_samples=self._rejected,
            )

    def rebuild(self, task_type: str, group_size: int | None = None) -> BufferCounters:
        """Start a new rollout task: empty the buffer, reset the counters; returns the old counters.

        Groups still pending or ready are discarded and counted as dropped in the returned counters.
        """
        with self._lock:
            now = self.counters()
            final = replace(now, pending_groups=0, ready_groups=0,
                            dropped_groups=now.dropped_groups + now.pending_groups + now.ready_groups)
            self._setup(self.group_size if group_size is None else group_size, task_type)
            self._lock.notify_all()
            return final

    def state_dict(self) -> dict:
        """Everything a resumed run needs: partial and ready groups, the closed ids, the counters."""
        with self._lock:
            return {"group_size": self.group_size, "task_type": self.task_type,
                    "pending": {k: [sample_to_dict(s) for s in g] for k, g in self._pending.items()},
                    "ready": [[k, [sample_to_dict(s) for s in g]] for k, g in self._ready.items()],
                    "closed": sorted(self._closed), "consumed": self._consumed, "dropped": self._dropped,
                    "rejected": self._rejected}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self._setup(state["group_size"], state["task_type"])
            self._pending = {k: [Sample(**s) for s in g] for k, g in state["pending"].items()}
            self._ready = OrderedDict((k, [Sample(**s) for s in g]) for k, g in state["ready"])
            self._closed = set(state["closed"])
            self._consumed, self._dropped, self._rejected = state["consumed"], state["dropped"], state["rejected"]
            self._lock.notify_all()

    def __len__(self) -> int:
        """Samples held (pending and ready groups)."""
        with self._lock:
            return sum(map(len, self._pending.values())) + sum(map(len, self._ready.values()))
