"""Weighted blending of several packed stores, with exact token accounting per source.

Weights become integer sample counts per cycle of ``cycle`` samples (largest
remainder, so they sum to the cycle exactly); within a cycle each source's
samples are spread evenly (the k-th of ``c`` sits near ``(k + 1/2) / c`` of the
cycle). Blend index ``j`` is in cycle ``j // cycle``; its source and the
source's own sample counter follow in O(1), so any ``j >= 0`` is valid: a
source whose samples run out starts over (it is up-sampled), and a source is
never cut short by an epoch boundary of the blend.

Every sample is ``seq_len`` target tokens, so tokens per source are exactly
``seq_len`` times its sample count; ``tokens_by_source`` counts them for any
set of blend indices (what a training step consumed).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from orthon.data.packing import PackedDataset
from orthon.core.errors import ConfigError


def cycle_counts(weights: Sequence[float], cycle: int) -> np.ndarray:
    """Integer samples per source in one cycle: proportional to ``weights``, summing to ``cycle``."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(w > 0) or not np.all(np.isfinite(w)):
        raise ConfigError(f"weights: need one positive number per source, got {list(weights)}")
    quota = w / w.sum() * cycle
    counts = np.floor(quota).astype(np.int64)
    short = cycle - int(counts.sum())
    # Largest fractional parts first; ties go to the earlier source.
    order = np.lexsort((np.arange(w.size), -(quota - counts)))
    counts[order[:short]] += 1
    if np.any(counts == 0):
        smallest = int(np.argmin(counts))
        raise ConfigError(
            f"blend_cycle: {cycle} samples per cycle give source {smallest} (weight {weights[smallest]}) "
            "no sample; raise blend_cycle"
        )
    return counts


def cycle_pattern(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, k) for each slot of a cycle: source s's k-th sample sits at ideal time (k + 1/2) / counts[s]."""
    sources = np.repeat(np.arange(len(counts)), counts)
    ranks = np.concatenate([np.arange(c) for c in counts])
    ideal = (ranks + 0.5) / counts[sources]
    order = np.lexsort((sources, ideal))
    return sources[order], ranks[order]


class BlendedDataset:
    """Blend index ``j`` -> (source, that source's sample); ``len`` is the epoch the sampler shuffles over."""

    def __init__(
        self,
        datasets: Sequence[PackedDataset],
        weights: Sequence[float],
        names: Sequence[str] | None = None,
        cycle: int = 10_000,
        num_samples: int = 0,
    ):
        if not datasets:
            raise ConfigError("sources: no data source given")
        if len(weights) != len(datasets):
            raise ConfigError(f"weights: {len(weights)} weights for {len(datasets)} sources")
        seq_lens = {d.seq_len for d in datasets}
        if len(seq_lens) != 1:
            raise ConfigError(f"seq_len: sources packed with different lengths {sorted(seq_lens)}")
        self.datasets = list(datasets)
        self.names = list(names) if names else [f"source{i}" for i in range(len(datasets))]
        self.seq_len = seq_lens.pop()
        self.cycle = cycle
        self.counts = cycle_counts(weights, cycle)
        self.pattern_source, self.pattern_rank = cycle_pattern(self.counts)
        self.sizes = np.array([len(d) for d in datasets], dtype=np.int64)
        self.num_samples = num_samples or int(self.sizes.sum())

    def __len__(self) -> int:
        return self.num_samples

    def locate(self, j) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For blend indices ``j``: (source, the source's sample counter, index into the source's dataset)."""
        j = np.asarray(j, dtype=np.int64)
        cyc, slot = np.divmod(j, self.cycle)
        source = self.pattern_source[slot]
        counter = cyc * self.counts[source] + self.pattern_rank[slot]
        return source, counter, counter % self.sizes[source]

    def __getitem__(self, j: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(tokens, doc_ids, source) of blend index ``j``."""
        source, _, local = self.locate([j])
        tokens, doc_ids = self.datasets[int(source[0])][int(local[0])]
        return tokens, doc_ids, int(source[0])

    def samples_by_source(self, j) -> np.ndarray:
        source, _, _ = self.locate(j)
        return np.bincount(source, minlength=len(self.datasets))

    def tokens_by_source(self, j) -> dict[str, int]:
        """Target tokens per source name among blend indices ``j``."""
        counts = self.samples_by_source(j)
        return {name: int(c) * self.seq_len for name, c in zip(self.names, counts)}

    def planned_samples(self, num: int) -> np.ndarray:
        """Samples per source among blend indices [0, num), computed in closed form."""
        full, rest = divmod(num, self.cycle)
        return full * self.counts + np.bincount(self.pattern_source[:rest], minlength=len(self.datasets))
