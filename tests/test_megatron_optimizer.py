"""orthon's Muon on megatron's tensor-parallel shards: with TensorParallelOrthogonaliser, two gloo ranks
holding column-, row- and gated-column-parallel shards (and an expert's) end one step with exactly the
shards of the weights one process gets from the whole matrices; orthogonalising each shard on its own
(no gathering) does not."""
import os
import socket

import pytest
import torch
import torch.distributed as dist

from orthon.backends.megatron.optimizer import TensorParallelOrthogonaliser, param_specs
from orthon.backends.megatron.parallel import COLUMN, GATED, ROW, split
from orthon.optim.muon import Muon, orthogonalise_local
from orthon.pretrain.config import ModelConfig
from spawn_support import spawn

# name: (shape, how megatron splits it across TP, partition dim, expert weight, Muon Split blocks of the whole)
PARAMS = {
    "q_down": ((8, 6), COLUMN, 0, False, 1),
    "o_proj": ((6, 8), ROW, 1, False, 1),
    "fc1": ((8, 6), GATED, 0, False, 2),  # a dense [gate; up]: gate and up orthogonalised apart, as in orthon
    "expert_fc1": ((12, 6), GATED, 0, True, 1),
    "q_up": ((12, 5), COLUMN, 0, False, 4),  # 4 heads of 3 rows: whole heads on each rank
}


def _muon(params, splits, orthogonaliser=None):
    groups = [{"params": [p], "split_rows": s} for p, s in zip(params, splits)]
    return Muon(groups, lr=0.05, weight_decay=0.1, ns_dtype="fp32", orthogonaliser=orthogonaliser)


def _start():
    gen = torch.Generator().manual_seed(4)
    weights = {n: torch.randn(*shape, generator=gen) for n, (shape, *_) in PARAMS.items()}
    grads = {n: torch.randn(*shape, generator=gen) for n, (shape, *_) in PARAMS.items()}
    return weights, grads


def _step(weights, grads, rank=None, world=1, orthogonaliser=None):
    """One Muon step; with ``rank``, on that rank's shards (megatron's attributes set)."""
    params, splits = [], []
    for name, (_, rule, dim, expert, blocks) in PARAMS.items():
        w, g = weights[name], grads[name]
        if rank is not None:
            w, g = split(w, rule, world)[rank], split(g, rule, world)[rank]
        p = torch.nn.Parameter(w.clone())
        p.grad = g.clone()
        if rank is not None:
            p.tensor_model_parallel, p.partition_dim = True, dim
            if expert:
                p.allreduce = False
            if rule == GATED and blocks == 2:
                p.orthon_gate_up = True
        params.append(p)
        splits.append(blocks // world if rank is not None and rule == COLUMN and blocks > 1 else blocks)  # heads a rank
    _muon(params, splits, orthogonaliser).step()
    return {name: p.detach() for name, p in zip(PARAMS, params)}


def worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        weights, grads = _start()
        orth = TensorParallelOrthogonaliser(dist.group.WORLD, dist.group.WORLD)
        gathered = _step(weights, grads, rank, world, orth)
        alone = _step(weights, grads, rank, world, orthogonalise_local)
        torch.save({"gathered": gathered, "alone": alone, "count": orth.gathered}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    spawn(worker, args=(2, _free_port(), str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_tp_shards_step_as_the_whole_matrices(two_ranks):
    weights, grads = _start()
    whole = _step(weights, grads)
    for rank, result in enumerate(two_ranks):
        assert result["count"] == 4  # every sharded matrix but the per-head split one was gathered
        for name, (_, rule, *_) in PARAMS.items():
            expected = split(whole[name], rule, 2)[rank]
            assert not torch.equal(expected, split(weights[name], rule, 2)[rank]), name  # the step moved it
            torch.testing.assert_close(result["gathered"][name], expected, atol=1e-5, rtol=0, msg=name)
    # Orthogonalising each shard alone is right only for whole heads (Muon Split's blocks).
    alone = two_ranks[0]["alone"]
    torch.testing.assert_close(alone["q_up"], split(whole["q_up"], COLUMN, 2)[0], atol=1e-5, rtol=0)
    for name in ("q_down", "o_proj", "fc1"):
        assert (alone[name] - split(whole[name], PARAMS[name][1], 2)[0]).abs().max() > 1e-3, name


def test_param_specs_of_megatron_names():
    config = ModelConfig(num_attention_heads=8)
    named = [("embedding.word_embeddings.weight", torch.zeros(4, 2)), ("output_layer.weight", torch.zeros(4, 2)),
             ("decoder.layers.0.input_layernorm.weight", torch.zeros(2)),
             ("decoder.layers.0.self_attention.linear_q_up_proj.weight", torch.zeros(8, 2)),
             ("decoder.layers.0.self_attention.linear_kv_up_proj.weight", torch.zeros(8, 2)),
             ("decoder.layers.0.mlp.experts.linear_fc1.weight3", torch.zeros(4, 2))]
    named += [("decoder.layers.0.mlp.linear_fc1.weight", torch.zeros(4, 2)),
              ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", torch.zeros(4, 2))]
    specs = param_specs(named, config, tp=2)
    assert [(s.kind, s.split_rows) for s in specs.values()] == [
        ("embedding", 1), ("output_head", 1), ("norm", 1), ("matrix", 4), ("matrix", 4), ("matrix", 1), ("matrix", 2),
        ("matrix", 2)]
