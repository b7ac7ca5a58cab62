"""The megatron-core model orthon builds, against orthon's torch model on the same weights.

megatron-core keeps its MoE router state (and RoPE frequencies) on ``torch.cuda.current_device()``;
without a GPU here that call is pointed at the CPU, and everything else is megatron-core's own code
(its MLA and MoE layer specs, local layers, the allgather token dispatcher, the conversion's weights),
so the logits, the loss and one step of orthon's Muon + Split must agree with the torch backend's. On a
GPU, bench/gpu_check.sh runs the same comparison with megatron's CUDA paths."""
from __future__ import annotations

import sys

import pytest
import torch

from orthon.backends.megatron import MegatronLayout, megatron_to_orthon, orthon_to_megatron
from orthon.backends.megatron.model import MegatronOptions, build_model, load_megatron_state, transformer_config
from orthon.core.errors import ConfigError, OrthonError
from orthon.pretrain import GLMForCausalLM
from orthon.pretrain.recipe import load_recipe
from megatron_support import megatron_on_cpu
from pretrain_support import ROOT

pytest.importorskip("megatron.core")

OPTIONS = MegatronOptions(params_dtype="fp32", token_dispatcher="allgather", transformer_engine="off")


@pytest.fixture(scope="module")
def tiny():
    recipe = load_recipe(ROOT / "configs/tiny.yaml")
    torch.manual_seed(5)
    model = GLMForCausalLM(recipe.model, runtime=recipe.runtime)
    with torch.no_grad():
        for router in model.moe_routers():
            router.e_score_correction_bias.normal_(0, 0.02)  # the selection bias must reach megatron's router
    return recipe.model, model


@pytest.fixture(scope="module")
def cpu_megatron(tiny):
    """The megatron model of the tiny config on the CPU, loaded with the tiny model's converted weights."""
    from orthon.backends.megatron.model import _build, load_megatron_state

    config, model = tiny
    with megatron_on_cpu():
        gpt = _build(config, OPTIONS)[0]
        full = orthon_to_megatron(model.state_dict(), config, gpt.orthon_layout)
        load_megatron_state(gpt, full, config, OPTIONS)
        yield gpt, full


def test_transformer_config_of_the_tiny_model(tiny):
    config, _ = tiny
    c = transformer_config(config, MegatronOptions(tensor_parallel=2, expert_parallel=2))
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size, c.num_attention_heads) == (4, 256, 768, 4)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == (128, 64, 32, 16, 32)
    assert (c.rope_type, c.rotary_base, c.rotary_scaling_factor, c.layernorm_epsilon) == ("rope", 10000.0, 1.0, 1e-5)
    assert c.moe_layer_freq == [0, 1, 1, 1] and (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 2, 256)
    assert (c.moe_router_score_function, c.moe_router_enable_expert_bias, c.moe_router_topk_scaling_factor) == ("sigmoid", True, 2.5)
    assert (c.moe_shared_expert_intermediate_size, c.moe_router_load_balancing_type) == (256, "none")
    assert (c.tensor_model_parallel_size, c.expert_model_parallel_size, c.expert_tensor_parallel_size) == (2, 2, 2)
    assert c.sequence_parallel and c.params_dtype == torch.bfloat16
    assert (c.recompute_granularity, c.pipeline_dtype) == (None, None)
    # activation checkpointing: each layer recomputed in the backward; a pipeline exchanges the params' dtype
    c = transformer_config(config, MegatronOptions(pipeline_parallel=2, params_dtype="fp32"), recompute=True)
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "uniform", 1)
    assert (c.pipeline_model_parallel_size, c.pipeline_dtype) == (2, torch.float32)


