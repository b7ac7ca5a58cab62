"""`orthon smoke` trains the recipe's model through the one Trainer: the loss of a fixed random batch starts
near ln(vocab) (an untrained model is near uniform) and falls at every step as the model memorises it."""
import math
import re

from pretrain_support import ROOT, orthon


def test_smoke_memorises_a_fixed_batch():
    out = orthon("smoke", "-c", ROOT / "configs" / "tiny.yaml", "smoke.steps=4", "smoke.seq_len=32").stdout
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 4
    assert abs(losses[0] - math.log(4096)) < 0.3
    assert all(b < a - 0.1 for a, b in zip(losses, losses[1:]))


def test_smoke_runs_the_recipes_backend(tmp_path):
    """`backend=mindspore` runs the MindSpore trainer (it ran the torch one, silently)."""
    import pytest

    pytest.importorskip("mindspore", reason="MindSpore is not installed (extra: pip install 'orthon[mindspore]')")
    from pretrain_support import make_stores, write_recipe

    recipe = write_recipe(tmp_path / "r.yaml", make_stores(tmp_path / "data"), tmp_path / "run")
    out = orthon("smoke", "-c", recipe, "backend=mindspore", "smoke.steps=3", "smoke.seq_len=16").stdout
    assert "mindspore backend" in out
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 3 and abs(losses[0] - math.log(300)) < 0.3
    assert all(b < a - 0.05 for a, b in zip(losses, losses[1:]))
