"""The CUDA paths: the same model, optimizer and engine on a GPU as on the CPU.

Everything else in the suite runs on the CPU; these tests skip without a CUDA device.
"""
import copy

import pytest
import torch

from hf_reference import randomize_router_bias, small_model
from orthon.optim.newton_schulz import newton_schulz
from orthon.pretrain.moe import grouped_experts
from orthon.engine.in_process import InProcessEngine
from orthon.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _full_fp32_matmuls():
    # TF32 would make the fp32 comparisons below loose by 1e-3.
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _pair(case, **overrides):
    cpu = small_model(case, **overrides)
    randomize_router_bias(cpu)
    return cpu, copy.deepcopy(cpu).cuda()


@pytest.mark.parametrize("case,impl", [("moe", "mask"), ("moe_groups", "mask"), ("dsa", "mask"), ("dsa", "gather"),
                                       ("indexshare", "gather")])
def test_fp32_forward_and_gradients_match_the_cpu(case, impl):
    cpu, gpu = _pair(case, sparse_impl=impl)
    ids = torch.randint(0, cpu.config.vocab_size, (2, 40))
    labels = ids.roll(-1, dims=1)
    out_c = cpu(ids, labels=labels, return_logits=True)
    out_g = gpu(ids.cuda(), labels=labels.cuda(), return_logits=True)
    out_c.loss.backward()
    out_g.loss.backward()
    assert (out_g.logits.cpu() - out_c.logits).abs().max() < 1e-4
    assert abs(out_g.loss.item() - out_c.loss.item()) < 1e-5
    for (name, p_c), p_g in zip(cpu.named_parameters(), gpu.parameters()):
        if p_c.grad is None:
            assert p_g.grad is None, name
            continue
        scale = max(1.0, float(p_c.grad.abs().max()))
        assert (p_g.grad.cpu() - p_c.grad).abs().max() < 1e-4 * scale, name


def test_bf16_grouped_gemm_equals_the_per_expert_loop():
    torch.manual_seed(0)
    N, H, I, E, k = 96, 64, 32, 8, 2
    x = torch.randn(N, H).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I) / I**0.5).bfloat16()
    indices = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    indices[:5] = 0  # expert 0 crowded, some experts likely empty: jagged groups
    weights = torch.rand(N, k)
    grouped = grouped_experts(x.cuda(), indices.cuda(), weights.cuda(), gate_up.cuda(), down.cuda())
    loop = grouped_experts(x.float(), indices, weights, gate_up.float(), down.float())
    assert grouped.dtype == torch.bfloat16
    rel = (grouped.float().cpu() - loop).norm() / loop.norm()
    assert rel < 1e-2, float(rel)


def test_bf16_autocast_training_step_runs_the_grouped_gemm_and_learns():
    _, gpu = _pair("moe")
    opt = torch.optim.AdamW(gpu.parameters(), lr=3e-3)
    ids = torch.randint(0, gpu.config.vocab_size, (4, 32), device="cuda")
    losses = []
    for _ in range(30):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = gpu(ids, labels=ids.roll(-1, dims=1)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses  # one fixed batch: memorised


def test_native_bf16_newton_schulz_matches_the_cpu_emulation():
    torch.manual_seed(0)
    g = torch.randn(3, 96, 160)
    native = newton_schulz(g.cuda()).float().cpu()
    emulated = newton_schulz(g, emulate_bf16=True).float()
    exact = newton_schulz(g, dtype=torch.float32)
    # Both bf16 forms are as far from the fp32 result as bf16 rounding makes them, and close to each other.
    for got in (native, emulated):
        assert (got - exact).norm() / exact.norm() < 3e-2
    assert (native - emulated).norm() / exact.norm() < 3e-2
    s = torch.linalg.svdvals(native)
    assert s.min() > 0.5 and s.max() < 1.3


def test_engine_greedy_on_cuda_equals_cpu_and_log_probs_agree():
    cpu, gpu = _pair("dsa", index_topk=8)
    prompts = [[3, 5, 7, 11], [13, 2], list(range(20, 34))]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=())
    on_cpu = InProcessEngine(cpu).generate(prompts, params)
    on_gpu = InProcessEngine(gpu).generate(prompts, params)
    for a, b in zip(on_cpu, on_gpu):
        assert a.tokens == b.tokens
        assert (a.log_probs - b.log_probs).abs().max() < 1e-4


