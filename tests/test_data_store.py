import json

import numpy as np
import pytest

from orthon.data.store import MANIFEST, Shard, ShardWriter, StoreError, TokenStore, token_dtype, write_shard


def _docs(rng, n, vocab, max_len=50):
    return [rng.integers(0, vocab, size=rng.integers(0, max_len)) for _ in range(n)]


def test_dtype_follows_vocab_size():
    assert token_dtype(1000) == np.uint16
    assert token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32
    assert token_dtype(154880) == np.uint32


@pytest.mark.parametrize("vocab", [1000, 154880])
def test_round_trip(tmp_path, vocab):
    rng = np.random.default_rng(0)
    docs = _docs(rng, 200, vocab)
    docs[3] = np.array([vocab - 1, 0], dtype=np.int64)  # extremes of the id range survive
    write_shard(tmp_path / "s", docs, vocab)
    store = TokenStore(tmp_path / "s")
    assert store.n_docs == 200 and store.n_tokens == sum(len(d) for d in docs)
    assert store.shards[0].tokens.dtype == token_dtype(vocab)
    assert (tmp_path / "s.bin").stat().st_size == store.n_tokens * token_dtype(vocab).itemsize
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(store.doc(i), d)
    np.testing.assert_array_equal(store.read(0, store.n_tokens), np.concatenate(docs))


def test_out_of_range_ids_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        write_shard(tmp_path / "s", [[1, 2, 1000]], 1000)
    assert not list(tmp_path.iterdir())  # nothing left, not even temporary files


def test_failed_writer_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "s", 100) as w:
            w.add([1, 2, 3])
            raise RuntimeError("crash")
    assert not list(tmp_path.iterdir())


def _write_store(directory, shards, vocab=500, complete=True):
    directory.mkdir(exist_ok=True)
    entries = []
    for k, docs in enumerate(shards):
        write_shard(directory / f"shard_{k}", docs, vocab)
        entries.append({"name": f"shard_{k}", "n_docs": len(docs), "n_tokens": int(sum(len(d) for d in docs))})
    (directory / MANIFEST).write_text(json.dumps({"complete": complete, "shards": entries, "vocab_size": vocab,
                                                  "eos_id": 2}))


def test_multi_shard_store_reads_across_boundaries(tmp_path):
    rng = np.random.default_rng(1)
    shards = [_docs(rng, 5, 500), _docs(rng, 1, 500), [], _docs(rng, 7, 500)]
    _write_store(tmp_path / "st", shards)
    store = TokenStore(tmp_path / "st")
    flat_docs = [d for s in shards for d in s]
    assert store.n_docs == len(flat_docs) and store.eos_id == 2
    everything = np.concatenate(flat_docs)
    for start, stop in [(0, len(everything)), (3, 90), (len(everything) - 1, len(everything)), (10, 10)]:
        np.testing.assert_array_equal(store.read(start, stop), everything[start:stop])
    for i, d in enumerate(flat_docs):
        np.testing.assert_array_equal(store.doc(i), d)
    assert [len(d) for d in store] == [len(d) for d in flat_docs]


def test_incomplete_store_is_refused(tmp_path):
    _write_store(tmp_path / "st", [[[1, 2]]], complete=False)
    with pytest.raises(StoreError, match="incomplete"):
        TokenStore(tmp_path / "st")


def test_manifest_disagreeing_with_shard_is_an_error(tmp_path):
    _write_store(tmp_path / "st", [[[1, 2], [3]]])
    manifest = json.loads((tmp_path / "st" / MANIFEST).read_text())
    manifest["shards"][0]["n_tokens"] = 4
    (tmp_path / "st" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="manifest records"):
        TokenStore(tmp_path / "st")


@pytest.fixture
def shard(tmp_path):
    write_shard(tmp_path / "s", [[1, 2, 3], [4, 5], [6]], 100)
    return tmp_path / "s"


def test_truncated_bin_is_an_index_mismatch(shard):
    data = shard.with_suffix(".bin").read_bytes()
    shard.with_suffix(".bin").write_bytes(data[:-2])
    with pytest.raises(StoreError, match="index does not match the .bin"):
        Shard(shard)


def test_bin_of_another_store_is_an_index_mismatch(shard, tmp_path):
    write_shard(tmp_path / "other", [[1, 2, 3, 4, 5, 6, 7]], 100)
    shard.with_suffix(".bin").write_bytes(tmp_path.joinpath("other.bin").read_bytes())
    with pytest.raises(StoreError, match="does not match"):
        Shard(shard)


def test_damaged_index_is_reported(shard):
    idx = shard.with_suffix(".idx")
    good = idx.read_bytes()
    idx.write_bytes(b"NOTANIDX" + good[8:])
    with pytest.raises(StoreError, match="not an orthon token index"):
        Shard(shard)
    idx.write_bytes(good[:-8])
    with pytest.raises(StoreError, match="documents need"):
        Shard(shard)
    offsets = np.frombuffer(good[40:], dtype=np.int64).copy()
    offsets[1], offsets[2] = 5, 3  # not in order
    idx.write_bytes(good[:40] + offsets.tobytes())
    with pytest.raises(StoreError, match="offsets"):
        Shard(shard)
    idx.write_bytes(b"")
    with pytest.raises(StoreError, match="shorter than"):
        Shard(shard)


def test_missing_half_is_reported(shard):
    shard.with_suffix(".idx").unlink()
    with pytest.raises(StoreError, match="missing"):
        TokenStore(shard)
    with pytest.raises(StoreError, match="no token store"):
        TokenStore(shard.parent / "nothing_here")
