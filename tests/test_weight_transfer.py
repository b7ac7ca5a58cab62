"""The whole-weights paths: bucket plans and flattened buckets (hand-checked offsets, views), the
broadcast over gloo between real processes (1 sender, 2 receivers; metadata mismatch and a silent sender
end in errors, not hangs), shared-memory buckets (views into the writer's file, cleaned up after crashes),
versioned disk directories (pruning, a crash mid-write leaves no visible version) and tensor hashes."""
import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from hf_reference import small_config
from orthon.core.errors import CheckpointError, ConfigError
from orthon.engine import InProcessEngine
from orthon.engine.delta import DeltaEncoder, DeltaPayload
from orthon.engine.weight_transfer import (SharedBuckets, TensorMeta, broadcast_bytes, broadcast_tensors, bucket_layout,
                                           bucket_plan, flatten_bucket, latest_version, list_versions,
                                           open_update_group, read_shared, receive_tensors, tensor_hashes,
                                           unflatten_bucket, write_delta, write_versioned)
from orthon.pretrain import GLMForCausalLM
from pretrain_support import env, free_port
from spawn_support import spawn

pytestmark = pytest.mark.usefixtures("one_thread")
TESTS = Path(__file__).resolve().parent


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def sample_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [("emb", torch.randn(300, 7, generator=g).bfloat16()),
            ("w", torch.randn(1000, generator=g)),
            ("steps", torch.arange(5) * (seed + 1)),
            ("mask", torch.rand(33, generator=g) > 0.5),
            ("empty", torch.zeros(0, 4)),
            ("half", torch.randn(2, 3, generator=g).half())]


# ---------------------------------------------------------------- buckets
A, B, C, D = (TensorMeta("a", "float32", (10,)), TensorMeta("b", "bfloat16", (100,)),
              TensorMeta("c", "uint8", (1000,)), TensorMeta("d", "float32", (4,)))


def test_bucket_plan_and_layout_by_hand():
    # sizes 40, 200, 1000, 16 bytes take 64, 256, 1024, 64 aligned to 64
    assert bucket_layout([A, B, C, D]) == ([0, 64, 320, 1344], 1408)
    assert bucket_plan([A, B, C, D], 300) == [[A], [B], [C], [D]]  # c is larger than a bucket: alone
    assert bucket_plan([A, B, C, D], 400) == [[A, B], [C], [D]]
    assert bucket_plan([A, B, C, D], 1 << 20) == [[A, B, C, D]]
    assert bucket_plan([], 10) == []
    with pytest.raises(ConfigError, match="bucket_bytes"):
        bucket_plan([A], 0)


def test_tensor_meta_json_and_bad_metadata():
    assert TensorMeta.from_json(json.loads(json.dumps(B.to_json()))) == B
    assert (B.nbytes, TensorMeta("x", "int64", ()).nbytes) == (200, 8)
    with pytest.raises(CheckpointError, match="not a torch dtype"):
        TensorMeta("x", "float33", (2,))
    with pytest.raises(CheckpointError, match="expected name, dtype and shape"):
        TensorMeta.from_json({"name": "x", "dtype": "float32"})


def test_flatten_then_unflatten_gives_views_with_the_same_bytes():
    named = sample_tensors()
    flat = flatten_bucket(named)
    metas = [TensorMeta.of(n, t) for n, t in named]
    offsets, total = bucket_layout(metas)
    assert flat.dtype == torch.uint8 and flat.numel() == total
    views = unflatten_bucket(flat, metas)
    for (name, original), (view_name, view), offset in zip(named, views, offsets):
        assert view_name == name and same_bytes(view, original)
        assert view.data_ptr() == (flat.data_ptr() + offset if view.numel() else 0)  # a view at its offset
    assert same_bytes(flatten_bucket([t for _, t in named]), flat)  # bare tensors flatten the same (padding 0)
    views[1][1][0] = 42.0
    assert flat[offsets[1]: offsets[1] + 4].view(torch.float32).item() == 42.0
    with pytest.raises(CheckpointError, match=f">= {total} bytes"):
        unflatten_bucket(flat[:-1], metas)


