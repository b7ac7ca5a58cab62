"""The mid-training plan: the GLM-5 numbers (README, "The recipe"), LR segments by hand, step phases, and
plans whose stages do not fit together failing at load time with the offending field's path."""
from pathlib import Path

import pytest

from orthon.core.config import ConfigError, build, load
from orthon.midtrain.config import MidtrainPlan

ROOT = Path(__file__).resolve().parents[1]


def test_glm5_plan_holds_the_spec_numbers():
    plan = load(MidtrainPlan, ROOT / "configs" / "midtrain_glm5.yaml")
    stages = {s.name: s for s in plan.stages}
    assert [s.name for s in plan.stages] == ["32k", "dsa_adapt", "128k", "200k"]
    assert (stages["32k"].seq_len, stages["32k"].tokens, stages["32k"].rope_theta) == (32768, 10**12, 8e6)
    assert (stages["128k"].seq_len, stages["128k"].tokens, stages["128k"].index_share) == (131072, 5 * 10**11, True)
    assert (stages["200k"].tokens, stages["200k"].index_share) == (5 * 10**10, True)
    assert (stages["dsa_adapt"].tokens, stages["dsa_adapt"].indexer_only_steps) == (2 * 10**10, 1000)
    assert not stages["32k"].index_share and stages["32k"].dsa == "off"
    assert (plan.lr_start, plan.lr_end) == (4e-5, 1e-5)
    # One linear decay across the three stages (1T + 500B + 50B); the DSA adaptation holds it.
    segments = [plan.lr_segment(i) for i in range(4)]
    after_32k = 4e-5 - 3e-5 * 1000 / 1550
    after_128k = 4e-5 - 3e-5 * 1500 / 1550
    assert segments[0] == pytest.approx((4e-5, after_32k))
    assert segments[1] == pytest.approx((after_32k, after_32k))
    assert segments[2] == pytest.approx((after_32k, after_128k))
    assert segments[3][0] == pytest.approx(after_128k) and segments[3][1] == 1e-5
    assert [plan.rope_theta(i, 10000.0) for i in range(4)] == [8e6] * 4
    from orthon.pretrain.recipe import load_recipe

    plan.check_against_model(load_recipe(ROOT / "configs" / "glm5.yaml").model)


def test_tiny_plan_fits_the_tiny_model():
    from orthon.pretrain.recipe import load_recipe

    plan = load(MidtrainPlan, ROOT / "configs" / "midtrain_tiny.yaml")
    model = load_recipe(ROOT / "configs" / "tiny.yaml").model
    plan.check_against_model(model)
    assert plan.stages[0].rope_theta > model.rope_theta
    assert any(s.dsa == "indexer_warmup" for s in plan.stages) and any(s.index_share for s in plan.stages)
    assert max(s.seq_len for s in plan.stages) >= 4 * load_recipe(ROOT / "configs" / "tiny.yaml").data.seq_len


def test_step_phases():
    plan = build(MidtrainPlan, {"stages": [
        {"name": "a", "seq_len": 8, "tokens": 64},
        {"name": "b", "seq_len": 8, "tokens": 64, "dsa": "indexer_warmup", "indexer_only_steps": 3},
        {"name": "c", "seq_len": 8, "tokens": 64, "dsa": "sparse"}], "batch_tokens": 8})
    a, b, c = plan.stages
    assert [a.step_phase(i) for i in range(3)] == ["dense"] * 3
    assert [b.step_phase(i) for i in range(5)] == ["indexer_only"] * 3 + ["sparse"] * 2
    assert c.step_phase(0) == "sparse"


BASE = [{"name": "a", "seq_len": 16, "tokens": 64},
        {"name": "b", "seq_len": 32, "tokens": 64, "dsa": "indexer_warmup", "indexer_only_steps": 1},
        {"name": "c", "seq_len": 32, "tokens": 64, "dsa": "sparse", "index_share": True}]


@pytest.mark.parametrize("change, message", [
    (lambda s: s[1].update(seq_len=8), r"stages\[1\]\.seq_len: 8 is shorter than the previous stage's 16"),
    (lambda s: s[0].update(tokens=0), r"stages\[0\]\.tokens: the stage's token budget must be positive"),
    (lambda s: s[1].update(index_share=True), r"stages\[1\]\.index_share: IndexShare before DSA exists"),
    (lambda s: s[0].update(dsa="sparse"), r"stages\[0\]\.dsa: 'sparse' before any DSA adaptation"),
    (lambda s: s.append({"name": "d", "seq_len": 32, "tokens": 8, "dsa": "sparse"}),
     r"stages\[3\]\.index_share: turned off after stage 'c'"),
    (lambda s: s[2].update(name="a"), r"stages\[2\]\.name: 'a' names two stages"),
    (lambda s: s[0].update(indexer_only_steps=5), r"stages\[0\]\.indexer_only_steps: only a dsa 'indexer_warmup'"),
    (lambda s: s[1].update(indexer_only_steps=0), r"stages\[1\]\.indexer_only_steps: .* at least one"),
    (lambda s: s[2].update(dsa="off"), r"stages\[2\]\.index_share: IndexShare on a dense"),
    (lambda s: s[0].update(rope_theta=-1), r"stages\[0\]\.rope_theta: must be positive"),
])
def test_plans_that_do_not_fit_fail_with_the_path(change, message):
    stages = [dict(s) for s in BASE]
    change(stages)
    with pytest.raises(ConfigError, match=message):
        build(MidtrainPlan, {"stages": stages, "batch_tokens": 64})


def test_plan_level_errors():
    with pytest.raises(ConfigError, match="stages: the plan has no stages"):
        build(MidtrainPlan, {})
    with pytest.raises(ConfigError, match="lr_end: need 0 <= lr_end <= lr_start"):
        build(MidtrainPlan, {"stages": BASE, "lr_start": 1e-5, "lr_end": 4e-5, "batch_tokens": 64})
    with pytest.raises(ConfigError, match=r"stages\[1\]\.batch_tokens: 16 tokens per step hold no 32-token"):
        build(MidtrainPlan, {"stages": BASE, "batch_tokens": 16})
    with pytest.raises(ConfigError, match="index_share_pattern"):
        build(MidtrainPlan, {"stages": BASE, "batch_tokens": 64, "index_share_pattern": ["shared", "full"]})
    with pytest.raises(ConfigError, match=r"stages\[0\]\.bogus: unknown key"):
        build(MidtrainPlan, {"stages": [{"name": "a", "seq_len": 4, "tokens": 4, "bogus": 1}]})