def test_what_megatron_cannot_compute_is_refused(tiny):
    config, _ = tiny
    with pytest.raises(ConfigError, match="TP 3 does not divide the model's 4 attention heads"):
        transformer_config(config, MegatronOptions(tensor_parallel=3))
    with pytest.raises(ConfigError, match="EP 3 does not divide the model's 8 routed experts"):
        transformer_config(config, MegatronOptions(expert_parallel=3))
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        transformer_config(config.replace(norm_topk_prob=False), MegatronOptions())


def test_a_missing_extra_names_it(tiny, monkeypatch):
    config, _ = tiny
    monkeypatch.setitem(sys.modules, "megatron", None)  # as if megatron-core were not installed
    with pytest.raises(OrthonError, match=r"pip install orthon\[megatron\]"):
        build_model(config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_builder_builds_for_the_cpu(tiny):
    """No test patch of its own beyond undoing: build_model points megatron's CUDA device at the CPU itself
    and takes the allgather dispatcher (megatron's alltoall one creates CUDA streams)."""
    config, model = tiny
    with megatron_on_cpu():
        torch.cuda.current_device = _raises  # as torch's own does without CUDA (the helper restores torch's)
        gpt = build_model(config, MegatronOptions(params_dtype="fp32", transformer_engine="off"))
        assert torch.cuda.current_device() == "cpu" and gpt.config.moe_token_dispatcher_type == "allgather"
        full = orthon_to_megatron(model.state_dict(), config, gpt.orthon_layout)
        load_megatron_state(gpt, full, config, OPTIONS)
        ids = torch.randint(0, config.vocab_size, (2, 16))
        logits = gpt(ids, torch.arange(16)[None].expand(2, -1), None)
        assert logits.shape == (2, 16, config.vocab_size) and logits.device.type == "cpu"


def _raises():
    raise RuntimeError("Torch not compiled with CUDA enabled")


def test_state_dict_names_are_the_conversions(cpu_megatron):
    gpt, full = cpu_megatron
    names = {k for k in gpt.state_dict() if not k.endswith("._extra_state")}
    assert gpt.orthon_layout == MegatronLayout(te=False, grouped_experts=False, column_down_proj=False)
    # every tensor of the model is converted; the rest is the DSA indexer, which this dense-MLA model lacks
    assert names <= set(full) and all(".core_attention.indexer." in k for k in set(full) - names)


def _latent_eps(model, eps):
    for layer in model.model.layers:
        layer.self_attn.q_a_layernorm.eps = layer.self_attn.kv_a_layernorm.eps = eps


def test_logits_and_loss_match_the_torch_backend(tiny, cpu_megatron):
    config, model = tiny
    gpt, _ = cpu_megatron
    gpt.eval()
    ids = torch.randint(0, config.vocab_size, (2, 33))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    position = torch.arange(32)[None].expand(2, -1)
    with torch.no_grad():
        theirs = gpt(inputs, position, None)
        loss = gpt(inputs, position, None, labels=labels).mean()
        glm5 = model(inputs).logits  # GLM-5's latent norms use eps 1e-6, megatron's every norm rms_norm_eps
        _latent_eps(model, config.rms_norm_eps)
        out = model(inputs, labels=labels)
        _latent_eps(model, 1e-6)
    torch.testing.assert_close(theirs, out.logits, atol=2e-5, rtol=0)
    torch.testing.assert_close(loss, out.loss, atol=1e-5, rtol=0)
    assert 1e-6 < (theirs - glm5).abs().max() < 1e-3


def test_one_muon_split_step_matches_the_torch_backend(tiny, cpu_megatron):
    from orthon.backends.megatron.optimizer import build_optimizer
    from orthon.optim import OptimConfig, ScheduleConfig, build_for_model

    config, original = tiny
    gpt, full = cpu_megatron
    model = GLMForCausalLM(config)
    model.load_state_dict(original.state_dict())
    _latent_eps(model, config.rms_norm_eps)
    cfg = OptimConfig(ns_dtype="fp32")
    schedule = ScheduleConfig(peak_lr=0.01, floor_lr=0.01, warmup_tokens=0, total_tokens=10**6)
    ours, theirs = build_for_model(model, cfg, schedule), build_optimizer(gpt, config, cfg, schedule)
    # plain matrices; gate | up of the dense and shared MLPs; one block per head of the MLA up-projections
    assert sorted(g["split_rows"] for g in theirs.muon.param_groups) == [1, 2, 4]
    ids = torch.randint(0, config.vocab_size, (2, 33))
    gpt.train()
    gpt(ids[:, :-1], torch.arange(32)[None].expand(2, -1), None, labels=ids[:, 1:]).mean().backward()
    model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
    for opt in (ours, theirs):
        opt.set_tokens(1000)
        opt.step()
    after = megatron_to_orthon({**full, **gpt.state_dict()}, config, gpt.orthon_layout)
    moved = 0
    muon = {name for group in ours.muon.param_groups for name in group["param_names"]}
    for name, value in model.state_dict().items():
        # Muon's updates agree to float round-off; AdamW's first step is g / (|g| + eps), which turns the
        # round-off of a near-zero gradient into a visible difference (5 of lm_head's 1M numbers, 3e-5)
        atol = 1e-6 if name in muon else 1e-4
        torch.testing.assert_close(after[name], value, atol=atol, rtol=0, msg=name)
        moved += not torch.equal(value, original.state_dict()[name])
    assert moved == 83 - 4 * 5 - 3  # all but the 4 layers x 5 indexer tensors (no gradient) and 3 router biases


def test_bf16_parameters_step_through_fp32_main_weights(tiny, cpu_megatron):
    """megatron's bf16 mode: build_optimizer steps fp32 copies (with megatron's tensor-parallel marks) and
    writes them back rounded; the copies take the step an fp32 model from the same weights takes."""
    import dataclasses

    from orthon.backends.megatron.model import _build, load_megatron_state
    from orthon.backends.megatron.optimizer import build_optimizer
    from orthon.optim import OptimConfig, ScheduleConfig
    from orthon.optim.main_weights import MainWeightsOptimizer

    config, _ = tiny
    _, full = cpu_megatron  # inside the fixture's megatron-on-CPU set-up
    rounded = {k: v.bfloat16().float() for k, v in full.items()}
    half = _build(config, dataclasses.replace(OPTIONS, params_dtype="bf16"))[0]
    load_megatron_state(half, rounded, config, OPTIONS)
    whole = _build(config, OPTIONS)[0]
    load_megatron_state(whole, rounded, config, OPTIONS)
    cfg = OptimConfig(ns_dtype="fp32")
    schedule = ScheduleConfig(peak_lr=0.01, floor_lr=0.01, warmup_tokens=0, total_tokens=10**6)
    opt_half, opt_whole = build_optimizer(half, config, cfg, schedule), build_optimizer(whole, config, cfg, schedule)
    assert isinstance(opt_half, MainWeightsOptimizer) and not isinstance(opt_whole, MainWeightsOptimizer)
    g = torch.Generator().manual_seed(0)
    for p, q in zip(half.parameters(), whole.parameters()):
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)  # megatron keeps its norms in fp32
        q.grad = p.grad.float()
    for opt in (opt_half, opt_whole):
        opt.set_tokens(1000)
        opt.step()
    mains = {id(p): main for p, main in opt_half.pairs}
    assert len(mains) > 0.8 * len(list(half.parameters()))
    for (name, p), q in zip(half.named_parameters(), whole.parameters()):
        main = mains.get(id(p), p)  # an fp32 parameter is stepped as it is
        assert main.dtype == torch.float32, name
        assert getattr(main, "tensor_model_parallel", False) == getattr(p, "tensor_model_parallel", False), name
        torch.testing.assert_close(main, q, atol=0, rtol=0, msg=name)  # the fp32 step, bit for bit
        assert torch.equal(p, main.detach().to(p.dtype)), name
