"""`orthon export RUN --step N|latest`: a training checkpoint's model as a weights directory, read and
written one shard at a time."""
import pytest
import torch

import orthon.pretrain.checkpoint_export as checkpoint_export
from pretrain_support import make_stores, orthon, write_recipe
from orthon.core.errors import CheckpointError
from orthon.pretrain.checkpoint import Checkpointer
from orthon.pretrain.hf_io import experts_from_hf, load_hf_state, persistent_names, to_hf
from orthon.pretrain.model_info import meta_model
from orthon.pretrain.recipe import load_recipe
from orthon.pretrain.weights import load_weights


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    stores = make_stores(tmp / "data")
    run = tmp / "run"
    orthon("pretrain", "-c", write_recipe(tmp / "r.yaml", stores, run, train={"max_steps": 4, "checkpoint_interval": 2}),
           "--sample", "")
    return run


def test_the_newest_checkpoint_is_the_final_model(run, tmp_path):
    out = orthon("export", run, "--step", "latest", "--out", tmp_path / "w")
    assert "from " + str(run / "checkpoints" / "step_00000004") in out.stdout
    final, exported = load_hf_state(run / "final"), load_hf_state(tmp_path / "w")
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    assert (tmp_path / "w" / "orthon.json").read_text() == (run / "final" / "orthon.json").read_text()
    assert (tmp_path / "w" / "config.json").read_text() == (run / "final" / "config.json").read_text()


def test_an_intermediate_step_cast_and_sharded(run, tmp_path, monkeypatch):
    """Step 2 in bf16, in shards of at most 20 kB: each shard is read from the checkpoint on its own (one
    DCP read per shard, of that shard's bytes only: an expert stack larger than a shard, gate_up_proj's
    32 kB, two experts at a time), and the result is step 2's model cast as `orthon export` casts a weights
    directory."""
    reads = []
    real_load = checkpoint_export.dcp.load

    def recording_load(state, **kwargs):
        if all(isinstance(t, torch.Tensor) for t in state.values()):  # the export's reads, not load_model's
            reads.append({name: tuple(t.shape) for name, t in state.items()})
        return real_load(state, **kwargs)

    monkeypatch.setattr(checkpoint_export.dcp, "load", recording_load)
    recipe = load_recipe(run / "config.yaml")
    path = run / "checkpoints" / "step_00000002"
    checkpoint_export.export_checkpoint(path, recipe.model, recipe.runtime, tmp_path / "w", dtype=torch.bfloat16,
                                        max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "w").glob("*.safetensors"))
    assert len(files) == len(reads) > 3 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    stacks = [r for r in reads if any(name.endswith("gate_up_proj") for name in r)]
    gate_up = [shape for r in stacks for name, shape in r.items() if name.endswith("gate_up_proj")]
    moe_layers = recipe.model.num_hidden_layers - recipe.model.first_k_dense_replace
    assert len(stacks) == 2 * moe_layers and all(s[0] == 2 for s in gate_up), gate_up
    rows = {}  # every tensor's rows read once
    for r in reads:
        for name, shape in r.items():
            rows[name] = rows.get(name, 0) + (shape[0] if shape else 1)
    model = meta_model(recipe.model, recipe.runtime)
    full = {n: model.state_dict(keep_vars=True)[n].shape for n in persistent_names(model)}
    assert rows == {"model." + n: shape[0] if shape else 1 for n, shape in full.items()}

    model = meta_model(recipe.model, recipe.runtime)
    model.to_empty(device="cpu")
    Checkpointer(run).load_model(path, model)
    expected = experts_from_hf(to_hf(model.state_dict(), torch.bfloat16))  # read back, experts are stacked again
    exported = load_hf_state(tmp_path / "w")
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    assert exported["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert load_weights(tmp_path / "w").config == recipe.model  # a weights directory like any other


def test_what_cannot_be_exported_is_named(run, tmp_path):
    missing = orthon("export", run, "--step", "3", "--out", tmp_path / "w", check=False)
    assert missing.returncode == 2 and "no checkpoint of step 3 (it has steps 2, 4)" in missing.stderr
    bad = orthon("export", run, "--step", "two", "--out", tmp_path / "w", check=False)
    assert bad.returncode == 2 and "--step: a step number or 'latest'" in bad.stderr
    none = orthon("export", tmp_path, "--step", "latest", "--out", tmp_path / "w", check=False)
    assert none.returncode == 2 and "no checkpoints" in none.stderr
    recipe = load_recipe(run / "config.yaml")
    other = recipe.model.replace(intermediate_size=recipe.model.intermediate_size * 2)
    with pytest.raises(CheckpointError, match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \(96, 64\), "
                                              r"the model \(192, 64\)"):
        checkpoint_export.export_checkpoint(run / "checkpoints" / "step_00000004", other, recipe.runtime, tmp_path / "w")
    assert not (tmp_path / "w").exists()
