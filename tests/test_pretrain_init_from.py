"""Continued pretraining: `train.init_from` starts a new run from another run's final weights."""
import pytest
import torch

from pretrain_support import make_stores, orthon, write_recipe
from orthon.core.errors import ConfigError
from orthon.pretrain.recipe import load_recipe
from orthon.pretrain.trainer import Trainer
from orthon.pretrain.weights import load_weights


def test_init_from_starts_from_the_source_weights_and_checks_the_model(tmp_path):
    stores = make_stores(tmp_path / "data")
    source = tmp_path / "source"
    orthon("pretrain", "-c", write_recipe(tmp_path / "a.yaml", stores, source, train={"max_steps": 3}))
    trained = load_weights(source / "final").state_dict()

    recipe_path = write_recipe(tmp_path / "b.yaml", stores, tmp_path / "b", train={"init_from": str(source)})
    model = Trainer(load_recipe(recipe_path, []), tmp_path / "b").model
    state = model.state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    # A fresh run of the same recipe would start elsewhere: init_from is what set these weights.
    fresh = Trainer(load_recipe(recipe_path, ["train.init_from="]), tmp_path / "c").model.state_dict()
    assert not torch.equal(fresh["model.layers.0.self_attn.q_a_proj.weight"], trained["model.layers.0.self_attn.q_a_proj.weight"])

    with pytest.raises(ConfigError, match=r"train.init_from: .*model.num_hidden_layers"):
        Trainer(load_recipe(recipe_path, ["model.num_hidden_layers=3"]), tmp_path / "d")
    # The token ids are the tokenizer's, not the architecture: another tokenizer's ids do not refuse it.
    moved = Trainer(load_recipe(recipe_path, ["model.eos_token_id=5", "model.bos_token_id=4"]), tmp_path / "e").model
    assert all(torch.equal(moved.state_dict()[k], trained[k]) for k in trained)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_that_emulates_it_is_warned_about(tmp_path, monkeypatch, native):
    import orthon.pretrain.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "bf16_gemm_is_native", lambda device: native)
    stores = make_stores(tmp_path / "data")
    recipe = load_recipe(write_recipe(tmp_path / "a.yaml", stores, tmp_path / "a", train={"precision": "bf16"}), [])
    lines = []
    Trainer(recipe, tmp_path / "a", log=lines.append, with_data=False)
    warned = [line for line in lines if "train.precision bf16" in line]
    assert len(warned) == (0 if native else 1)
    lines.clear()
    recipe = load_recipe(write_recipe(tmp_path / "b.yaml", stores, tmp_path / "b"), [])
    Trainer(recipe, tmp_path / "b", log=lines.append, with_data=False)
    assert not any("train.precision" in line for line in lines)  # fp32: nothing to say
