"""The ablation's arithmetic, hand-checked, and `orthon ablate` end to end on a small recipe."""
import json

import yaml

from orthon.optim.ablation import moving_average, steps_to_reach, summarize
from pretrain_support import make_stores, orthon, write_recipe


def test_moving_average_and_steps_to_reach():
    assert moving_average([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    steps, losses = [1, 2, 3, 4], [4.0, 2.0, 6.0, 0.0]
    assert steps_to_reach(steps, losses, 3.0, 2) == 2
    assert steps_to_reach(steps, losses, 2.9, 2) is None


def test_summarize_against_baseline():
    curves = {"adamw": ([1, 2, 3, 4], [5.0, 4.0, 3.0, 2.0]), "muon": ([1, 2, 3, 4], [4.0, 2.0, 1.0, 1.0])}
    rows = summarize(curves, {"adamw": 10.0, "muon": 12.0}, "adamw", 1)
    by = {r["variant"]: r for r in rows}
    assert by["adamw"]["steps_to_baseline_final"] == 4 and by["adamw"]["steps_ratio_vs_baseline"] == 1.0
    assert by["muon"]["steps_to_baseline_final"] == 2 and by["muon"]["steps_ratio_vs_baseline"] == 0.5
    assert by["muon"]["final_loss"] == 1.0


def test_orthon_ablate_runs_every_variant(tmp_path):
    stores = make_stores(tmp_path / "data")
    recipe = write_recipe(tmp_path / "r.yaml", stores, tmp_path / "unused", train={"max_steps": 6},
                          ablation={"out_dir": str(tmp_path / "ab"), "smooth": 2})
    out = orthon("ablate", "-c", recipe)
    rows = json.loads((tmp_path / "ab" / "summary.json").read_text())
    assert [r["variant"] for r in rows] == ["adamw", "muon", "muon_split"]
    for name in ("loss.png", "max_attn_logit.png", "table.md"):
        assert (tmp_path / "ab" / name).stat().st_size > 0
    assert "| muon_split |" in out.stdout
    # each variant ran with its own optimizer setting
    assert yaml.safe_load((tmp_path / "ab" / "adamw" / "config.yaml").read_text())["optim"]["algorithm"] == "adamw"
    assert yaml.safe_load((tmp_path / "ab" / "muon" / "config.yaml").read_text())["optim"]["muon_split"] is False
