"""orthon's weights <-> megatron-core GPTModel names, and megatron's TP / PP / EP shards: round trips are
bit-identical, the fused and split tensors hold the rows a hand check says, the shards compute what the
whole layer computes, and a layout that does not divide the model names the sizes that conflict."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from orthon.backends.megatron import (
    MegatronLayout,
    ParallelSizes,
    check_parallel,
    hf_to_megatron,
    load_as_megatron,
    megatron_to_hf,
    megatron_to_orthon,
    merge,
    orthon_to_megatron,
    save_from_megatron,
    shard,
)
from orthon.core.errors import CheckpointError, ConfigError
from orthon.pretrain import GLMForCausalLM, load_weights, save_weights
from orthon.pretrain.hf_io import hf_tensors
from orthon.pretrain.recipe import load_recipe
from pretrain_support import ROOT

LAYOUTS = [MegatronLayout(te=True, grouped_experts=True), MegatronLayout(te=False, grouped_experts=False),
           MegatronLayout(te=True, grouped_experts=False)]


@pytest.fixture(scope="module")
def tiny():
    """configs/tiny.yaml's model with every tensor random (norm scales and router biases too)."""
    recipe = load_recipe(ROOT / "configs/tiny.yaml")
    torch.manual_seed(3)
    model = GLMForCausalLM(recipe.model, runtime=recipe.runtime)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.ndim == 1:
                tensor.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return recipe.model, model


def _same(a: dict, b: dict):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:8]
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_round_trip_of_the_tiny_model_is_bit_identical(tiny, layout):
    config, model = tiny
    state = model.state_dict()
    megatron = orthon_to_megatron(state, config, layout)
    _same(megatron_to_orthon(megatron, config, layout), state)
    hf = hf_tensors(model)  # the weights format: experts one tensor each
    _same(megatron_to_hf(hf_to_megatron(hf, config, layout), config, layout), hf)


