"""Expert parallelism: the token exchange (moe.exchanged_experts) on two gloo ranks against grouped_experts
on the whole stacks in one process (outputs and every gradient), the expert gradients' reduction, and
the degree checks. The whole training path (losses, gradient norms, held-out losses and exported
weights equal to one process's) is in test_pretrain_parallel.py."""
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from orthon.core.errors import ConfigError
from orthon.core.net import free_port
from orthon.pretrain.expert_parallel import check_degree
from orthon.pretrain.moe import EXPERT_MESH_DIMS, exchanged_experts, grouped_experts
from spawn_support import spawn

E, H, I, N, K = 4, 8, 6, 10, 2  # experts, hidden, expert width, tokens a rank, experts a token
WORLD = 2
ROOT = Path(__file__).resolve().parents[1]


def stacks():
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)


def tokens(rank: int, routing: str):
    """A rank's tokens, their routing (indices, weights) and the probe its loss takes with the output."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, H, generator=g)
    if routing == "random":
        indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    else:  # every token to experts 0 and 1, both on rank 0: rank 1 receives no row at all
        indices = torch.tensor([[0, 1]] * N)
    weights = torch.rand(N, K, generator=g)
    return x, indices, weights, torch.randn(N, H, generator=g)


def one_process(routing: str):
    """Per rank: output and the gradients of x and the weights; and the stacks' gradients of the sum of
    both ranks' losses."""
    gate_up, down = (t.clone().requires_grad_() for t in stacks())
    per_rank = []
    for rank in range(WORLD):
        x, indices, weights, probe = tokens(rank, routing)
        x.requires_grad_(), weights.requires_grad_()
        out = grouped_experts(x, indices, weights, gate_up, down)
        (out * probe).sum().backward()
        per_rank.append((out.detach(), x.grad, weights.grad))
    return per_rank, gate_up.grad, down.grad


