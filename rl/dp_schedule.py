"""DP scheduling: pack samples into micro-batches, then spread micro-batches over DP ranks.

Step 1, pack: every micro-batch holds at most ``capacity`` tokens (first-fit
decreasing, or FLOPs-balanced: heaviest sample first into the lightest
micro-batch that has room). Step 2, distribute: micro-batches go to ranks by
strided round-robin (rank r takes r, r + k, r + 2k, ...) or by the
Karmarkar-Karp largest-differencing method on their FLOPs. Together they keep
every rank's FLOPs close, which is what stops one long agent trajectory from
making every other rank wait. Balance is max / mean of the ranks' loads
(1.0 is perfect).

FLOPs of one sample of L tokens. A forward pass costs about 2 * P * L for the
weight matmuls (P active parameters) plus, in each of n layers of causal
attention, L^2 / 2 query-key pairs times 2 * (d_qk + d_v) for the scores and the
weighted sum (d_qk, d_v: summed over heads). The backward pass is about twice
the forward for both terms, so up to a constant

    flops(L) = L * (1 + L / L0),   L0 = 2 * P / (n * (d_qk + d_v)),

L0 being the length where attention costs as much per token as the rest.
Plain Python and numpy; no torch.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def attention_crossover_tokens(active_params: float, num_layers: int, qk_width: int, v_width: int) -> float:
    """L0 = 2 P / (n (d_qk + d_v)): the length where attention FLOPs per token equal the rest's."""
    return 2.0 * active_params / (num_layers * (qk_width + v_width))


def sample_flops(lengths: Sequence[int], attention_crossover: float = 32768.0) -> np.ndarray:
    """Relative training FLOPs of samples of these lengths: L * (1 + L / L0), float64."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths * (1.0 + lengths / attention_crossover)


def _check_lengths(lengths: Sequence[int], capacity: int, oversized_alone: bool = False) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if capacity <= 0:
        raise ValueError(f"capacity: must be positive, got {capacity}")
    if lengths.ndim != 1 or (lengths < 0).any():
        raise ValueError("lengths: must be a 1-D sequence of non-negative token counts")
    too_long = np.flatnonzero(lengths > capacity)
    if too_long.size and not oversized_alone:
        i = int(too_long[0])
        raise ValueError(
            f"sample {i} has {int(lengths[i])} tokens, more than the micro-batch capacity {capacity} "
            f"({too_long.size} such samples); raise the capacity or drop them before scheduling"
        )
    return lengths


def pack_first_fit(lengths: Sequence[int], capacity: int, *, decreasing: bool = True) -> list[list[int]]:
    """Sample indices per micro-batch: each sample goes into the first micro-batch with room.

    ``decreasing`` (first-fit decreasing) places the longest samples first, which needs at most
    11/9 OPT + 1 micro-batches. Micro-batches come out in the order they were opened.
    """
    lengths = _check_lengths(lengths, capacity)
    order = np.argsort(-lengths, kind="stable") if decreasing else np.arange(len(lengths))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(int(i))
                room[b] -= n
                break
        else:
            bins.append([int(i)])
            room.append(capacity - n)
    return bins


def pack_padded(lengths: Sequence[int], capacity: int, *, max_samples: int | None = None) -> list[list[int]]:
    """Sample indices per micro-batch for right-padded batches (orthon's: a micro-batch runs as samples x
    its longest sample): longest first, each micro-batch a run of the sorted samples while (count + 1) x
    its first (longest) length stays within ``capacity`` and count within ``max_samples``. Runs of sorted
    lengths pad the least; a subset of a micro-batch still fits, so split_to_multiple may halve one. A
    sample longer than ``capacity`` runs alone (a long trajectory must not stop a run)."""
    lengths = _check_lengths(lengths, capacity, oversized_alone=True)
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples: must be positive, got {max_samples}")
    bins: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable"):
        if (bins and (len(bins[-1]) + 1) * int(lengths[bins[-1][0]]) <= capacity
                and (max_samples is None or len(bins[-1]) < max_samples)):
            bins[-1].append(int(i))
        else:
            bins.append([int(i)])
    return bins


def padded_cost(bins: Sequence[Sequence[int]], costs: Sequence[float]) -> np.ndarray:
    """What each padded micro-batch costs: samples x the costliest (longest) sample's cost."""
    costs = np.asarray(costs, dtype=np.float64)
    return np.array([len(b) * costs[list(b)].max() if len(b) else 0.0 for b in bins])