# ---------------------------------------------------------------- broadcast over gloo, in real processes
def _broadcast_worker(rank, world, ports, out):
    port_a, port_b, port_c = ports
    torch.set_num_threads(1)
    results = {}
    group = open_update_group("127.0.0.1", port_a, rank, world, timeout_s=20)
    sets = [(sample_tensors(1), 4096), (sample_tensors(2), 64 << 20)]
    for round_, (named, bucket_bytes) in enumerate(sets):
        if rank == 0:
            broadcast_tensors(group, named, bucket_bytes=bucket_bytes)
        else:
            metas = [TensorMeta.of(n, t).to_json() for n, t in named]  # as an HTTP request carries them
            received = receive_tensors(group, metas, bucket_bytes=bucket_bytes)
            results[round_] = [(n, t.clone()) for n, t in received]
    # Delta on top of the broadcast: the payload's bytes, applied in place to what round 0 delivered.
    if rank == 0:
        encoder = DeltaEncoder()
        encoder.reset(sample_tensors(1), 0)
        broadcast_bytes(group, encoder.encode(delta_target(), 1).to_bytes())
    else:
        held = {n: t.clone() for n, t in results[0]}
        DeltaPayload.from_bytes(broadcast_bytes(group, None)).apply_in_place(held)
        results["delta"] = held
    group.close()
    # A sender that never sends: the receivers' waits end at the timeout.
    group = open_update_group("127.0.0.1", port_b, rank, world, timeout_s=2)
    if rank == 0:
        group.store.wait(["gave_up_1", "gave_up_2"], timedelta(seconds=30))
    else:
        try:
            receive_tensors(group, [TensorMeta.of(n, t) for n, t in sample_tensors()])
        except (RuntimeError, TimeoutError) as exc:
            results["silent"] = type(exc).__name__
        group.store.set(f"gave_up_{rank}", "1")
    # Receivers told about other tensors than the sender sends stop with an error naming it.
    group = open_update_group("127.0.0.1", port_c, rank, world, timeout_s=3)
    if rank == 0:
        try:
            broadcast_tensors(group, sample_tensors())
        except (RuntimeError, TimeoutError):
            pass  # nobody receives the buckets: the sender's wait ends at the timeout or at once
    else:
        wrong = [TensorMeta.of(n, t) for n, t in sample_tensors()]
        wrong[0] = TensorMeta("emb", "bfloat16", (300, 8))
        try:
            receive_tensors(group, wrong)
        except CheckpointError as exc:
            results["mismatch"] = str(exc)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def delta_target():
    named = dict(sample_tensors(1))
    named["w"] = named["w"] + torch.linspace(0, 1e-3, 1000)
    named["emb"][5:9] = 0.5
    return named


