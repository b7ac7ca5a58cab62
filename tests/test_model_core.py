"""Model behaviour beyond parity: bad inputs, parameter specs, MoE routing, the trainable indexer."""
import json
import re

import pytest
import torch

from hf_reference import SMALL, small_config, small_model
from orthon.pretrain.weights import save_weights
from orthon.core.errors import ConfigError
from orthon.pretrain import GLMForCausalLM, ModelConfig, from_hf
from orthon.core.errors import CheckpointError
from orthon.pretrain.moe import route, update_expert_bias
from orthon.pretrain.model import on_meta_device


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(n_group=3), "n_group"),
        (dict(index_head_dim=4), "index_head_dim"),
        (dict(indexer_types=["full", "shared"]), "indexer_types"),
        (dict(indexer_types=["shared", "full", "full"]), "indexer_types[0]"),
        (dict(first_k_dense_replace=9), "first_k_dense_replace"),
        (dict(eos_token_id=999), "eos_token_id"),
        (dict(hidden_size=0), "hidden_size"),
    ],
)
def test_inconsistent_config_names_the_field(change, field):
    with pytest.raises(ConfigError, match="^" + re.escape(field) + ":"):
        ModelConfig(**{**SMALL, **change})


def test_out_of_range_token_ids():
    model = GLMForCausalLM(small_config("moe"))
    with pytest.raises(ValueError, match="token id 257 is outside the vocabulary"):
        model(torch.tensor([[1, 257]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 2]]))


def test_hf_dir_with_missing_or_misshaped_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    model = GLMForCausalLM(small_config("moe"))
    save_weights(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    good = dict(state)
    state.pop("model.layers.0.self_attn.kv_b_proj.weight")
    save_file(state, str(weights))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\).*kv_b_proj"):
        from_hf(tmp_path)
    good["model.layers.2.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    save_file(good, str(weights))
    with pytest.raises(CheckpointError, match=r"o_proj.weight: shape \(3, 3\) does not match the config's \(64, 48\)"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type"):
        from_hf(tmp_path)


def test_param_specs_cover_every_parameter_once_with_head_splits():
    model = GLMForCausalLM(small_config("indexshare"))
    specs = model.param_specs()
    assert list(specs) == [n for n, _ in model.named_parameters()]
    assert specs["model.layers.0.self_attn.q_b_proj.weight"].split_rows == 4
    assert specs["model.layers.0.self_attn.kv_b_proj.weight"].split_rows == 4
    assert specs["model.layers.0.self_attn.o_proj.weight"].split_rows == 1
    assert specs["model.embed_tokens.weight"].kind == "embedding"
    assert specs["lm_head.weight"].kind == "output_head"
    assert specs["model.layers.1.mlp.experts.gate_up_proj"].kind == "expert_stack"
    assert specs["model.layers.0.self_attn.indexer.k_norm.bias"].kind == "bias"
    assert specs["model.norm.weight"].kind == "norm"


def test_router_bias_moves_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sig = logits.sigmoid()
    w, idx = route(logits, torch.zeros(4), 2, 1, 1, True, 2.5)
    assert idx.tolist() == [[0, 1]]
    torch.testing.assert_close(w, 2.5 * sig[:, :2] / sig[:, :2].sum())
    w, idx = route(logits, torch.tensor([0.0, 0.0, 0.0, 1.0]), 2, 1, 1, False, 1.0)
    assert sorted(idx[0].tolist()) == [0, 3]
    torch.testing.assert_close(w.sort(-1).values, torch.stack([sig[0, 3], sig[0, 0]])[None])


def test_expert_bias_update_hand_checked():
    bias = torch.zeros(4)
    new = update_expert_bias(bias, torch.tensor([10.0, 2.0, 4.0, 4.0]), 0.001)  # mean 5
    torch.testing.assert_close(new, torch.tensor([-0.001, 0.001, 0.001, 0.001]))


def test_expert_load_counted_in_training():
    model = GLMForCausalLM(small_config("moe")).train()
    model(torch.randint(0, 257, (2, 10)))
    for router in model.moe_routers():
        assert router.expert_load.sum().item() == 2 * 10 * 2  # tokens x top-k


def test_indexer_is_trainable():
    model = GLMForCausalLM(small_config("dsa"))
    out = model(torch.randint(0, 257, (1, 20)), want_index_scores=True)
    loss = sum(s.logsumexp(-1).sum() for s in out.index_scores.values())
    loss.backward()
    for indexer in model.indexers():
        for name, p in indexer.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("case, impl", [("moe", "auto"), ("dsa", "mask"), ("dsa", "gather")])
def test_document_mask_equals_separate_documents(case, impl):
    """A packed sequence with doc_ids gives each document the logits it has alone (same positions)."""
    model = small_model(case, sparse_impl=impl).eval()
    a, b = torch.randint(0, 257, (1, 14)), torch.randint(0, 257, (1, 26))
    packed = torch.cat([a, b], dim=1)
    docs = torch.tensor([[0] * 14 + [1] * 26])
    with torch.no_grad():
        out = model(packed, doc_ids=docs).logits
        alone_a = model(a).logits
        alone_b = model(b, position_ids=torch.arange(14, 40)).logits
    torch.testing.assert_close(out[:, :14], alone_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[:, 14:], alone_b, atol=1e-5, rtol=0)


def test_a_model_built_on_meta_then_drawn_equals_a_direct_build():
    """What FSDP2's sharded build relies on: built on the meta device, given memory, draw_as_built() then
    reset_parameters() give the values a direct build gives under the same seed, and leave the global
    generator where a direct build does."""
    from pathlib import Path

    from orthon.pretrain.recipe import load_recipe

    config = load_recipe(Path(__file__).resolve().parents[1] / "configs/tiny.yaml").model
    torch.manual_seed(11)
    direct = GLMForCausalLM(config).state_dict()
    after_direct = torch.rand(3)
    torch.manual_seed(11)
    with on_meta_device():  # as the Trainer builds it for FSDP2: no initialisation on the meta device
        model = GLMForCausalLM(config)
        cpu = torch.empty(4, device="cpu")
        torch.nn.init.ones_(cpu)  # what is not on the meta device is initialised as ever
    assert torch.equal(cpu, torch.ones(4)) and all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.draw_as_built()
    model.reset_parameters()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in direct.items())
    assert torch.equal(torch.rand(3), after_direct)
