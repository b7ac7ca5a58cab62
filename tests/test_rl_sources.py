"""Any finished run can be the --from of an RL or distillation run: its tokenizer is found in its own
config, or through the run it started from."""
import pytest

from orthon.core.errors import CheckpointError, ConfigError
from orthon.rl.recipe import source_tokenizer


def test_tokenizer_from_the_config_or_through_source_txt(tmp_path):
    pre, rl, chained = tmp_path / "pre", tmp_path / "rl", tmp_path / "rl2"
    for d in (pre, rl, chained):
        d.mkdir()
    (pre / "config.yaml").write_text("data: {tokenizer: tok/words.model}\n")
    (rl / "config.yaml").write_text("rl: {iterations: 3}\n")  # an RL run written before runs recorded it
    (rl / "source.txt").write_text(f"{pre}\n")
    (chained / "config.yaml").write_text("rl: {iterations: 3}\n")
    (chained / "source.txt").write_text(f"{rl}\n")
    assert source_tokenizer(pre) == "tok/words.model"
    assert source_tokenizer(rl) == "tok/words.model"
    assert source_tokenizer(chained) == "tok/words.model"
    (rl / "config.yaml").write_text("rl: {iterations: 3}\ndata: {tokenizer: other.model}\n")
    assert source_tokenizer(chained) == "other.model"  # the nearest record wins


def test_missing_tokenizer_and_missing_run_are_named(tmp_path):
    (tmp_path / "config.yaml").write_text("rl: {iterations: 3}\n")
    with pytest.raises(ConfigError, match="names no tokenizer.*data.tokenizer=PATH"):
        source_tokenizer(tmp_path)
    with pytest.raises(CheckpointError, match="no config.yaml"):
        source_tokenizer(tmp_path / "nosuch")
