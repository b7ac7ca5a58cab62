import numpy as np
import pytest
from test_data_support import make_store

from orthon.data.config import DataConfig, StoreSource
from orthon.data.loader import IGNORE_INDEX, TrainData
from orthon.data.sampler import Permutation, Sampler


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_permutation_is_a_seeded_bijection(n):
    idx = np.arange(n)
    p = Permutation(n, seed=7)(idx)
    assert sorted(p.tolist()) == list(range(n))
    np.testing.assert_array_equal(Permutation(n, seed=7)(idx), p)  # same seed, same permutation
    np.testing.assert_array_equal(Permutation(n, seed=7)(idx[::-1]), p[::-1])  # elementwise
    if n >= 16:
        assert not np.array_equal(Permutation(n, seed=8)(idx), p)
        assert not np.array_equal(p, idx)
    with pytest.raises(IndexError):
        Permutation(n, 7)([n])


def test_epochs_cover_every_sample_once_and_reshuffle():
    s = Sampler(100, seed=3)
    ids = s.sample_ids(0, 300)
    for e in range(3):
        epoch = ids[e * 100 : (e + 1) * 100]
        assert sorted((epoch - e * 100).tolist()) == list(range(100))  # id = epoch * n + index
    assert not np.array_equal(ids[:100], ids[100:200] - 100)
    np.testing.assert_array_equal(Sampler(100, 3, shuffle=False).sample_ids(95, 105), np.arange(95, 105))


RAMP = [4, 4, 8, 8, 16, 16, 16, 32]  # a batch-size ramp: the global batch changes between steps


@pytest.mark.parametrize("world", [2, 4])
def test_same_order_at_any_world_size(world):
    single = Sampler(37, seed=11)
    ranks = [Sampler(37, seed=11) for _ in range(world)]
    for gb in RAMP:
        whole = single.next_batch(gb)
        parts = [s.next_batch(gb, rank=r, world=world) for r, s in enumerate(ranks)]
        assert all(len(p) == gb // world for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), whole)  # rank r holds the r-th slice
    assert {s.position for s in ranks} == {single.position} == {sum(RAMP)}
    with pytest.raises(ValueError, match="not divisible"):
        single.next_batch(6, 0, 4)


def test_resume_from_position_continues_exactly():
    full = Sampler(50, seed=5)
    seen = [full.next_batch(gb) for gb in RAMP]
    first = Sampler(50, seed=5)
    seen_resumed = [first.next_batch(gb) for gb in RAMP[:3]]
    state = first.state_dict()
    assert state["position"] == sum(RAMP[:3])
    # resumed at another world size: ranks' slices reassemble the same batches
    resumed = [Sampler(50, seed=5) for _ in range(2)]
    for s in resumed:
        s.load_state_dict(state)
    for gb in RAMP[3:]:
        seen_resumed.append(np.concatenate([s.next_batch(gb, r, 2) for r, s in enumerate(resumed)]))
    for a, b in zip(seen, seen_resumed):
        np.testing.assert_array_equal(a, b)
    ids = np.concatenate(seen_resumed)
    # counted by sample id: nothing seen twice, nothing skipped (within each epoch of 50)
    assert len(ids) == sum(RAMP) == 104
    assert sorted(ids[:100].tolist()) == list(range(100))
    with pytest.raises(ValueError, match="seed"):
        Sampler(50, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="n="):
        Sampler(51, seed=5).load_state_dict(state)


@pytest.fixture
def stores(tmp_path):
    rng = np.random.default_rng(0)
    docs = lambda n: [rng.integers(3, 300, size=rng.integers(1, 30)) for _ in range(n)]  # noqa: E731
    return [make_store(tmp_path / "code", [docs(30), docs(20)]), make_store(tmp_path / "math", [docs(15)])]


def test_train_data_resumes_across_world_sizes(stores):
    cfg = DataConfig(sources=[StoreSource(str(stores[0]), 3.0, "code"), StoreSource(str(stores[1]), 1.0, "math")],
                     seq_len=8, seed=9, blend_cycle=8)
    ref = TrainData(cfg)
    ref_batches = [ref.next_batch(gb) for gb in RAMP]
    # world size 2 for three steps, then a checkpoint, then world size 1 (and 4)
    two = [TrainData(cfg, r, 2) for r in range(2)]
    got = []
    for gb in RAMP[:3]:
        got.append([d.next_batch(gb) for d in two])
    state = two[0].state_dict()
    assert state == two[1].state_dict()  # every rank holds the same state
    for world in (1, 4):
        resumed = [TrainData(cfg, r, world) for r in range(world)]
        for d in resumed:
            d.load_state_dict(state)
        rest = [[d.next_batch(gb) for d in resumed] for gb in RAMP[3:]]
        for ref_b, parts in zip(ref_batches, got + rest):
            assert ref_b.sample_ids.tolist() == [i for p in parts for i in p.sample_ids.tolist()]
            assert ref_b.input_ids.tolist() == [row for p in parts for row in p.input_ids.tolist()]
        assert resumed[0].tokens_by_source == ref.tokens_by_source
    assert sum(ref.tokens_by_source.values()) == sum(RAMP) * 8


def test_batch_tensors(stores):
    cfg = DataConfig(sources=[StoreSource(str(stores[1]))], seq_len=16, seed=1, document_mask=True)
    data = TrainData(cfg)
    b = data.next_batch(4)
    assert b.input_ids.shape == b.labels.shape == b.doc_ids.shape == (4, 16)
    for i, sid in enumerate(b.sample_ids.tolist()):
        tokens, docs, _ = data.dataset[sid]
        assert b.input_ids[i].tolist() == tokens[:-1].tolist() and b.doc_ids[i].tolist() == docs[:-1].tolist()
        want = [IGNORE_INDEX if x == data.eod_id else y for x, y in zip(tokens[:-1], tokens[1:])]
        assert b.labels[i].tolist() == want  # the token after an eod is not a target under document masking
    assert (b.input_ids == data.eod_id).any()
