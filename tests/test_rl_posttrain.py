"""The post-training plan: its checks, the GLM-5 numbers in configs/posttrain_glm5.yaml, and every stage
(SFT, RL, agentic RL with tools, OPD from two earlier stages) run end to end in miniature, then resumed."""
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from orthon.core.config import build
from orthon.core.errors import ConfigError
from orthon.pretrain import GLMForCausalLM, ModelConfig
from orthon.pretrain.weights import save_weights
from orthon.rl.posttrain import PosttrainPlan, load_plan, run_posttrain, stage_mapping
from orthon.rl.recipe import RLRecipe, source_tokenizer
from pretrain_support import MODEL

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def test_plan_checks_its_stages():
    with pytest.raises(ConfigError, match="not an earlier stage"):
        build(PosttrainPlan, {"stages": [{"name": "opd", "teachers": {"a": "rl"}}, {"name": "rl"}]})
    with pytest.raises(ConfigError, match="names must differ"):
        build(PosttrainPlan, {"stages": [{"name": "rl"}, {"name": "rl"}]})
    with pytest.raises(ConfigError, match="kind"):
        build(PosttrainPlan, {"stages": [{"name": "x", "kind": "dpo"}]})


def test_glm5_plan_holds_the_recipe_numbers(tmp_path):
    path = ROOT / "configs/posttrain_glm5.yaml"
    plan = load_plan(path)
    finals = {s.name: tmp_path / s.name for s in plan.stages}
    recipes = {s.name: build(RLRecipe, stage_mapping(plan, path, s, tmp_path, finals)) for s in plan.stages}
    for name in ("reasoning_rl", "agentic_rl", "general_rl"):
        rl = recipes[name].rl
        assert rl.buffer.num_repeat_per_sample == 32 and rl.loss.icepop_beta == 2.0
        assert (rl.loss.eps_low, rl.loss.eps_high, rl.loss.kl_coef) == (0.2, 0.28, 0.0)
    opd = recipes["opd"].rl
    assert (opd.opd.form, opd.opd.coef, opd.opd.group_size, opd.opd.batch_size) == ("sampled", 1.0, 1, 1024)
    assert opd.buffer.num_repeat_per_sample == 1 and opd.rollout == "orthon.rl.distill.opd_rollout"
    assert opd.rollout_args["teachers"] == {"reasoning": str(tmp_path / "reasoning_rl"), "general": str(tmp_path / "general_rl")}


def test_every_stage_runs_and_the_plan_resumes(tmp_path, chat_tokenizer):
    tok = chat_tokenizer
    source = tmp_path / "pre"
    torch.manual_seed(0)
    save_weights(GLMForCausalLM(ModelConfig(**{**MODEL, "vocab_size": tok.vocab_size})), source / "final")
    small = {"iterations": 1, "prompts_per_iteration": 2, "max_new_tokens": 4, "eval_samples": 1, "eval_interval": 0,
             "buffer": {"num_repeat_per_sample": 2}, "drop_zero_std_groups": False, "max_sampling_rounds": 1}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "train": {"progress": False, "micro_batch_size": 8, "checkpoint_interval": 50},
        "rl": {**small, "task_args": {"difficulty": 1, "eval_size": 2}}}))
    plan = {"recipe": "base.yaml", "run_dir": str(tmp_path / "post"), "stages": [
        {"name": "sft", "kind": "sft", "set": {"sft": {"examples": 8, "steps": 2, "batch_size": 4}}},
        {"name": "reasoning_rl"},
        {"name": "agentic_rl", "set": {"rl": {"task": "orthon.rl.tool_tasks.ToolArithmeticTask",
                                              "task_args": {"eval_size": 2}, "max_new_tokens": 8,
                                              "rollout": "orthon.rl.multi_turn.tool_rollout",
                                              "rollout_args": {"tools": {"calculator": "orthon.rl.tools.calculator"},
                                                               "max_turns": 2}}}},
        {"name": "general_rl"},
        {"name": "opd", "teachers": {"reasoning": "reasoning_rl", "general": "general_rl"},
         "set": {"rl": {"opd": {"batch_size": 2, "teachers": [
             {"name": "reasoning", "task": "orthon.rl.tasks.ArithmeticTask", "task_args": {"eval_size": 2}},
             {"name": "general", "task": "orthon.rl.tasks.ArithmeticTask", "task_args": {"difficulty": 1, "eval_size": 2}}]}}}},
    ]}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    loaded = load_plan(tmp_path / "plan.yaml")
    lines = []
    summary = run_posttrain(loaded, tmp_path / "plan.yaml", source, tok, log=lines.append)
    assert [s["name"] for s in summary["stages"]] == ["sft", "reasoning_rl", "agentic_rl", "general_rl", "opd"]
    # Each stage closes with one line of what it did.
    done = [line for line in lines if " done: " in line]
    assert [line.split()[1] for line in done] == [s["name"] for s in summary["stages"]]
    assert re.fullmatch(r"stage sft done: \d+ steps, loss \d\.\d{3} -> \d\.\d{3}; \d+ s", done[0])
    assert all(re.match(r"stage \w+ done: \d+ iterations; held-out mean reward \d\.\d{3} -> ", x) for x in done[1:])
    for stage in summary["stages"]:
        assert (tmp_path / "post" / stage["name"] / "final" / "config.json").is_file()
    evaluation = json.loads((tmp_path / "post" / "stages.json").read_text())["evaluation"]
    assert set(evaluation) == {"start", "sft", "reasoning_rl", "agentic_rl", "general_rl", "opd"}
    assert all(set(row) == {"reasoning_rl", "agentic_rl", "agentic_rl (no tools)", "general_rl", "opd"}
               for row in evaluation.values())
    # Each stage started from the previous one's weights: the OPD stage's student began as general RL's.
    opd_config = yaml.safe_load((tmp_path / "post" / "opd" / "config.yaml").read_text())
    assert opd_config["train"]["init_from"] == str(tmp_path / "post" / "general_rl" / "final")
    # Every stage records its tokenizer, so any stage can be the --from of `orthon rl` / `orthon distill`.
    for stage in summary["stages"]:
        assert source_tokenizer(tmp_path / "post" / stage["name"]) == str(tok.path)
    again = run_posttrain(loaded, tmp_path / "plan.yaml", source, tok, log=lambda *a: None)
    assert all(s.get("skipped") for s in again["stages"])


def test_the_reward_table_keeps_its_columns_apart():
    from orthon.launch.cmd_posttrain import reward_table

    table = reward_table({"start": {"agentic_rl (no tools)": 0.0, "opd": 0.6081}, "reasoning_rl": {"agentic_rl (no tools)": 0.5, "opd": 0.25}})
    lines = table.split("\n")
    assert lines == ["              agentic_rl (no tools)    opd",
                     "       start                  0.000  0.608",
                     "reasoning_rl                  0.500  0.250"]