def pack_flops_balanced(lengths: Sequence[int], capacity: int, *,
                        weights: Sequence[float] | None = None) -> list[list[int]]:
    """Sample indices per micro-batch, FLOPs balanced across micro-batches under the token capacity.

    Starts from as many micro-batches as first-fit decreasing needs, then places samples heaviest first
    (``weights``, default sample_flops(lengths)) into the lightest micro-batch that still has room,
    opening a new one only when none has.
    """
    lengths = _check_lengths(lengths, capacity)
    weights = sample_flops(lengths) if weights is None else np.asarray(weights, dtype=np.float64)
    if weights.shape != lengths.shape:
        raise ValueError(f"weights: {weights.shape[0]} values for {lengths.shape[0]} samples")
    count = max(len(pack_first_fit(lengths, capacity)), 1 if len(lengths) else 0)
    bins: list[list[int]] = [[] for _ in range(count)]
    load = [0.0] * count
    room = [capacity] * count
    for i in np.lexsort((np.arange(len(lengths)), -weights)):  # heaviest first, ties by index
        n, w = int(lengths[i]), float(weights[i])
        fitting = [b for b in range(len(bins)) if room[b] >= n]
        if fitting:
            b = min(fitting, key=lambda j: (load[j], j))
        else:
            bins.append([])
            load.append(0.0)
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(int(i))
        load[b] += w
        room[b] -= n
    return [b for b in bins if b]


def split_to_multiple(bins: list[list[int]], weights: Sequence[float], multiple: int) -> list[list[int]]:
    """Split micro-batches until their number is a multiple of ``multiple`` (e.g. the DP size).

    Splits the heaviest micro-batch with two or more samples into two balanced halves (a subset
    of a micro-batch always fits its capacity). When none can be split, appends empty
    micro-batches: a rank given one runs no samples (or a zero-weight dummy) that step.
    """
    weights = np.asarray(weights, dtype=np.float64)
    bins = [list(b) for b in bins]
    while len(bins) % multiple:
        splittable = [b for b in range(len(bins)) if len(bins[b]) >= 2]
        if not splittable:
            bins.extend([] for _ in range(multiple - len(bins) % multiple))
            break
        b = max(splittable, key=lambda j: (weights[bins[j]].sum(), -j))
        halves: list[list[int]] = [[], []]
        half_load = [0.0, 0.0]
        for i in sorted(bins[b], key=lambda j: -weights[j]):
            side = 0 if half_load[0] <= half_load[1] else 1
            halves[side].append(i)
            half_load[side] += weights[i]
        bins[b] = halves[0]
        bins.insert(b + 1, halves[1])
    return bins


def distribute_round_robin(num_items: int, world_size: int) -> list[list[int]]:
    """Strided round-robin: rank r gets items r, r + world_size, r + 2 * world_size, ..."""
    if world_size <= 0:
        raise ValueError(f"world_size: must be positive, got {world_size}")
    return [list(range(r, num_items, world_size)) for r in range(world_size)]


