"""final/ from the ranks' shards (orthon.pretrain.gathered_weights) on two or four gloo ranks: the directory
equals the one process's save_weights tensor for tensor, each shard is written before the next is gathered
(rank 0 never holds more than one; an expert stack larger than a shard comes a few experts at a time, under
FSDP2, expert parallelism or both), and a write that fails on rank 0 leaves no rank waiting in a gather.
RL's streamed weight sync of the same parts leaves an engine holding the model's tensors."""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from orthon.core.errors import CheckpointError
from orthon.core.net import free_port
from orthon.pretrain.config import ModelConfig
from orthon.pretrain.hf_io import INDEX_NAME, load_hf_state
from orthon.pretrain.model import GLMForCausalLM
from orthon.pretrain.weights import save_weights
from tests.pretrain_support import MODEL
from spawn_support import spawn

WORLD = 2
SHARD_BYTES = 40_000  # the tiny model's ~0.4 MB in about ten shards


def build() -> GLMForCausalLM:
    torch.manual_seed(0)
    return GLMForCausalLM(ModelConfig(**MODEL))


def worker(rank, port, out_dir, experts, fail, mode="fsdp", world=WORLD):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A short timeout: a rank left waiting in a gather fails the test instead of hanging it.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        import orthon.pretrain.gathered_weights as gathered
        import orthon.pretrain.hf_io as hf_io
        from orthon.pretrain import expert_parallel, parallel

        model = build()
        mesh = expert_parallel.shard_experts(model, experts, torch.device("cpu")) if experts > 1 else None
        parallel.wrap(model, mode, mesh)
        events = []
        gather, save_file, rows = gathered._gather, hf_io.save_file, gathered._expert_rows
        gathered._gather = lambda *a: events.append("gather") or gather(*a)
        gathered._expert_rows = lambda *a: events.append("rows") or rows(*a)
        recv = dist.recv
        dist.recv = lambda *a, **k: events.append("recv") or recv(*a, **k)
        hf_io.save_file = lambda *a, **k: events.append("write") or save_file(*a, **k)
        target = os.path.join(out_dir, "final")
        if fail and rank == 0:  # a directory holding a file that is not ours: refused before any write
            os.makedirs(target)
            open(os.path.join(target, "notes.txt"), "w").close()
        try:
            returned = gathered.save_gathered(model, target, rank, max_shard_bytes=SHARD_BYTES)
            error = None
        except CheckpointError as exc:
            returned, error = None, str(exc)
        # Both ranks meet again: the collectives are still in step.
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        events, streamed = list(events), None if fail else stream_to_engine(model, rank)  # the save's events
        torch.save({"returned": None if returned is None else str(returned), "error": error, "events": events,
                    "total": total.item(), "streamed": streamed}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def stream_to_engine(model, rank):
    """RL's streamed weight sync on these ranks: the parts (expert stacks split where they can be) as the
    trainer sends them (the HF layout), each written into an engine on different weights. Rank 0 returns
    the names and bytes of each part and whether the engine then holds the model's tensors exactly."""
    from orthon.engine.in_process import InProcessEngine
    from orthon.pretrain.gathered_weights import gathered_parts
    from orthon.rl.weight_sync import _named

    torch.manual_seed(1)
    engine = InProcessEngine(GLMForCausalLM(ModelConfig(**MODEL)))
    parts = []
    for load in gathered_parts(model, rank, SHARD_BYTES, split_experts=True):
        named = None if (part := load()) is None else _named(part)
        if named is not None:
            engine.update_weights(named)
            parts.append([(name, t.numel() * t.element_size()) for name, t in named])
    if rank != 0:
        return None
    want = build().state_dict()
    return {"parts": parts, "equal": all(torch.equal(t, want[k]) for k, t in engine.model.state_dict().items())}


@pytest.mark.parametrize("experts,mode,world", [
    (1, "fsdp", 2), (2, "fsdp", 2), (2, "fsdp", 4),
    # Each expert's rows on two ranks (DDP's replicas): only the first copy sends them.
    pytest.param(2, "ddp", 4, marks=pytest.mark.slow)],
    ids=["fsdp", "fsdp-and-expert-parallel", "fsdp-over-expert-parallel-4-ranks", "ddp-4-ranks-expert-parallel"])
def test_the_gathered_directory_is_the_one_process_save(experts, mode, world, tmp_path):
    spawn(worker, args=(free_port(), str(tmp_path), experts, False, mode, world), nprocs=world)
    zero, one = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert zero["returned"] == str(tmp_path / "final") and one["returned"] is None
    expected = load_hf_state(save_weights(build(), tmp_path / "reference"))
    got = load_hf_state(tmp_path / "final")
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    for name in ("config.json", "orthon.json"):
        assert (tmp_path / "final" / name).read_text() == (tmp_path / "reference" / name).read_text()
    shards = sorted(p.name for p in (tmp_path / "final").glob("model-*.safetensors"))
    assert len(shards) >= 5 and (tmp_path / "final" / INDEX_NAME).is_file()
    # Rank 0 gathers a shard, writes it, then gathers the next: one shard in memory at a time.
    assert [e for e in zero["events"] if e in ("gather", "write")] == ["gather", "write"] * len(shards)
    assert [e for e in one["events"] if e in ("gather", "write")] == ["gather"] * len(shards)
    # An expert stack larger than a shard (gate_up_proj: 64 kB) comes two experts at a time (2 windows of its
    # 4), each row from the lowest rank holding it: with 2 ranks experts 0-1 are rank 0's own and 2-3 come
    # from rank 1; DDP's replicas send nothing twice; FSDP2 over expert parallelism's 2 x 2 mesh leaves one
    # expert a rank (0, 2, 1, 3 on ranks 0-3): three come from the others.
    assert zero["events"].count("rows") == one["events"].count("rows") == 2
    assert zero["events"].count("recv") == (3 if (world, mode, experts) == (4, "fsdp", 2) else 1)
    # RL's streamed sync of the same parts leaves an engine on other weights holding these exactly; every
    # tensor goes by its HF name, and no part of experts is over its size (a larger tensor of another kind,
    # the embedding, goes alone).
    streamed = zero["streamed"]
    assert streamed["equal"] and one["streamed"] is None
    names = [name for part in streamed["parts"] for name, _ in part]
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names and not any(n.endswith("_proj") for n in names)
    largest = max(sum(nbytes for _, nbytes in part) for part in streamed["parts"]
                  if any(".experts." in name for name, _ in part))
    assert largest <= SHARD_BYTES, largest


def test_a_write_that_fails_on_rank_zero_leaves_no_rank_waiting(tmp_path):
    spawn(worker, args=(free_port(), str(tmp_path), 2, True), nprocs=WORLD)
    zero, one = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    assert "holds files that are not model weights (notes.txt)" in zero["error"]
    assert zero["returned"] is None and one["error"] is None and one["returned"] is None
    # Rank 0 took part in every gather rank 1 made, and both met in the all-reduce after: 1 + 2.
    assert zero["events"].count("gather") == one["events"].count("gather") > 1 and "write" not in zero["events"]
    assert zero["total"] == one["total"] == 3.0
    assert sorted(os.listdir(tmp_path / "final")) == ["notes.txt"]
