"""The one model-weights format: HF layout (config.json + safetensors) + the orthon.json sidecar."""
import json
import subprocess
import sys

import pytest
import torch

from hf_reference import RUNTIME_KEYS, hf_model_from_dir, randomize_router_bias, small_config, small_model
from orthon.core.errors import CheckpointError
from orthon.pretrain import GLMForCausalLM
from orthon.pretrain.config import RuntimeOptions
from orthon.pretrain.hf_io import load_hf_state
from orthon.pretrain.weights import SIDECAR, load_weights, save_weights

CASES = {"dense": small_config("dense"), "moe": small_config("moe"),
         "tied": small_config("moe", tie_word_embeddings=True)}


def _same_state(a: GLMForCausalLM, b: GLMForCausalLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_identical(case, tmp_path):
    model = GLMForCausalLM(CASES[case])
    randomize_router_bias(model)
    save_weights(model, tmp_path / "w")
    loaded = load_weights(tmp_path / "w")
    assert loaded.config == model.config
    _same_state(model, loaded)
    if model.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, loaded.eval()(ids).logits)
    # Saved again over itself with small shards: the directory is replaced whole, the model unchanged.
    save_weights(loaded, tmp_path / "w", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "w").iterdir())
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    _same_state(model, load_weights(tmp_path / "w"))
    assert not list(tmp_path.glob("w.*"))  # no .tmp / .old left beside it


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_the_directory_with_equal_logits(case, tmp_path):
    pytest.importorskip("transformers")
    model = GLMForCausalLM(CASES[case]).eval()
    randomize_router_bias(model)
    save_weights(model, tmp_path / "w")
    reference = hf_model_from_dir(tmp_path / "w")
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)


def test_sidecar_holds_the_runtime_options(tmp_path):
    model = small_model("dsa", sparse_attention=False, sparse_impl="gather", gather_min_len=77, query_chunk=33)
    save_weights(model, tmp_path / "w")
    sidecar = json.loads((tmp_path / "w" / SIDECAR).read_text())
    assert sidecar["runtime"] == {"sparse_attention": False, "sparse_impl": "gather", "gather_min_len": 77,
                                  "query_chunk": 33, "activation_checkpointing": False}
    hf = json.loads((tmp_path / "w" / "config.json").read_text())
    assert not RUNTIME_KEYS & set(hf)  # config.json holds HF keys only
    loaded = load_weights(tmp_path / "w")
    assert loaded.config == model.config and loaded.runtime == model.runtime
    # explicit fields win over the sidecar
    assert load_weights(tmp_path / "w", sparse_impl="mask").runtime.sparse_impl == "mask"


def test_without_sidecar_the_runtime_takes_its_defaults(tmp_path):
    model = small_model("moe", sparse_attention=False, query_chunk=33)
    save_weights(model, tmp_path / "w")
    (tmp_path / "w" / SIDECAR).unlink()  # as a real HF checkpoint is
    loaded = load_weights(tmp_path / "w")
    assert loaded.runtime == RuntimeOptions() != model.runtime
    assert loaded.config == model.config
    _same_state(model, loaded)


def test_bad_sidecar_is_named(tmp_path):
    save_weights(GLMForCausalLM(small_config("dense")), tmp_path / "w")
    path = tmp_path / "w" / SIDECAR
    data = json.loads(path.read_text())
    data["runtime"]["hidden_size"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"orthon.json: runtime.hidden_size: unknown key"):
        load_weights(tmp_path / "w")


