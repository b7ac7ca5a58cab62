"""train.fsdp_param_dtype: bf16 on two gloo ranks: FSDP2 hands every module its weights in bf16 (fp32 as
stored without it), keeps fp32 shards with fp32 gradients for the optimizer, and the loss and gradients are
one process's under autocast on the same bf16-rounded weights, to bf16's round-off."""
import os

import pytest
import torch
import torch.distributed as dist

from hf_reference import small_model
from orthon.core.errors import ConfigError
from orthon.core.net import free_port
from orthon.pretrain.train_config import TrainConfig
from spawn_support import spawn

WORLD = 2


def rounded_model():
    """The small MoE model with every weight bf16-representable: the bf16 gather then changes no value."""
    torch.manual_seed(0)
    model = small_model("moe")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 257, (2 * WORLD, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def forward_backward(model, inputs, labels, dtypes: set):
    """The loss, backward done; ``dtypes`` gets (in an indexer?, weight dtype) of every Linear's forward."""
    def hook(indexer):
        return lambda module, _args: dtypes.add((indexer, module.weight.dtype))

    hooks = [m.register_forward_pre_hook(hook(".indexer." in name)) for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(inputs, labels=labels).loss
    loss.backward()
    for h in hooks:
        h.remove()
    return loss.detach()


def worker(rank, port, out_dir, bf16):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from orthon.pretrain import parallel

        model = rounded_model()
        parallel.wrap(model, "fsdp", param_dtype=torch.bfloat16 if bf16 else None)
        inputs, labels = (t[rank * 2:(rank + 1) * 2] for t in batch())
        dtypes = set()
        loss = forward_backward(model, inputs, labels, dtypes)
        dist.all_reduce(loss)
        stored = {(p.dtype, p.grad.dtype) for p in model.parameters() if p.grad is not None}
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        torch.save((loss / WORLD, dtypes, stored, grads), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[True, False], ids=["bf16-gather", "fp32-gather"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_mp")
    spawn(worker, args=(free_port(), str(out), request.param), nprocs=WORLD)
    return request.param, torch.load(out / "rank0.pt", weights_only=False)


def test_modules_see_the_gather_dtype_and_the_optimizer_fp32(ranks):
    bf16, (_, dtypes, stored, _) = ranks
    # The DSA indexers keep fp32 gathers (orthon.pretrain.parallel says why); autocast casts their matmuls.
    assert dtypes == {(False, torch.bfloat16 if bf16 else torch.float32), (True, torch.float32)}
    assert stored == {(torch.float32, torch.float32)}


def test_loss_and_gradients_are_one_process_under_autocast(ranks):
    """The bf16 gather's arithmetic is a bf16 model's (the embedding's rows come out in bf16, so the residual
    stream is bf16, as in Megatron's and torchtitan's bf16 training); the fp32 gather's, the fp32 model's."""
    bf16, (loss, _, _, grads) = ranks
    model = rounded_model().to(torch.bfloat16 if bf16 else torch.float32)
    inputs, labels = batch()
    reference = forward_backward(model, inputs, labels, set())
    # Each rank's loss is its half's mean: the mean of the two halves is the whole batch's when both halves
    # count the same tokens (no ignored labels here).
    torch.testing.assert_close(loss.float(), reference.float(), rtol=2e-3, atol=0)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        # Summed over two ranks in fp32 against one process's bf16 sums: bf16's round-off, 2^-8 relative.
        scale = float(p.grad.abs().max()) or 1.0
        assert float((grads[name] - p.grad.float()).abs().max()) <= 2e-2 * scale, name


def test_bf16_gather_needs_fsdp_and_a_bf16_forward():
    with pytest.raises(ConfigError, match="fsdp_param_dtype"):
        TrainConfig(parallel="fsdp", precision="fp32", fsdp_param_dtype="bf16")
    with pytest.raises(ConfigError, match="fsdp_param_dtype"):
        TrainConfig(parallel="ddp", precision="bf16", fsdp_param_dtype="bf16")
    assert TrainConfig(parallel="fsdp", precision="bf16", fsdp_param_dtype="bf16").fsdp_param_dtype == "bf16"


def test_a_two_rank_run_gathers_bf16_and_resumes_exactly(tmp_path):
    """The whole loop with the bf16 gather: micro-batches accumulated without syncing, held-out
    evaluations, checkpoints; resumed from step 2 it logs the same losses again. (The DSA indexer, off in
    this recipe, runs no forward: its unit keeps fp32 gathers, see orthon.pretrain.parallel.)"""
    from pretrain_support import losses, make_stores, orthon, write_recipe

    stores = make_stores(tmp_path / "data")
    train = {"max_steps": 4, "checkpoint_interval": 2, "eval_interval": 2, "precision": "bf16", "parallel": "fsdp",
             "fsdp_param_dtype": "bf16", "micro_batch_size": 2}
    run = tmp_path / "run"
    out = orthon("pretrain", "-c", write_recipe(tmp_path / "r.yaml", stores, run, train=train), nproc=2)
    assert "done: step 4" in out.stdout
    first = losses(run)
    orthon("pretrain", "--resume", run, "--step", "2", nproc=2)
    assert losses(run) == first and first[4] < first[1]
