"""Distributed Muon over 2 gloo processes equals a 1-process run with the same global batch (DDP and FSDP2)."""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from orthon.core.net import free_port
from orthon.optim import OptimConfig, ScheduleConfig, build_for_model
from orthon.optim.distributed import assign_owners, chunk_sizes
from orthon.optim.param_spec import ParamSpec
from spawn_support import spawn

STEPS = 5
SCHEDULE = ScheduleConfig(peak_lr=0.02, floor_lr=0.002, warmup_tokens=1, total_tokens=100)


class Net(nn.Module):
    """Matrices with a Muon Split, uneven row counts (5 rows over 2 ranks), an expert stack, AdamW parts."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.q_b = nn.Linear(16, 12, bias=False)
        self.odd = nn.Linear(12, 5, bias=False)
        self.experts = nn.Parameter(torch.randn(3, 8, 5) * 0.3)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)

    def param_specs(self):
        return {
            "experts": ParamSpec("expert_stack"),
            "inp.weight": ParamSpec("matrix"),
            "inp.bias": ParamSpec("bias"),
            "q_b.weight": ParamSpec("matrix", split_rows=4),
            "odd.weight": ParamSpec("matrix"),
            "norm.weight": ParamSpec("norm"),
            "norm.bias": ParamSpec("bias"),
            "out.weight": ParamSpec("output_head"),
            "out.bias": ParamSpec("bias"),
        }

    def forward(self, x):
        o = self.odd(self.q_b(torch.tanh(self.inp(x))))
        e = torch.einsum("bi,eji->bej", o, self.experts).mean(1)
        return self.out(self.norm(torch.tanh(e)))


def data():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(STEPS)]


def initial_state():
    torch.manual_seed(0)
    return Net().state_dict()


def train(model, opt, batches, rank=0, world=1):
    for step, (x, y) in enumerate(batches):
        opt.set_tokens(step + 1)
        opt.zero_grad()
        per_rank = x.shape[0] // world
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()


def optim_config(setting):
    """"fp32" / "bf16": standard Newton-Schulz in that dtype; "gram": Gram Newton-Schulz (bf16 input, the
    device's compute dtype) on the blocks where it pays (q_b's 3 x 16 heads; odd and the experts: standard)."""
    return OptimConfig(ns_method="gram", gram_dtype="fp32") if setting == "gram" else OptimConfig(ns_dtype=setting)


def reference(ns_dtype):
    model = Net()
    model.load_state_dict(initial_state())
    train(model, build_for_model(model, optim_config(ns_dtype), SCHEDULE), data())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for mode in ("ddp", "fsdp2"):
            for ns_dtype in ("fp32", "bf16", "gram"):
                model = Net()
                model.load_state_dict(initial_state())
                specs = model.param_specs()
                if mode == "ddp":
                    wrapped = nn.parallel.DistributedDataParallel(model)
                else:
                    from torch.distributed.device_mesh import init_device_mesh
                    from torch.distributed.fsdp import fully_shard

                    wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
                    # FSDP2 leaves sharded DTensors for the optimizer: the gather/scatter path runs.
                    assert all(p.placements[0].is_shard() for p in model.parameters())
                opt = build_for_model(model, optim_config(ns_dtype), SCHEDULE)
                assert type(opt.muon.orthogonaliser).__name__ == "DistributedOrthogonaliser"
                assert set(specs) == {n for n, _ in model.named_parameters()}
                train(wrapped, opt, data(), rank, world)
                state = {}
                for name, p in model.named_parameters():
                    full = p.full_tensor() if hasattr(p, "full_tensor") else p
                    state[name] = full.detach().clone()
                results[(mode, ns_dtype)] = (state, list(opt.muon.orthogonaliser.last_owners))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    spawn(worker, args=(2, free_port(), str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16", "gram"])
def test_two_ranks_equal_one_rank_after_5_steps(two_rank_results, mode, ns_dtype):
    expected = reference(ns_dtype)
    initial = initial_state()
    # fp32 Newton-Schulz: float round-off only (the all-reduce sums in another order).
    # bf16: that round-off can flip a bf16 rounding inside Newton-Schulz; one step moves a weight
    # by lr * 0.2 * sqrt(16) * |O| ~ 0.02, so 1e-3 still tells a wrong owner or shard apart.
    atol = 2e-5 if ns_dtype == "fp32" else 1e-3
    for rank in range(2):
        state, owners = two_rank_results[rank][(mode, ns_dtype)]
        assert set(owners) == {0, 1}  # both ranks did Newton-Schulz work
        for name, value in state.items():
            torch.testing.assert_close(value, expected[name], atol=atol, rtol=0, msg=f"{mode} {name} rank {rank}")
            assert not torch.equal(value, initial[name]), name
    for name in two_rank_results[0][(mode, ns_dtype)][0]:
        assert torch.equal(two_rank_results[0][(mode, ns_dtype)][0][name], two_rank_results[1][(mode, ns_dtype)][0][name])


def test_owner_assignment_balances_cost():
    assert assign_owners([5, 1, 4, 2, 3], 2) == [0, 0, 1, 0, 1]  # 5, 4, 3 -> 1, 2 -> 0, tie 1 -> 0: loads 8, 7
    assert assign_owners([1.0] * 4, 4) == [0, 1, 2, 3]
    assert chunk_sizes(5, 2) == [3, 2] and chunk_sizes(3, 4) == [1, 1, 1, 0] and chunk_sizes(8, 4) == [2] * 4
