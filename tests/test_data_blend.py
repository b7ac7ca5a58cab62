import numpy as np
import pytest
from test_data_support import make_store

from orthon.data.blend import BlendedDataset, cycle_counts, cycle_pattern
from orthon.data.config import DataConfig, StoreSource
from orthon.data.loader import TrainData
from orthon.data.packing import PackedDataset
from orthon.data.sampler import Sampler
from orthon.data.store import TokenStore
from orthon.core.errors import ConfigError


def test_cycle_counts_hand_checked():
    assert cycle_counts([0.5, 0.3, 0.2], 10).tolist() == [5, 3, 2]
    assert cycle_counts([1, 1, 1], 10).tolist() == [4, 3, 3]  # remainder to the earliest on a tie
    assert cycle_counts([1, 2], 10).tolist() == [3, 7]  # 3.33 / 6.67: the larger fraction gets the extra
    assert cycle_counts([7], 5).tolist() == [5]
    with pytest.raises(ConfigError, match="raise blend_cycle"):
        cycle_counts([1000, 1], 100)
    with pytest.raises(ConfigError, match="positive"):
        cycle_counts([1, 0], 10)


def test_cycle_pattern_spreads_sources():
    sources, ranks = cycle_pattern(np.array([5, 3, 2]))
    assert np.bincount(sources).tolist() == [5, 3, 2]
    for s in range(3):
        assert ranks[sources == s].tolist() == list(range([5, 3, 2][s]))  # k-th occurrence in order
    assert sources.tolist() == [0, 1, 2, 0, 0, 1, 0, 2, 1, 0]


@pytest.fixture
def packed(tmp_path):
    rng = np.random.default_rng(0)
    out = []
    for name, n_docs in [("a", 40), ("b", 12), ("c", 5)]:
        docs = [rng.integers(3, 300, size=rng.integers(1, 30)) for _ in range(n_docs)]
        out.append(PackedDataset(TokenStore(make_store(tmp_path / name, [docs])), 8, 2))
    return out


def test_blend_accounting_is_exact(packed):
    blend = BlendedDataset(packed, [0.5, 0.3, 0.2], ["a", "b", "c"], cycle=10, num_samples=200)
    # a full epoch of the shuffled order holds exactly the planned samples per source
    sampler = Sampler(len(blend), seed=4)
    consumed = np.concatenate([sampler.next_batch(8) for _ in range(25)])
    assert sorted(consumed.tolist()) == list(range(200))
    assert blend.samples_by_source(consumed).tolist() == blend.planned_samples(200).tolist() == [100, 60, 40]
    assert blend.tokens_by_source(consumed) == {"a": 800, "b": 480, "c": 320}
    # counting the samples themselves agrees with the accounting
    counted = np.bincount([blend[int(j)][2] for j in consumed], minlength=3)
    assert counted.tolist() == [100, 60, 40]
    # a partial cycle: closed form equals counting
    for num in (1, 7, 13, 199):
        assert blend.planned_samples(num).tolist() == blend.samples_by_source(np.arange(num)).tolist()


def test_small_sources_are_upsampled_evenly(packed):
    blend = BlendedDataset(packed, [0.5, 0.3, 0.2], ["a", "b", "c"], cycle=10)
    size_c = len(packed[2])
    source, counter, local = blend.locate(np.arange(10 * 10 * size_c))
    on_c = local[source == 2]
    # each of c's samples is used exactly as often as every other one
    assert np.bincount(on_c, minlength=size_c).tolist() == [20] * size_c
    assert counter[source == 2].tolist() == list(range(20 * size_c))  # the counter never skips
    tokens, doc_ids, s = blend[int(np.flatnonzero(source == 2)[3])]
    ref_tokens, ref_docs = packed[2][3 % size_c]
    assert s == 2 and tokens.tolist() == ref_tokens.tolist() and doc_ids.tolist() == ref_docs.tolist()


def test_train_data_counts_tokens_per_source(packed, tmp_path):
    cfg = DataConfig(sources=[StoreSource(str(tmp_path / "a"), 0.5), StoreSource(str(tmp_path / "b"), 0.3),
                              StoreSource(str(tmp_path / "c"), 0.2)], seq_len=8, seed=2, blend_cycle=10,
                     num_samples=100)
    data = TrainData(cfg, rank=1, world=2)
    seen = []
    for _ in range(25):
        seen.append(data.next_batch(4).source_ids)  # this rank's half of each batch of 4
    assert data.tokens_by_source == {"a": 400, "b": 240, "c": 160}  # whole global batches, exactly
    assert sum(len(s) for s in seen) == 50


def test_blend_config_errors(packed):
    with pytest.raises(ConfigError, match="2 weights for 3 sources"):
        BlendedDataset(packed, [1, 1], cycle=10)
    with pytest.raises(ConfigError, match="no data source"):
        BlendedDataset([], [])
    with pytest.raises(ConfigError, match="weight"):
        StoreSource("x", weight=0)
