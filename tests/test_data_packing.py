import json

import numpy as np
import pytest
import torch

from orthon.core.errors import DataError
from orthon.data.packing import PackedDataset, num_samples
from orthon.data.store import MANIFEST, TokenStore, write_shard
from orthon.pretrain.attention import document_mask

EOD = 2


def _store(tmp_path, shards, vocab=300):
    entries = []
    for k, docs in enumerate(shards):
        write_shard(tmp_path / f"shard_{k}", docs, vocab)
        entries.append({"name": f"shard_{k}", "n_docs": len(docs), "n_tokens": sum(len(d) for d in docs)})
    (tmp_path / MANIFEST).write_text(json.dumps({"complete": True, "shards": entries, "eos_id": EOD}))
    return TokenStore(tmp_path)


def _random_docs(rng, n):
    # ids >= 3 so that an eod in the packed stream can only come from packing
    return [rng.integers(3, 300, size=rng.integers(1, 40)) for _ in range(n)]


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_every_token_is_packed_exactly_once(tmp_path, seq_len):
    rng = np.random.default_rng(seq_len)
    shards = [_random_docs(rng, 20), _random_docs(rng, 1), _random_docs(rng, 13)]
    docs = [d for s in shards for d in s]
    ds = PackedDataset(_store(tmp_path, shards), seq_len, EOD)
    stream = np.concatenate([np.append(d, EOD) for d in docs])
    stream_doc = np.concatenate([np.full(len(d) + 1, i) for i, d in enumerate(docs)])
    assert len(ds) == num_samples(len(stream), seq_len) == (len(stream) - 1) // seq_len
    samples = [ds[i] for i in range(len(ds))]
    assert all(t.shape == (seq_len + 1,) and d.shape == (seq_len + 1,) for t, d in samples)
    # consecutive samples overlap in exactly one token ...
    for (a, _), (b, _) in zip(samples, samples[1:]):
        assert a[-1] == b[0]
    # ... so the targets (tokens[1:]) of all samples are the stream, each token once, in order
    targets = np.concatenate([t[1:] for t, _ in samples])
    np.testing.assert_array_equal(targets, stream[1 : 1 + len(ds) * seq_len])
    np.testing.assert_array_equal(np.concatenate([d[1:] for _, d in samples]), stream_doc[1 : 1 + len(ds) * seq_len])
    assert ds.dropped_tokens == len(stream) - 1 - len(ds) * seq_len < seq_len
    # one eod after every document, nowhere else
    inputs = np.concatenate([samples[0][0][:1]] + [t[1:] for t, _ in samples])
    ends = np.flatnonzero(inputs == EOD)
    np.testing.assert_array_equal(ends, (np.cumsum([len(d) + 1 for d in docs]) - 1)[: len(ends)])


def test_hand_checked_window():
    class FakeStore:  # documents [5 6 7] [8] [9 10]
        path, vocab_size = "fake", 20
        offsets = np.array([0, 3, 4, 6])
        tokens = np.array([5, 6, 7, 8, 9, 10])

        def read(self, a, b):
            return self.tokens[a:b]

    ds = PackedDataset(FakeStore(), 4, EOD)
    # stream: 5 6 7 E 8 E 9 10 E  (9 tokens) -> 2 samples of 5
    assert len(ds) == 2
    t0, d0 = ds[0]
    t1, d1 = ds[1]
    assert t0.tolist() == [5, 6, 7, EOD, 8] and d0.tolist() == [0, 0, 0, 0, 1]
    assert t1.tolist() == [8, EOD, 9, 10, EOD] and d1.tolist() == [1, 1, 2, 2, 2]
    with pytest.raises(IndexError):
        ds[2]


def test_too_little_data_is_a_clear_error(tmp_path):
    store = _store(tmp_path, [[[5, 6]]])
    with pytest.raises(DataError, match="make no sample"):
        PackedDataset(store, 8, EOD)
    with pytest.raises(DataError, match="outside the vocabulary"):
        PackedDataset(store, 1, 300)


def test_document_mask_hand_checked():
    """The packed documents' ids are what the model's attention mask reads (doc_ids of a batch)."""
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = document_mask(doc_ids, doc_ids, torch.arange(6))[0].int()
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ])
    assert torch.equal(mask, expected)
    same = torch.zeros(2, 5, dtype=torch.long)
    assert torch.equal(document_mask(same, same, torch.arange(5)), torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5))