def worker(rank, port, out_dir, routing):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=EXPERT_MESH_DIMS)
        gate_up, down = (distribute_tensor(t, mesh, [Replicate(), Shard(0)], src_data_rank=None).requires_grad_()
                         for t in stacks())
        x, indices, weights, probe = tokens(rank, routing)
        x.requires_grad_(), weights.requires_grad_()
        out = exchanged_experts(x, indices, weights, gate_up, down)
        (out * probe).sum().backward()
        torch.save({"out": out.detach(), "x": x.grad, "weights": weights.grad, "gate_up": gate_up.grad.to_local(),
                    "down": down.grad.to_local(), "local": gate_up.to_local().shape[0]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("routing", ["random", "all to rank 0"])
def test_exchange_equals_the_whole_stacks_in_one_process(routing, tmp_path):
    spawn(worker, args=(free_port(), str(tmp_path), routing), nprocs=WORLD)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    per_rank, gate_up_grad, down_grad = one_process(routing)
    half = E // WORLD
    for rank, (out, x_grad, weights_grad) in enumerate(per_rank):
        mine = got[rank]
        assert mine["local"] == half  # each rank holds 2 of the 4 experts
        torch.testing.assert_close(mine["out"], out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine["x"], x_grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine["weights"], weights_grad, rtol=1e-5, atol=1e-5)
        # A rank's experts' gradients hold both ranks' tokens' contributions (the sum of both losses);
        # rank 1's are exactly zero when no token went to its experts.
        torch.testing.assert_close(mine["gate_up"], gate_up_grad[rank * half: (rank + 1) * half], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine["down"], down_grad[rank * half: (rank + 1) * half], rtol=1e-5, atol=1e-5)
    if routing != "random":
        assert not got[1]["gate_up"].any() and got[0]["gate_up"].abs().sum() > 0


def test_degree_must_divide_the_ranks_and_the_experts():
    check_degree(4, 8, 256)
    check_degree(1, 3, 7)
    with pytest.raises(ConfigError, match=r"expert_parallel = 3 does not divide the 8 ranks"):
        check_degree(3, 8, 256)
    with pytest.raises(ConfigError, match=r"expert_parallel = 4 does not divide model.n_routed_experts = 6"):
        check_degree(4, 8, 6)
    with pytest.raises(ConfigError, match="at least 1"):
        check_degree(0, 8, 8)


def test_the_memory_check_counts_one_ranks_experts(monkeypatch):
    """GLM-5 on 1,024 ranks (one a machine here) of 40 GB. FSDP2 holds 1/1024 of everything, with expert
    parallelism too (it shards the experts over the ranks holding the same ones): 743.91B x 16 bytes /
    1024 = 11.6 GB a rank. Expert parallelism over 256 ranks under DDP holds the other 19.14B whole and
    1/256 of the 724.78B routed-expert parameters: (19.14B + 2.83B) x 16 bytes = 351.5 GB."""
    import orthon.launch.args as args
    from orthon.pretrain.model_info import parameter_counts, rank_parameters
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.train_config import TrainConfig

    model = load_recipe(ROOT / "configs/glm5.yaml").model
    monkeypatch.setattr(args, "machine_memory", lambda: (40e9, "memory"))
    monkeypatch.setenv("WORLD_SIZE", "1024")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("ORTHON_NO_MEMORY_CHECK", raising=False)
    args.check_model_fits(model, TrainConfig(parallel="fsdp"), "train")
    args.check_model_fits(model, TrainConfig(parallel="fsdp", expert_parallel=256), "train")
    with pytest.raises(ConfigError, match=r"743\.91B parameters need about 351\.5 GB"):
        args.check_model_fits(model, TrainConfig(parallel="ddp", expert_parallel=256), "train")
    with pytest.raises(ConfigError, match=r"need about 11,902\.6 GB"):  # DDP alone: all of it on every rank
        args.check_model_fits(model, TrainConfig(parallel="ddp"), "train")
    # HSDP within groups of 64 ranks: 743.91B / 64 x 16 bytes = 186.0 GB; with expert parallelism the
    # experts stay spread over all 1,024 ranks: (19.14B / 64 + 724.78B / 1024) x 16 = 16.1 GB.
    with pytest.raises(ConfigError, match=r"need about 186\.0 GB"):
        args.check_model_fits(model, TrainConfig(parallel="fsdp", fsdp_shard_ranks=64), "train")
    args.check_model_fits(model, TrainConfig(parallel="fsdp", fsdp_shard_ranks=64, expert_parallel=256), "train")
    assert rank_parameters(parameter_counts(model), 1024, TrainConfig(parallel="fsdp", fsdp_shard_ranks=64,
                                                                      expert_parallel=256)) * 16 / 1e9 == pytest.approx(16.1, abs=0.05)
    # megatron-core (backend: megatron): TP splits the rest, EP x the experts' TP (TP unless set) the experts:
    # TP 8, EP 64: (19.14B / 8 + 724.78B / 512) x 16 = 60.9 GB; TP 16, EP 128: (19.14B / 16 + 724.78B / 2048) x 16 = 24.8 GB
    from orthon.pretrain.recipe import MegatronOptions

    with pytest.raises(ConfigError, match=r"need about 60\.9 GB"):
        args.check_model_fits(model, TrainConfig(), "train", megatron=MegatronOptions(tensor_parallel=8, expert_parallel=64))
    args.check_model_fits(model, TrainConfig(), "train", megatron=MegatronOptions(tensor_parallel=16, expert_parallel=128))
    assert rank_parameters(parameter_counts(model), 1024, megatron=MegatronOptions(
        tensor_parallel=16, expert_parallel=128)) * 16 / 1e9 == pytest.approx(24.8, abs=0.05)


def test_model_info_prints_one_ranks_share(capsys):
    """The figures of the memory check above, as `orthon model-info --ranks` prints them to plan a job."""
    from orthon.launch.cli import main

    glm5 = str(ROOT / "configs/glm5.yaml")
    assert main(["model-info", "-c", glm5, "--ranks", "1024", "train.expert_parallel=256"]) == 0
    assert ("one rank of 1024 (train.parallel=fsdp, train.expert_parallel=256): 0.73B parameters, 11.6 GB of "
            "training state") in capsys.readouterr().out
    assert main(["model-info", "-c", glm5, "--ranks", "1024", "train.parallel=ddp", "train.expert_parallel=256"]) == 0
    assert "(train.parallel=ddp, train.expert_parallel=256): 21.97B parameters, 351.5 GB" in capsys.readouterr().out
    assert main(["model-info", "-c", glm5, "--ranks", "1000", "train.expert_parallel=256"]) == 2
    assert "train.expert_parallel = 256 does not divide the 1000 ranks of this run" in capsys.readouterr().err


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_grads_is_torchs_clipping(max_norm):
    """parallel.clip_grads (the expert-parallel runs' clipping, which sums DTensors over their meshes) on
    plain tensors: torch's clip_grad_norm_ to round-off, scaled (0.5) or left alone (100)."""
    from orthon.pretrain.parallel import clip_grads

    g = torch.Generator().manual_seed(3)
    ours = [torch.nn.Parameter(torch.randn(5, 7, generator=g)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    norm = clip_grads(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm == pytest.approx(float(expected), rel=1e-6) and norm > 1  # the gradients' own norm
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert (float(torch.cat([p.grad.flatten() for p in ours]).norm()) < norm) == (max_norm < norm)


def test_glm5_mid_training_is_checked_under_the_stages_parallelism(tmp_path, monkeypatch, capsys):
    """The mid-training plan's stages run under the source run's parallelism (GLM-5's: FSDP2), so its
    memory check weighs one rank's share, not the whole model on every rank; a plan that asks for DDP is
    refused before anything is allocated."""
    import orthon.launch.args as args
    import orthon.midtrain.stages as stages
    from orthon.launch.cli import main
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.trainer import write_run_config

    write_run_config(tmp_path / "glm5", load_recipe(ROOT / "configs/glm5.yaml"))
    monkeypatch.setattr(args, "machine_memory", lambda: (40e9, "memory"))
    monkeypatch.setenv("WORLD_SIZE", "1024")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("ORTHON_NO_MEMORY_CHECK", raising=False)

    class Checked(Exception):
        pass

    def reached(plan, log=print):
        raise Checked

    monkeypatch.setattr(stages, "run_plan", reached)
    command = ["midtrain", "-c", str(ROOT / "configs/midtrain_glm5.yaml"), "--from", str(tmp_path / "glm5"),
               f"run_dir={tmp_path / 'mid'}"]
    with pytest.raises(Checked):
        main(command)  # 743.91B x 16 bytes / 1024 = 11.6 GB a rank
    assert main(command + ["train.parallel=ddp"]) == 2
    assert "743.91B parameters need about 11,902.6 GB to mid-train" in capsys.readouterr().err


def test_hsdp_groups_divide_the_ranks_and_need_fsdp():
    """model-info --ranks and the memory check weigh a layout the Trainer would run, or refuse it."""
    from orthon.pretrain.model_info import parameter_counts, rank_parameters
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.train_config import TrainConfig

    counts = parameter_counts(load_recipe(ROOT / "configs/tiny.yaml").model)
    with pytest.raises(ConfigError, match=r"train.fsdp_shard_ranks = 3 does not divide the 8 ranks"):
        rank_parameters(counts, 8, TrainConfig(parallel="fsdp", fsdp_shard_ranks=3))
    total = sum(c["total"] for c in counts.values())
    assert rank_parameters(counts, 8, TrainConfig(parallel="fsdp", fsdp_shard_ranks=4)) == total / 4
    with pytest.raises(ConfigError, match=r"fsdp_shard_ranks: HSDP groups are an FSDP2 setting \(parallel: fsdp\); "
                                          r"got parallel: ddp with fsdp_shard_ranks: 2"):
        TrainConfig(fsdp_shard_ranks=2)