def test_a_local_rank_past_the_gpus_is_named(monkeypatch):
    from orthon.core.distributed import init_distributed
    from orthon.core.errors import OrthonError

    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(OrthonError, match=f"local rank {torch.cuda.device_count()} has no GPU"):
        init_distributed()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_pretraining_run_on_cuda_resumes_bit_identical(tmp_path, precision):
    """The CLI's run on the GPU (its grouped-GEMM experts under bf16), deterministic kernels on: stopped at
    step 4 and resumed to 8, it logs the losses of the run that went straight to 8, bit for bit."""
    from pretrain_support import losses, make_stores, orthon, write_recipe

    stores = make_stores(tmp_path / "data")
    train = {"checkpoint_interval": 4, "eval_interval": 4, "deterministic": True, "precision": precision}
    straight = orthon("pretrain", "-c", write_recipe(tmp_path / "a.yaml", stores, tmp_path / "a",
                                                    train={**train, "max_steps": 8}))
    assert "device: cuda:0 (" in straight.stdout and "deterministic kernels" in straight.stdout, straight.stdout
    orthon("pretrain", "-c", write_recipe(tmp_path / "b.yaml", stores, tmp_path / "b", train={**train, "max_steps": 4}))
    orthon("pretrain", "--resume", tmp_path / "b", "train.max_steps=8")
    want, got = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(want) == list(range(1, 9)) and got == want
    assert want[8] < want[1]
    # The GPU's step metrics: the allocator's peak, and MFU where the device's peak is known.
    from orthon.core.device_stats import bf16_peak_flops
    from orthon.core.metrics import read_metrics

    step = next(r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r.get("step") == 8 and "loss" in r)
    assert 0 < step["memory_peak_pct"] < 100 and step["cuda_alloc_retries"] == 0
    peak = bf16_peak_flops(torch.cuda.get_device_name())
    assert ("mfu_pct" in step) == (peak is not None)
    if peak:
        assert step["mfu_pct"] == pytest.approx(100 * step["tflops_per_device"] * 1e12 / peak, rel=1e-9)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rl_on_cuda_trains(tmp_path, mode):
    """`orthon rl` on the GPU: the engine generates there (in a thread beside training when async), the
    policy trains there, and the weights it saves moved from the start."""
    from test_rl_loop import _pretrain_dir
    from test_rl_parallel import ITERATIONS, _run, _weights

    pre = _pretrain_dir(tmp_path)
    out, records, weights = _run(tmp_path, pre, "gpu", nproc=1, mode=mode)
    assert "device: cuda:0 (" in out.stdout, out.stdout
    assert len(records) == ITERATIONS and all(r["trained_samples"] > 0 for r in records)
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in records)
    start = _weights(pre / "final")
    assert max((weights[k].float() - start[k].float()).abs().max().item() for k in start) > 1e-4


def test_megatron_backend_on_cuda_trains_as_the_torch_backend(tmp_path):
    """`orthon pretrain ... backend=megatron` on the GPU (megatron-core's CUDA paths: its alltoall token
    dispatcher, transformer-engine's layers where installed): the same recipe's losses as the torch backend's
    there (fp32), and a resume that continues the straight run."""
    pytest.importorskip("megatron.core")
    from pretrain_support import losses, make_stores, orthon, write_recipe

    stores = make_stores(tmp_path / "data")
    train = {"checkpoint_interval": 4, "deterministic": True}
    got = {}
    for backend in ("torch", "megatron"):
        run = tmp_path / backend
        out = orthon("pretrain", "-c", write_recipe(tmp_path / f"{backend}.yaml", stores, run, train={**train, "max_steps": 8}),
                     f"backend={backend}", "optim.ns_dtype=fp32")
        assert "device: cuda:0 (" in out.stdout, out.stdout
        got[backend] = losses(run)
    assert sorted(got["megatron"]) == list(range(1, 9))
    assert all(got["megatron"][s] == pytest.approx(got["torch"][s], abs=1e-4) for s in got["torch"]), got
    orthon("pretrain", "-c", write_recipe(tmp_path / "b.yaml", stores, tmp_path / "b", train={**train, "max_steps": 4}),
           "backend=megatron", "optim.ns_dtype=fp32")
    orthon("pretrain", "--resume", tmp_path / "b", "train.max_steps=8")
    resumed = losses(tmp_path / "b")  # megatron's MoE permutation scatters (no deterministic CUDA kernel): close
    assert sorted(resumed) == list(range(1, 9)) and all(resumed[s] == pytest.approx(got["megatron"][s], abs=1e-5) for s in resumed)


def test_newton_schulz_takes_many_large_blocks_a_call_on_cuda():
    """On the CPU a piece is ~1M elements (cache); on a GPU launches cost more than cache misses, so the
    24 blocks of 512 x 2048 (the bench's set at a quarter size) go in one call, and each block's update is
    its own Newton-Schulz (the same as stepping it alone)."""
    from torch import nn

    from orthon.optim.muon import Muon, orthogonalise_local

    calls = []

    def counting(work, ns):
        return orthogonalise_local(work, lambda stack, item: calls.append(tuple(stack.shape)) or ns(stack, item))

    start = [torch.randn(512, 2048, device="cuda") for _ in range(24)]
    grads = [torch.randn_like(w) for w in start]

    def stepped(indices, orthogonaliser=None):
        params = [nn.Parameter(start[i].clone()) for i in indices]
        for p, i in zip(params, indices):
            p.grad = grads[i].clone()
        kwargs = {"orthogonaliser": orthogonaliser} if orthogonaliser else {}
        Muon(params, lr=0.01, ns_dtype="fp32", **kwargs).step()
        return [p.detach() for p in params]

    together = stepped(range(24), counting)
    assert calls == [(24, 512, 2048)]
    for i in range(0, 24, 7):
        torch.testing.assert_close(together[i], stepped([i])[0], atol=1e-5, rtol=0)