def test_names_and_fused_tensors(tiny):
    config, model = tiny
    s = model.state_dict()
    te = orthon_to_megatron(s, config, MegatronLayout())
    local = orthon_to_megatron(s, config, MegatronLayout(te=False, grouped_experts=False))
    layer0, layer1 = "decoder.layers.0.", "decoder.layers.1."  # tiny: layer 0 dense, 1..3 MoE
    assert torch.equal(te["embedding.word_embeddings.weight"], s["model.embed_tokens.weight"])
    assert torch.equal(te["output_layer.weight"], s["lm_head.weight"])
    assert torch.equal(te["decoder.final_layernorm.weight"], s["model.norm.weight"])
    # the latent norms: fused into the up-projections (TE) or modules of their own (local spec)
    assert torch.equal(te[layer1 + "self_attention.linear_q_up_proj.layer_norm_weight"],
                       s["model.layers.1.self_attn.q_a_layernorm.weight"])
    assert torch.equal(local[layer1 + "self_attention.kv_layernorm.weight"],
                       s["model.layers.1.self_attn.kv_a_layernorm.weight"])
    # the dense layer's norm before its MLP, and its fused [gate; up]
    assert torch.equal(te[layer0 + "mlp.linear_fc1.layer_norm_weight"], s["model.layers.0.post_attention_layernorm.weight"])
    assert torch.equal(local[layer0 + "pre_mlp_layernorm.weight"], s["model.layers.0.post_attention_layernorm.weight"])
    assert torch.equal(te[layer0 + "mlp.linear_fc1.weight"][:768], s["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(te[layer0 + "mlp.linear_fc1.weight"][768:], s["model.layers.0.mlp.up_proj.weight"])
    # a MoE layer: router, expert bias, expert 3 (both expert containers), shared expert
    assert torch.equal(te[layer1 + "mlp.router.expert_bias"], s["model.layers.1.mlp.gate.e_score_correction_bias"])
    gate_up = s["model.layers.1.mlp.experts.gate_up_proj"][3]
    assert torch.equal(te[layer1 + "mlp.experts.linear_fc1.weight3"], gate_up)
    assert torch.equal(local[layer1 + "mlp.experts.local_experts.3.linear_fc1.weight"], gate_up)
    assert torch.equal(te[layer1 + "mlp.experts.linear_fc2.weight3"], s["model.layers.1.mlp.experts.down_proj"][3])
    assert torch.equal(te[layer1 + "mlp.shared_experts.linear_fc1.weight"][256:],
                       s["model.layers.1.mlp.shared_experts.up_proj.weight"])
    # the indexer key: GLM-5 rotates its first 16 of 32 numbers, megatron's DSA its last 16
    wk = s["model.layers.1.self_attn.indexer.wk.weight"]
    assert torch.equal(te[layer1 + "self_attention.core_attention.indexer.linear_wk.weight"],
                       torch.cat([wk[16:], wk[:16]]))
    # 3 MoE layers x 2 stacks of 8 experts unstacked; gate + up fused in 1 dense MLP and 3 shared experts
    assert len(te) == len(local) == len(s) + 3 * 2 * (8 - 1) - 4


def test_indexer_scores_are_the_same_under_megatrons_rope_convention(tiny):
    """orthon's indexer against the scores computed from the converted weights the way megatron's DSA
    indexer does (rope on the last numbers of each head, megatron's own rotary function)."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    config, model = tiny
    attn = model.model.layers[1].self_attn
    m = orthon_to_megatron(model.state_dict(), config)
    prefix = "decoder.layers.1.self_attention.core_attention.indexer."
    T, n, d, r = 12, config.index_n_heads, config.index_head_dim, config.qk_rope_head_dim
    x, q_resid = torch.randn(1, T, config.hidden_size), torch.randn(1, T, config.q_lora_rank)
    from orthon.pretrain.attention import index_scores
    from orthon.pretrain.layers import rope_cos_sin, rope_inv_freq

    cos, sin = rope_cos_sin(torch.arange(T), r, config.rope_theta, torch.float32)
    with torch.no_grad():
        q, w = attn.indexer.queries(x, q_resid, cos, sin)
        expected = index_scores(q, w, attn.indexer.keys(x, cos, sin), attn.indexer.scale)
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), rope_inv_freq(r, config.rope_theta))
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]

        def rope_last(t):  # t: [T, 1, heads, d]
            return torch.cat([t[..., : d - r], _apply_rotary_pos_emb_bshd(t[..., d - r:], emb, multi_latent_attention=True)], -1)

        mq = rope_last((q_resid @ m[prefix + "linear_wq_b.weight"].T).view(T, 1, n, d))
        mk = F.layer_norm(x @ m[prefix + "linear_wk.weight"].T, (d,), m[prefix + "k_norm.weight"], m[prefix + "k_norm.bias"], 1e-6)
        mk = rope_last(mk.view(T, 1, 1, d))[:, :, 0]
        weights = (x @ m[prefix + "linear_weights_proj.weight"].T).view(T, 1, n) * n**-0.5
        got = torch.einsum("sbh,sbht->bst", weights, F.relu(torch.einsum("sbhd,tbd->sbht", mq, mk) * d**-0.5))
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("sizes", [ParallelSizes(tp=2, ep=2), ParallelSizes(tp=2, pp=2, ep=2),
                                   ParallelSizes(tp=2, ep=2, etp=1), ParallelSizes(pp=4, ep=8)], ids=str)
def test_sharded_then_merged_equals_the_original(tiny, layout, sizes):
    config, model = tiny
    full = orthon_to_megatron(model.state_dict(), config, layout)
    shards = shard(full, config, sizes, layout)
    assert sorted(shards) == sorted(itertools.product(range(sizes.pp), range(sizes.tp), range(sizes.ep)))
    _same(merge(shards, config, sizes, layout), full)


def test_what_each_rank_holds_at_tp2_pp2_ep2(tiny):
    config, model = tiny
    full = orthon_to_megatron(model.state_dict(), config)
    shards = shard(full, config, ParallelSizes(tp=2, pp=2, ep=2))
    s = model.state_dict()
    first, last = shards[(0, 1, 0)], shards[(1, 1, 1)]
    # embedding on the first stage only, its vocabulary halves; final norm and output on the last
    assert torch.equal(first["embedding.word_embeddings.weight"], s["model.embed_tokens.weight"][2048:])
    assert "embedding.word_embeddings.weight" not in last and "output_layer.weight" not in first
    assert torch.equal(last["output_layer.weight"], s["lm_head.weight"][2048:])
    # stage 1 holds layers 2 and 3 as 0 and 1
    assert {k.split(".")[2] for k in last if k.startswith("decoder.layers.")} == {"0", "1"}
    # column-parallel by heads: tp rank 1 has heads 2 and 3 of the up-projections, row-parallel o_proj columns
    q_b = s["model.layers.3.self_attn.q_b_proj.weight"]
    assert torch.equal(last["decoder.layers.1.self_attention.linear_q_up_proj.weight"], q_b[96:])
    assert torch.equal(last["decoder.layers.1.self_attention.linear_proj.weight"], s["model.layers.3.self_attn.o_proj.weight"][:, 64:])
    # TE spec: the down-projections are replicated
    assert torch.equal(last["decoder.layers.1.self_attention.linear_q_down_proj.weight"],
                       s["model.layers.3.self_attn.q_a_proj.weight"])
    # EP rank 1 holds experts 4..7 as 0..3; ETP rank 1 the second halves of gate and up, and of down's columns
    gate_up = s["model.layers.3.mlp.experts.gate_up_proj"][5]
    assert torch.equal(last["decoder.layers.1.mlp.experts.linear_fc1.weight1"], torch.cat([gate_up[128:256], gate_up[384:]]))
    assert torch.equal(last["decoder.layers.1.mlp.experts.linear_fc2.weight1"], s["model.layers.3.mlp.experts.down_proj"][5][:, 128:])
    assert not any(k.endswith("weight4") for k in last)
    only = shard(full, config, ParallelSizes(tp=2, pp=2, ep=2), only=(1, 1, 1))
    assert list(only) == [(1, 1, 1)]
    _same(only[(1, 1, 1)], last)


def test_a_tied_embedding_has_its_copy_on_the_last_stage(tiny):
    config, model = tiny
    config = config.replace(tie_word_embeddings=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    full = orthon_to_megatron(state, config)
    assert "output_layer.weight" not in full
    sizes = ParallelSizes(tp=2, pp=2)
    shards = shard(full, config, sizes)
    assert torch.equal(shards[(1, 1, 0)]["output_layer.weight"], state["model.embed_tokens.weight"][2048:])
    _same(merge(shards, config, sizes), full)


def test_tp_shards_compute_the_whole_layer(tiny):
    """Each rank's gated fc1 / fc2 pair (SwiGLU then a partial sum) adds up to the full MLP, and the
    column-parallel q up-projection's shards are the heads of the full one."""
    config, model = tiny
    shards = shard(orthon_to_megatron(model.state_dict(), config), config, ParallelSizes(tp=2))
    x = torch.randn(5, config.hidden_size)
    with torch.no_grad():
        whole = model.model.layers[0].mlp(x)
        parts = 0
        for tp in range(2):
            fc1 = shards[(0, tp, 0)]["decoder.layers.0.mlp.linear_fc1.weight"]
            fc2 = shards[(0, tp, 0)]["decoder.layers.0.mlp.linear_fc2.weight"]
            gate, up = (x @ fc1.T).chunk(2, dim=-1)
            parts = parts + (F.silu(gate) * up) @ fc2.T
        assert torch.allclose(parts, whole, atol=1e-6)
        latent = torch.randn(5, config.q_lora_rank)
        q = torch.cat([latent @ shards[(0, tp, 0)]["decoder.layers.0.self_attention.linear_q_up_proj.weight"].T
                       for tp in range(2)], dim=-1)
        assert torch.allclose(q, model.model.layers[0].self_attn.q_b_proj(latent), atol=1e-6)


@pytest.mark.parametrize("sizes, message", [
    (ParallelSizes(tp=3), "TP 3 does not divide the model's 4 attention heads \\(num_attention_heads\\)"),
    (ParallelSizes(ep=3), "EP 3 does not divide the model's 8 routed experts \\(n_routed_experts\\)"),
    (ParallelSizes(pp=3), "PP 3 does not divide the model's 4 layers \\(num_hidden_layers\\)"),
    (ParallelSizes(tp=2, etp=3), "ETP 3 does not divide the model's 256 expert width"),
    (ParallelSizes(tp=4, etp=2), "ETP 2: the experts' tensor-parallel size must be 1 or TP \\(4\\)"),
    (ParallelSizes(tp=0), "TP: must be a positive integer, got 0"),
])
def test_a_layout_that_does_not_divide_the_model_names_the_sizes(tiny, sizes, message):
    config, model = tiny
    with pytest.raises(ConfigError, match=message):
        check_parallel(config, sizes)
    with pytest.raises(ConfigError, match=message):
        shard(orthon_to_megatron(model.state_dict(), config), config, sizes)


def test_the_local_spec_also_splits_the_latent_projections(tiny):
    config, _ = tiny
    with pytest.raises(ConfigError, match="TP 32 does not divide the model.s 80 key-value latent"):
        check_parallel(config.replace(num_attention_heads=32), ParallelSizes(tp=32),
                       MegatronLayout(te=False, grouped_experts=False))
    check_parallel(config.replace(num_attention_heads=32), ParallelSizes(tp=32))  # TE: replicated there


def test_missing_extra_and_inconsistent_tensors_are_named(tiny):
    config, model = tiny
    state = dict(model.state_dict())
    del state["model.layers.2.self_attn.kv_b_proj.weight"]
    with pytest.raises(CheckpointError, match="orthon state lacks model.layers.2.self_attn.kv_b_proj.weight"):
        orthon_to_megatron(state, config)
    full = orthon_to_megatron(model.state_dict(), config)
    with pytest.raises(CheckpointError, match="1 tensors the model does not: \\['decoder.layers.9.mlp.router.weight'\\]"):
        megatron_to_orthon({**full, "decoder.layers.9.mlp.router.weight": torch.zeros(1)}, config)
    shards = shard(full, config, ParallelSizes(tp=2))
    shards[(0, 1, 0)]["decoder.layers.0.input_layernorm.weight"] = torch.zeros(256)
    with pytest.raises(CheckpointError, match="decoder.layers.0.input_layernorm.weight: replicated across TP ranks but rank 1"):
        merge(shards, config, ParallelSizes(tp=2))
    with pytest.raises(ConfigError, match="attention_bias"):
        orthon_to_megatron(model.state_dict(), config.replace(attention_bias=True))


def test_weights_directory_round_trip(tiny, tmp_path):
    config, model = tiny
    model.runtime.sparse_impl = "gather"
    save_weights(model, tmp_path / "orthon")
    loaded_config, megatron = load_as_megatron(tmp_path / "orthon")
    assert loaded_config == config
    save_from_megatron(megatron, config, tmp_path / "back", runtime=model.runtime)
    again = load_weights(tmp_path / "back")
    assert again.runtime.sparse_impl == "gather"
    _same(again.state_dict(), model.state_dict())
