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