def distribute_karmarkar_karp(
    weights: Sequence[float], world_size: int, *, equal_count: bool = False, refine: bool = True
) -> list[list[int]]:
    """Item indices per rank by the Karmarkar-Karp largest differencing method, k-way.

    Every item starts as a partial partition (itself in one of k subsets, the others empty);
    the two partial partitions with the largest spread (max - min subset sum) are merged,
    the heaviest subset of one with the lightest of the other, until one partition is left.
    ``equal_count``: every rank gets len(weights) / world_size items (which must divide); the
    starting partitions are then runs of k consecutive items of the sorted weights, one per
    subset, and merging keeps counts equal. ``refine`` then runs a local search of moves (swaps
    only, with equal_count) off the heaviest rank, which closes much of the remaining gap to the
    optimum. Ties are broken by index, so the result is deterministic.
    """
    weights = np.asarray(weights, dtype=np.float64)
    k, n = world_size, len(weights)
    if k <= 0:
        raise ValueError(f"world_size: must be positive, got {k}")
    if equal_count and n % k:
        raise ValueError(f"equal_count: {n} items do not split evenly over {k} ranks")
    if n == 0:
        return [[] for _ in range(k)]
    order = [int(i) for i in np.lexsort((np.arange(n), -weights))]
    # A partial partition: k (sum, items) subsets, heaviest first.
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    tie = itertools.count()
    if equal_count:
        for start in range(0, n, k):
            chunk = order[start:start + k]
            subsets = sorted(((float(weights[i]), [i]) for i in chunk), key=lambda s: -s[0])
            heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), next(tie), subsets))
    else:
        for i in order:
            subsets = [(float(weights[i]), [i])] + [(0.0, []) for _ in range(k - 1)]
            heapq.heappush(heap, (-float(weights[i]), next(tie), subsets))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    ranks = [sorted(items) for _, items in heap[0][2]]
    return _refine(ranks, weights, allow_moves=not equal_count) if refine else ranks


def _refine(ranks: list[list[int]], weights: np.ndarray, *, allow_moves: bool) -> list[list[int]]:
    """Local search after differencing: while moving one item off the heaviest rank, or swapping
    one of its items with another rank's, lowers the heavier of the two ranks involved, apply the
    best such change. Loads only improve; swaps keep the item counts."""
    ranks = [list(r) for r in ranks]
    loads = np.array([weights[r].sum() for r in ranks], dtype=np.float64)
    tolerance = 1e-12 * max(loads.max(), 1e-300)
    for _ in range(2 * sum(map(len, ranks)) + 10):
        h = int(np.argmax(loads))
        wh = weights[ranks[h]]
        best = None  # (new max of the pair, other rank, position out of h, position into h or None)
        for o in range(len(ranks)):
            if o == h:
                continue
            if allow_moves and wh.size:
                pair = np.maximum(loads[h] - wh, loads[o] + wh)
                i = int(np.argmin(pair))
                if pair[i] < loads[h] - tolerance and (best is None or pair[i] < best[0]):
                    best = (pair[i], o, i, None)
            wo = weights[ranks[o]]
            if wh.size and wo.size:
                delta = wh[:, None] - wo[None, :]
                pair = np.where(delta > 0, np.maximum(loads[h] - delta, loads[o] + delta), np.inf)
                i, j = np.unravel_index(int(np.argmin(pair)), pair.shape)
                if pair[i, j] < loads[h] - tolerance and (best is None or pair[i, j] < best[0]):
                    best = (pair[i, j], o, int(i), int(j))
        if best is None:
            break
        _, o, i, j = best
        item = ranks[h].pop(i)
        if j is not None:
            back = ranks[o].pop(j)
            ranks[h].append(back)
            loads[h] += weights[back]
            loads[o] -= weights[back]
        ranks[o].append(item)
        loads[h] -= weights[item]
        loads[o] += weights[item]
    return [sorted(r) for r in ranks]


def rank_loads(assignment: Sequence[Sequence[int]], weights: Sequence[float]) -> np.ndarray:
    weights = np.asarray(weights, dtype=np.float64)
    return np.array([weights[list(items)].sum() if len(items) else 0.0 for items in assignment])


