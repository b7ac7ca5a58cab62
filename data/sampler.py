"""A deterministic, resumable sampler whose whole state is one position.

The global order is a function of (seed, position) only: position ``p`` is in
epoch ``e = p // n`` and names sample ``e * n + perm_e(p % n)``, where
``perm_e`` is a seeded pseudo-random permutation of ``range(n)`` computed on
demand (a Feistel network with cycle walking: O(1) memory, any ``n``). That
number is the sample's id: stable, unique, and ``id % n`` is the dataset
index.

Each step takes the next ``global_batch`` positions; rank ``r`` of ``w``
takes the ``r``-th contiguous slice of ``global_batch / w``. The ranks'
slices together are exactly the world-size-1 batch, so the order does not
depend on the world size, and resuming from a saved position continues it
exactly (also with a different world size, or a batch size that ramps).
"""
from __future__ import annotations

import numpy as np

_ROUNDS = 4


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser of ``x ^ key`` (uint64 arrays, wrapping arithmetic)."""
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Permutation:
    """A seeded bijection of ``range(n)``, evaluated elementwise on integer arrays."""

    def __init__(self, n: int, seed: int, key: int = 0):
        if n < 1:
            raise ValueError(f"n must be positive, got {n}")
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        bits += bits % 2  # balanced Feistel halves
        self.half = np.uint64(bits // 2)
        self.half_mask = np.uint64((1 << (bits // 2)) - 1)
        state = np.random.SeedSequence([seed & (2**63 - 1), key & (2**63 - 1)]).generate_state(_ROUNDS, np.uint64)
        self.keys = [np.uint64(k) for k in state]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.half_mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right, k) & self.half_mask)
        return (left << self.half) | right

    def __call__(self, index) -> np.ndarray:
        x = np.asarray(index, dtype=np.uint64).copy()
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index out of range [0, {self.n})")
        # Cycle walking: the Feistel domain is the next power of four; re-apply until back in range.
        out = self._feistel(x)
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._feistel(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


class Sampler:
    """Global order over a dataset of ``n`` samples; ``state_dict()`` is ``{"position": ...}`` plus checks."""

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True):
        if n < 1:
            raise ValueError(f"dataset has no samples (n={n})")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.position = 0
        self._perms: dict[int, Permutation] = {}

    def _perm(self, epoch: int) -> Permutation:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.clear()
            self._perms[epoch] = Permutation(self.n, self.seed, key=epoch)
        return self._perms[epoch]

    def sample_ids(self, start: int, stop: int) -> np.ndarray:
        """Ids of the samples at global positions [start, stop)."""
        pos = np.arange(start, stop, dtype=np.int64)
        epoch, within = np.divmod(pos, self.n)
        if not self.shuffle:
            return pos
        out = np.empty_like(pos)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = int(e) * self.n + self._perm(int(e))(within[sel])
        return out

    def next_batch(self, global_batch: int, rank: int = 0, world: int = 1) -> np.ndarray:
        """This rank's slice of the next global batch (sample ids); advances the position by ``global_batch``."""
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world size {world}")
        per_rank = global_batch // world
        start = self.position + rank * per_rank
        ids = self.sample_ids(start, start + per_rank)
        self.position += global_batch
        return ids

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "n": self.n, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "n", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r}, this sampler {key}={getattr(self, key)!r}: "
                    "the data or seed changed since the checkpoint"
                )
        self.position = int(state["position"])
