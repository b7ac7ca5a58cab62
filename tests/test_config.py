"""The recipe layer: YAML + dotted overrides into typed dataclasses, errors by dotted path."""
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Literal

import pytest
from pathlib import Path

from orthon.core.config import ConfigError, build, load
from orthon.pretrain.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Inner:
    rate: float = 0.1
    kind: Literal["a", "b"] = "a"
    sizes: list[int] = field(default_factory=lambda: [1, 2])


@dataclass
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)
    steps: int | None = None


def test_overrides_and_types(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: run\ninner:\n  rate: 2e-4\n  sizes: [3, 4]\n")
    cfg = load(Outer, recipe, ["inner.kind=b", "steps=1_000", "inner.sizes=[5]"])
    assert cfg == Outer(name="run", inner=Inner(rate=2e-4, kind="b", sizes=[5]), steps=1000)


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"inner": {"rat": 1}}, "inner.rat: unknown key"),
        ({"inner": {"rate": "fast"}}, "inner.rate: expected a number"),
        ({"inner": {"kind": "c"}}, "inner.kind: 'c' is not one of"),
        ({"inner": {"sizes": [1, "x"]}}, r"inner.sizes\[1\]: expected an integer"),
        ({"steps": 1.5}, "steps: expected an integer"),
        ({"inner": 3}, "inner: expected a mapping"),
    ],
)
def test_bad_keys_and_values_name_their_path(mapping, message):
    with pytest.raises(ConfigError, match=message):
        build(Outer, mapping)


def test_model_validation_error_carries_the_section_path():
    with pytest.raises(ConfigError, match=r"^model\.num_experts_per_tok: 99 must be in"):
        load_recipe(str(ROOT / "configs/tiny.yaml"), ["model.num_experts_per_tok=99"])


def test_shipped_recipes_load():
    tiny = load_recipe(str(ROOT / "configs/tiny.yaml"))
    glm5 = load_recipe(str(ROOT / "configs/glm5.yaml"))
    assert tiny.model.hidden_size == 256
    assert (glm5.model.hidden_size, glm5.model.num_hidden_layers, glm5.model.index_topk) == (6144, 78, 2048)
    # The cluster settings the recipe runs with: sharded, bf16 autocast, checkpoints in the background.
    assert (glm5.train.parallel, glm5.train.precision, glm5.train.async_checkpoint) == ("fsdp", "bf16", True)


def test_model_info_reports_glm5_size():
    out = subprocess.run(
        [sys.executable, "-m", "orthon.launch.cli", "model-info", "-c", str(ROOT / "configs/glm5.yaml")],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout
    total = int(out.split("(exact: ")[1].split(" total")[0].replace(",", ""))
    active = int(out.split(" total, ")[1].split(" active")[0].replace(",", ""))
    assert 740e9 < total < 748e9  # published: 744B
    assert 39e9 < active < 43e9  # published: 40B (39.9B without embedding and head)
    # Its training FLOPs a token at 4K (orthon.pretrain.flops, pinned in tests/test_flops.py): 303 GFLOP dense
    from orthon.pretrain.config import ModelConfig
    from orthon.pretrain.flops import ModelFlops

    flops = ModelFlops.of(ModelConfig())
    dense, sparse = flops.per_token(4096) / 1e9, flops.per_token(4096, sparse=True) / 1e9
    assert 300 < dense < 310 and f"at 4,096 tokens (data.seq_len): {dense:,.3f} GFLOP dense, {sparse:,.3f} with DSA" in out


def test_cli_config_error_exit_code():
    proc = subprocess.run(
        [sys.executable, "-m", "orthon.launch.cli", "model-info", "-c", str(ROOT / "configs/tiny.yaml"), "model.hiden=3"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 2 and "model.hiden: unknown key" in proc.stderr


def test_base_recipe_merges_and_overrides(tmp_path):
    (tmp_path / "a.yaml").write_text("model:\n  hidden_size: 128\n  vocab_size: 500\ntrain:\n  seed: 3\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nmodel:\n  hidden_size: 256\n")
    recipe = load_recipe(tmp_path / "b.yaml", ["train.seed=4"])
    assert (recipe.model.hidden_size, recipe.model.vocab_size, recipe.train.seed) == (256, 500, 4)
    (tmp_path / "c.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_recipe(tmp_path / "c.yaml")


def test_a_pretraining_recipe_takes_its_token_ids_from_its_tokenizer(tmp_path):
    """The model's bos / eos / pad ids become data.tokenizer's (the eos its documents end in), said in one
    line; without a tokenizer the recipe is unchanged; train.init_from does not compare them."""
    import dataclasses

    from test_data_support import train_tiny_tokenizer

    from orthon.data.tokenizer import load_tokenizer
    from orthon.pretrain.recipe import Recipe, with_tokenizer_ids

    path = train_tiny_tokenizer(tmp_path)
    tok = load_tokenizer(path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)  # sentencepiece's layout here; the defaults are 0 / 1 / None
    recipe = Recipe()
    assert with_tokenizer_ids(recipe) is recipe
    recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, tokenizer=str(path)))
    lines = []
    model = with_tokenizer_ids(recipe, lines.append).model
    assert (model.bos_token_id, model.eos_token_id, model.pad_token_id) == (1, 2, 3)
    assert lines == [f"model: bos_token_id 0 -> 1, eos_token_id 1 -> 2, pad_token_id None -> 3 (the tokenizer's, {path})"]
    assert model.replace(bos_token_id=0, eos_token_id=1, pad_token_id=None) == recipe.model  # nothing else moved
    again = dataclasses.replace(recipe, model=model)
    assert with_tokenizer_ids(again, lines.append) is again and len(lines) == 1