@pytest.mark.parametrize("shards", [1, 3])
def test_truncated_safetensors_file_is_named(shards, tmp_path):
    model = GLMForCausalLM(small_config("moe"))
    save_weights(model, tmp_path / "w", max_shard_bytes=10**9 if shards == 1 else 250_000)
    files = sorted((tmp_path / "w").glob("*.safetensors"))
    assert len(files) >= shards
    victim = files[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{victim.name}: unreadable safetensors file"):
        load_weights(tmp_path / "w")


def test_old_layout_missing_dir_and_foreign_files(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "recipe.yaml").write_text("model: {}\n")
    (old / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="old orthon weights layout.*recipe.yaml.*orthon import"):
        load_weights(old)
    with pytest.raises(CheckpointError, match="no such weights directory"):
        load_weights(tmp_path / "nothing")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="notes.txt"):
        save_weights(GLMForCausalLM(small_config("dense")), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_crash_during_save_keeps_the_previous_weights(tmp_path, monkeypatch):
    import orthon.pretrain.hf_io as hf_io

    first = GLMForCausalLM(small_config("dense"))
    save_weights(first, tmp_path / "w")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_io, "atomic_write_json", crash)  # dies after the tensors, before config.json
    with pytest.raises(KeyboardInterrupt):
        save_weights(GLMForCausalLM(small_config("dense")), tmp_path / "w")
    monkeypatch.undo()
    _same_state(first, load_weights(tmp_path / "w"))
    # Died between its two renames: the previous weights wait under w.old, and the next save puts them back
    # before replacing them.
    (tmp_path / "w").rename(tmp_path / "w.old")
    with pytest.raises(CheckpointError, match="a save was interrupted: w.old"):
        load_weights(tmp_path / "w")
    second = GLMForCausalLM(small_config("dense"))
    save_weights(second, tmp_path / "w")
    _same_state(second, load_weights(tmp_path / "w"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "orthon.launch.cli", *map(str, args)], capture_output=True, text=True)


def test_cli_export_casts_and_reshards_import_converts_the_old_layout(tmp_path):
    from safetensors.torch import save_file
    import yaml

    model = small_model("moe", sparse_attention=False)
    run = tmp_path / "run"
    save_weights(model, run / "final")
    out = _cli("export", run, "--out", tmp_path / "pub", "--dtype", "bfloat16", "--max-shard-size", "100KB")
    assert out.returncode == 0, out.stderr
    assert len(list((tmp_path / "pub").glob("model-*.safetensors"))) > 1
    assert json.loads((tmp_path / "pub" / "config.json").read_text())["dtype"] == "bfloat16"
    state = load_hf_state(tmp_path / "pub")
    assert state["lm_head.weight"].dtype == torch.bfloat16
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert load_weights(tmp_path / "pub").config == model.config

    # The layout orthon wrote before: recipe.yaml (model section) + model.safetensors of the state dict.
    old = tmp_path / "old"
    old.mkdir()
    # (its model section held the runtime options too)
    (old / "recipe.yaml").write_text(yaml.safe_dump({"model": {**model.config.__dict__, **model.runtime.__dict__}}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(old / "model.safetensors"))
    out = _cli("import", old, "--out", old)
    assert out.returncode == 0, out.stderr
    assert not (old / "recipe.yaml").exists()
    converted = load_weights(old)
    assert converted.config == model.config and converted.runtime == model.runtime
    _same_state(model, converted)

    # An HF directory without the sidecar, with runtime options given on the command line.
    (tmp_path / "pub" / SIDECAR).unlink()
    out = _cli("import", tmp_path / "pub", "--out", tmp_path / "imp", "--set", "sparse_impl=gather")
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "imp" / "config.json").read_text())["dtype"] == "bfloat16"  # kept
    assert load_weights(tmp_path / "imp").runtime.sparse_impl == "gather"
    out = _cli("import", tmp_path / "pub", "--out", tmp_path / "x", "--set", "hidden_size=8")
    assert out.returncode == 2 and "not a runtime option" in out.stderr


