"""The ablation's arithmetic, hand-checked, and `orthon ablate` end to end on a small recipe."""
import json

import pytest
import yaml

from orthon.core.metrics import moving_average
from orthon.optim.ablation import format_table, steps_to_reach, summarize
from plot_support import cycle_colour, pixels_of, read_png
from pretrain_support import make_stores, orthon, write_recipe


def test_moving_average_and_steps_to_reach():
    assert moving_average([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    steps, losses = [1, 2, 3, 4], [4.0, 2.0, 6.0, 0.0]
    # smoothed: 4, 3, 4, 3; at 3.0 the dip at step 2 does not count, the curve climbs back above it
    assert steps_to_reach(steps, losses, 3.0, 2) == 4
    assert steps_to_reach(steps, losses, 4.0, 2) == 1
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
    ab = tmp_path / "ab"
    rows = json.loads((ab / "summary.json").read_text())
    variants = ["adamw", "muon", "muon_split"]
    assert [r["variant"] for r in rows] == variants
    # The summary's numbers are those of each variant's own metrics file: 6 steps each, the final loss the
    # mean of the last 2 (smooth=2), the steps to reach adamw's final loss as summarize finds them.
    curves = {}
    for name in variants:
        records = [r for r in map(json.loads, (ab / name / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        curves[name] = ([r["step"] for r in records], [r["loss"] for r in records])
        assert curves[name][0] == [1, 2, 3, 4, 5, 6]
    assert [r["final_loss"] for r in rows] == pytest.approx([(curves[n][1][-2] + curves[n][1][-1]) / 2 for n in variants],
                                                            abs=1e-4)
    assert rows == summarize(curves, {r["variant"]: r["wall_s"] for r in rows}, "adamw", 2)
    # The table (file and stdout) is the summary's rows.
    table = format_table(rows, "adamw")
    assert (ab / "table.md").read_text() == table + "\n" and table in out.stdout
    # Both plots: 7 x 4.2 inches at 110 dpi, with one curve (its line and markers) per variant in the
    # colours matplotlib gives a variant's line in order: a plot missing a variant's curve lacks its colour.
    for name in ("loss.png", "max_attn_logit.png"):
        image = read_png(ab / name)
        assert image.shape == (462, 770, 3), name
        assert [pixels_of(image, cycle_colour(i)) > 20 for i in range(3)] == [True] * 3, name
    # each variant ran with its own optimizer setting
    assert yaml.safe_load((tmp_path / "ab" / "adamw" / "config.yaml").read_text())["optim"]["algorithm"] == "adamw"
    assert yaml.safe_load((tmp_path / "ab" / "muon" / "config.yaml").read_text())["optim"]["muon_split"] is False

    # The same command again (as after Ctrl-C in the last variant: its marker gone) trains only what did not
    # finish; the others are reused with their wall times, and the retrained variant repeats its run.
    (ab / "muon_split" / "ablation_done.json").unlink()
    before = (ab / "muon_split" / "metrics.jsonl").read_text()
    again = orthon("ablate", "-c", recipe)
    assert "=== adamw: finished before" in again.stdout and "=== muon: finished before" in again.stdout
    assert "=== muon_split: optim.algorithm=muon" in again.stdout
    rerun = json.loads((ab / "summary.json").read_text())
    assert [r["wall_s"] for r in rerun[:2]] == [r["wall_s"] for r in rows[:2]]
    assert [r["loss"] for r in map(json.loads, (ab / "muon_split" / "metrics.jsonl").read_text().splitlines())
            if "loss" in r] == [r["loss"] for r in map(json.loads, before.splitlines()) if "loss" in r]
    # A variant whose recipe changed is trained again.
    changed = orthon("ablate", "-c", recipe, "train.max_steps=2")
    assert "finished before" not in changed.stdout
    assert [r["step"] for r in map(json.loads, (ab / "adamw" / "metrics.jsonl").read_text().splitlines())
            if "loss" in r] == [1, 2]