def test_broadcast_over_gloo_to_two_receivers(tmp_path):
    ports = set()
    while len(ports) < 3:
        ports.add(free_port())
    spawn(_broadcast_worker, args=(3, tuple(ports), str(tmp_path)), nprocs=3)
    for rank in (1, 2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for round_, seed in ((0, 1), (1, 2)):
            expected = sample_tensors(seed)
            assert [n for n, _ in results[round_]] == [n for n, _ in expected]
            assert all(same_bytes(t, e) for (_, t), (_, e) in zip(results[round_], expected))
        assert all(same_bytes(results["delta"][n], t) for n, t in delta_target().items())
        assert results["silent"] in ("RuntimeError", "TimeoutError")
        assert "differ from the 6 tensors this receiver was told about" in results["mismatch"]


def test_a_group_that_does_not_form_times_out():
    with pytest.raises(TimeoutError, match="not formed within 1"):
        open_update_group("127.0.0.1", free_port(), 0, 2, timeout_s=1)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA"):
            open_update_group("127.0.0.1", free_port(), 0, 2, backend="nccl")
    with pytest.raises(ConfigError, match="rank 2 is not in a group of 2"):
        open_update_group("127.0.0.1", free_port(), 2, 2)


# ---------------------------------------------------------------- colocated: shared memory
def test_shared_buckets_hand_over_views_of_the_writers_memory(tmp_path):
    named = sample_tensors()
    with SharedBuckets(tmp_path) as shared:
        handle = json.loads(json.dumps(shared.write(named, version=3)))  # JSON-able, as sent over HTTP
        assert handle["version"] == 3 and Path(handle["path"]).parent == tmp_path
        views = read_shared(handle)
        storage = views[0][1].untyped_storage()
        assert storage.filename == handle["path"] and storage.nbytes() == handle["nbytes"]
        base = storage.data_ptr()
        for (name, view), (_, original) in zip(views, named):
            if view.numel():  # (an empty tensor points nowhere)
                assert base <= view.data_ptr() < base + handle["nbytes"]
                assert view.untyped_storage().data_ptr() == base  # one mapping, no copies
            assert same_bytes(view, original), name
        engine = InProcessEngine(_model(0))  # the colocated path end to end: the engine copies from the views
        model_handle = shared.write(_model(1).state_dict(), version=5)
        assert engine.update_weights(read_shared(model_handle), version=model_handle["version"]) == 5
        assert all(same_bytes(a, b) for a, b in zip(engine.model.state_dict().values(), _model(1).state_dict().values()))
        handle = shared.write(named, version=3)
        views = read_shared(handle)
        newer = sample_tensors(seed=9)
        shared.write(newer, version=4)  # same layout, same file: the engine's views see the new bytes
        assert all(same_bytes(view, t) for (_, view), (_, t) in zip(views, newer))
        path = Path(handle["path"])
    assert not path.exists()  # the writer unlinked its file
    with pytest.raises(CheckpointError, match="no such file|No such file"):
        read_shared(handle)
    with pytest.raises(CheckpointError, match="declares"):
        read_shared({**handle, "nbytes": handle["nbytes"] + 64})


def test_shared_buckets_default_to_dev_shm_and_grow():
    shared = SharedBuckets()
    try:
        if Path("/dev/shm").is_dir():
            assert shared.path.parent == Path("/dev/shm")
        small = shared.write([("x", torch.ones(3))], 1)
        large = shared.write([("x", torch.ones(3)), ("y", torch.arange(100000.0))], 2)
        assert large["nbytes"] > small["nbytes"]
        assert same_bytes(dict(read_shared(large))["y"], torch.arange(100000.0))
    finally:
        shared.close()
    assert not shared.path.exists()


WRITE_AND_DIE = """
import os, signal, sys, torch
from orthon.engine.weight_transfer import SharedBuckets
shared = SharedBuckets(sys.argv[1])
shared.write([("x", torch.ones(1000))], 1)
print(shared.path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

READ_AND_DIE = """
import json, os, signal, sys
from orthon.engine.weight_transfer import read_shared
views = read_shared(json.loads(sys.argv[1]))
assert float(views[0][1].sum()) == 1000.0
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_crashed_writers_and_readers_leave_no_files(tmp_path):
    proc = subprocess.run([sys.executable, "-c", WRITE_AND_DIE, str(tmp_path)], capture_output=True, text=True,
                          env=env())
    assert proc.returncode == -signal.SIGKILL
    orphan = Path(proc.stdout.strip())
    assert orphan.exists()  # a killed writer could not unlink ...
    shared = SharedBuckets(tmp_path)  # ... the next writer in the directory does
    assert shared.removed_stale == [orphan] and not orphan.exists()
    handle = shared.write([("x", torch.ones(1000))], 1)
    proc = subprocess.run([sys.executable, "-c", READ_AND_DIE, json.dumps(handle)], capture_output=True, text=True,
                          env=env())
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert sorted(tmp_path.iterdir()) == [shared.path]  # the reader created nothing
    shared.close()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- disk
def _model(seed):
    torch.manual_seed(seed)
    return GLMForCausalLM(small_config("moe"))


def test_versioned_directories_load_into_the_engine_and_old_ones_are_pruned(tmp_path):
    root = tmp_path / "weights"
    engine = InProcessEngine(_model(0))
    for version in (1, 2, 3, 4):
        path = write_versioned(_model(version), root, version, keep=2)
        assert path == root / f"v{version:08d}"
    assert list_versions(root) == [3, 4] and latest_version(root) == (4, root / "v00000004")
    assert sorted(p.name for p in root.iterdir()) == ["v00000003", "v00000004"]
    assert engine.update_weights(root / "v00000004", version=4) == 4
    assert all(same_bytes(a, b) for a, b in zip(engine.model.state_dict().values(), _model(4).state_dict().values()))
    state = _model(5).state_dict()  # a bare state dict: model.safetensors alone
    path = write_versioned(state, root, 5, keep=3)
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors"]
    assert engine.update_weights(path, version=5) == 5
    assert all(same_bytes(engine.model.state_dict()[k], v) for k, v in state.items())
    write_versioned(_model(6), root, 5, keep=3)  # a rewritten version replaces the old one whole
    assert list_versions(root) == [3, 4, 5] and (path / "config.json").is_file()
    with pytest.raises(ConfigError, match="keep"):
        write_versioned(state, root, 7, keep=0)
    with pytest.raises(ConfigError, match="version"):
        write_versioned(state, root, -1)
    with pytest.raises(TypeError, match="GLMForCausalLM"):
        write_versioned([1, 2], root, 7)


def test_a_delta_payload_on_disk_beside_the_versions(tmp_path):
    model = _model(1)
    engine = InProcessEngine(_model(1))
    encoder = DeltaEncoder()
    encoder.reset(model.state_dict(), 0)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    path = write_delta(tmp_path, encoder.encode(model.state_dict(), 1))
    assert path.name == "delta-v00000000-v00000001.bin"
    assert engine.update_weights(DeltaPayload.from_bytes(path.read_bytes())) == 1
    assert all(same_bytes(a, b) for a, b in zip(engine.model.state_dict().values(), model.state_dict().values()))


DIE_MID_WRITE = """
import os, sys
sys.path.insert(0, sys.argv[2])
import torch
import orthon.pretrain.weights as weights
from hf_reference import small_config
from orthon.pretrain import GLMForCausalLM
from orthon.engine.weight_transfer import write_versioned

def die(path, obj):  # the shards are written; the process dies before the sidecar
    os._exit(7)

weights.atomic_write_json = die
write_versioned(GLMForCausalLM(small_config("moe")), sys.argv[1], 9)
"""


def test_a_crash_mid_write_leaves_no_visible_version(tmp_path):
    root = tmp_path / "weights"
    write_versioned(_model(1), root, 1)
    proc = subprocess.run([sys.executable, "-c", DIE_MID_WRITE, str(root), str(TESTS)], capture_output=True,
                          text=True, env=env())
    assert proc.returncode == 7, proc.stderr
    leftovers = sorted(p.name for p in root.iterdir())
    assert "v00000009" not in leftovers and any(name.startswith(".v00000009") for name in leftovers)
    assert list_versions(root) == [1] and latest_version(root)[0] == 1
    write_versioned(_model(2), root, 2)  # the next write clears the dead writer's staging directory
    assert sorted(p.name for p in root.iterdir()) == ["v00000001", "v00000002"]


# ---------------------------------------------------------------- hashes
def test_tensor_hashes_tell_bytes_apart():
    named = sample_tensors()
    hashes = tensor_hashes(named)
    assert hashes == tensor_hashes([(n, t.clone()) for n, t in named]) and len(set(hashes.values())) == len(named)
    flipped = named[1][1].clone()
    flipped.view(torch.int32)[500] ^= 1  # one bit
    assert tensor_hashes([("w", flipped)])["w"] != hashes["w"]
    emb = named[0][1]
    assert tensor_hashes([("emb", emb.view(torch.int16))])["emb"] != hashes["emb"]  # same bytes, other dtype
    assert tensor_hashes([("emb", emb.reshape(7, 300))])["emb"] != hashes["emb"]  # same bytes, other shape
    assert tensor_hashes({"t": emb.t()}) == tensor_hashes({"t": emb.t().contiguous()})  # strides do not count