def test_export_and_import_copy_a_shard_at_a_time(tmp_path, monkeypatch):
    """`orthon export` / `import` (copy_weights) never load the model: the tensors are checked from the
    files' headers, each read once when its output shard is written, and the result equals the model cast
    as a save casts it. An MTP layer past num_hidden_layers is dropped; a mis-shaped tensor is named before
    anything is written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import orthon.pretrain.hf_io as hf_io
    from orthon.pretrain.weights import copy_weights

    model = small_model("moe")
    randomize_router_bias(model)
    source = save_weights(model, tmp_path / "src")
    save_file({"model.layers.9.eh_proj.weight": torch.ones(4, 4)}, str(source / "extra.safetensors"))
    index = json.loads((source / hf_io.INDEX_NAME).read_text()) if (source / hf_io.INDEX_NAME).is_file() else None
    if index is None:  # one file: make it an index of two, as a checkpoint with an MTP layer ships
        weight_map = {k: hf_io.SINGLE_NAME for k in safe_open(str(source / hf_io.SINGLE_NAME), "pt").keys()}
        index = {"metadata": {}, "weight_map": weight_map}
    index["weight_map"]["model.layers.9.eh_proj.weight"] = "extra.safetensors"
    (source / hf_io.INDEX_NAME).write_text(json.dumps(index))

    reads = []
    real_get = hf_io.HFTensors._get
    monkeypatch.setattr(hf_io.HFTensors, "_get", lambda self, name: reads.append(name) or real_get(self, name))
    monkeypatch.setattr(hf_io, "load_hf_state", lambda *a: pytest.fail("the whole model was loaded"))
    copied = copy_weights(source, tmp_path / "out", dtype=torch.bfloat16, max_shard_bytes=20_000)
    monkeypatch.undo()
    expected = hf_io.to_hf(model.state_dict(), torch.bfloat16)
    assert sorted(reads) == sorted(expected) and copied.config == model.config
    files = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(files) > 3
    got = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            shard = {k: f.get_tensor(k) for k in f.keys()}
        nbytes = sum(t.numel() * t.element_size() for t in shard.values())
        assert nbytes <= 20_000 or len(shard) == 1, (path.name, nbytes)
        got.update(shard)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert load_weights(tmp_path / "out").runtime == model.runtime

    name = "model.layers.0.self_attn.o_proj.weight"
    with safe_open(str(source / index["weight_map"][name]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(source / index["weight_map"][name]))
    with pytest.raises(CheckpointError, match=f"tensor {name}: shape"):
        copy_weights(source, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_runs_final_dir_is_hf_layout_that_transformers_loads(tmp_path):
    pytest.importorskip("transformers")
    from pretrain_support import make_stores, orthon, write_recipe
    from orthon.pretrain.recipe import load_recipe

    stores = make_stores(tmp_path / "data")
    recipe = write_recipe(tmp_path / "r.yaml", stores, tmp_path / "run", train={"max_steps": 2})
    orthon("pretrain", "-c", recipe)
    final = tmp_path / "run" / "final"
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "model.safetensors", SIDECAR]
    assert json.loads((final / SIDECAR).read_text())["runtime"]["sparse_attention"] is False
    model = load_weights(final).eval()
    assert model.config == load_recipe(recipe).model
    reference = hf_model_from_dir(final)
    # transformers always runs DSA; up to index_topk (16) tokens its top-k keeps every key, as dense MLA does.
    ids = torch.randint(0, model.config.vocab_size, (2, model.config.index_topk))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)


def test_a_window_of_an_expert_stack_becomes_those_experts_hf_tensors():
    """A row piece of a stack ("...experts.gate_up_proj[2:4]", a part streamed alone) is experts 2 and 3 of
    the HF layout, equal to the same experts of the whole stack's conversion."""
    from orthon.pretrain.hf_io import experts_to_hf, row_piece_name

    stack = torch.arange(4 * 6 * 3, dtype=torch.float32).reshape(4, 6, 3)  # 4 experts, [gate; up] 3 + 3 rows
    name = "model.layers.1.mlp.experts.gate_up_proj"
    whole = experts_to_hf({name: stack})
    window = experts_to_hf({row_piece_name(name, 2, 4): stack[2:4]})
    assert sorted(window) == sorted(k for k in whole if ".experts.2." in k or ".experts.3." in k)
    assert all(torch.equal(window[k], whole[k]) for k in window)
    assert torch.equal(window["model.layers.1.mlp.experts.3.up_proj.weight"], stack[3, 3:])