def load_balance(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads; 1.0 is perfect balance (and the value for all-zero loads)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def optimal_partition_bruteforce(
    weights: Sequence[float], world_size: int, *, equal_count: bool = False
) -> tuple[list[list[int]], float]:
    """The partition with the smallest max load, by exhaustive search (a test reference, n <= 12).

    Enumerates assignments up to a relabelling of the ranks (item i may open at most one new rank).
    """
    weights = np.asarray(weights, dtype=np.float64)
    n, k = len(weights), world_size
    if n > 12:
        raise ValueError(f"optimal_partition_bruteforce: {n} items is too many (at most 12)")
    if equal_count and n % k:
        raise ValueError(f"equal_count: {n} items do not split evenly over {k} ranks")
    best: tuple[float, list[int]] = (math.inf, [])
    assign = [0] * n
    loads = [0.0] * k
    counts = [0] * k
    cap = n // k if equal_count else n

    def search(i: int, used: int) -> None:
        nonlocal best
        if max(loads) >= best[0]:
            return
        if i == n:
            best = (max(loads), list(assign))
            return
        for r in range(min(used + 1, k)):
            if counts[r] == cap:
                continue
            assign[i], loads[r], counts[r] = r, loads[r] + weights[i], counts[r] + 1
            search(i + 1, max(used, r + 1))
            loads[r], counts[r] = loads[r] - weights[i], counts[r] - 1

    search(0, 0)
    parts = [[i for i in range(n) if best[1][i] == r] for r in range(k)]
    return parts, best[0]


@dataclass
class DPSchedule:
    """Micro-batches (sample indices) and which ranks run them."""

    micro_batches: list[list[int]]
    rank_micro_batches: list[list[int]]  # per rank, indices into micro_batches
    rank_loads: np.ndarray  # FLOPs per rank
    balance: float  # max / mean of rank_loads
    empty_micro_batches: int  # padding added so every rank runs the same number

    def samples_for_rank(self, rank: int) -> list[list[int]]:
        """Sample indices of each micro-batch rank ``rank`` runs, in order."""
        return [self.micro_batches[m] for m in self.rank_micro_batches[rank]]


def schedule(
    lengths: Sequence[int],
    world_size: int,
    capacity: int,
    *,
    packing: str = "first_fit",
    distribution: str = "karmarkar_karp",
    attention_crossover: float = 32768.0,
    equal_micro_batches: bool = True,
    max_samples: int | None = None,
) -> DPSchedule:
    """Pack then distribute (see the module docstring); strategies as in DPScheduleConfig. ``padded``:
    micro-batches cost samples x their longest (``max_samples`` caps their size), else the sum of
    their samples (packed sequences)."""
    flops = sample_flops(lengths, attention_crossover)
    if packing == "padded":
        bins = pack_padded(lengths, capacity, max_samples=max_samples)
    elif packing == "first_fit":
        bins = pack_first_fit(lengths, capacity)
    elif packing == "flops":
        bins = pack_flops_balanced(lengths, capacity, weights=flops)
    else:
        raise ValueError(f"packing: must be 'padded', 'first_fit' or 'flops', got {packing!r}")
    empty_before = 0
    if equal_micro_batches:
        bins = split_to_multiple(bins, flops, world_size)
        empty_before = sum(1 for b in bins if not b)
    if packing == "padded":
        bin_flops = padded_cost(bins, flops)
    else:
        bin_flops = np.array([flops[b].sum() if b else 0.0 for b in bins])
    if distribution == "round_robin":
        ranks = distribute_round_robin(len(bins), world_size)
    elif distribution == "karmarkar_karp":
        ranks = distribute_karmarkar_karp(bin_flops, world_size, equal_count=equal_micro_batches)
    else:
        raise ValueError(f"distribution: must be 'round_robin' or 'karmarkar_karp', got {distribution!r}")
    loads = rank_loads(ranks, bin_flops)
    return DPSchedule(bins, ranks, loads, load_balance(loads), empty_before)


def schedule_from_config(lengths: Sequence[int], world_size: int, config, max_samples: int | None = None) -> DPSchedule:
    return schedule(
        lengths, world_size, config.micro_batch_tokens, packing=config.packing,
        distribution=config.distribution, attention_crossover=config.attention_crossover_tokens,
        equal_micro_batches=config.equal_micro_batches, max_samples=max_samples,
    )
