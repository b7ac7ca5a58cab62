"""The retrieval recipe end to end on a tiny model (configs/retrieval_tiny.yaml's built-in corpus and word
tokenizer, a mid-training plan whose data section points at the long documents), and what the
long-context evaluation adds for it: the needle and haystack from the plan, dense / sparse evaluation of
one run, indexer recall on the passkey prompts, and the checkpoint timeline of the copy head."""
import json
from pathlib import Path

import pytest
import torch
import yaml

from test_data_support import run_cli
from orthon.core.errors import ConfigError
from orthon.data.tokenizer import load_tokenizer
from orthon.midtrain.config import LongEvalConfig, MidtrainPlan, StageConfig
from orthon.midtrain.eval import (Haystack, evaluate_run, evaluate_runs, indexer_recall_by_length,
                                  indexer_recall_on_documents, passkey_prompts)
from orthon.midtrain.indexer_fit import indexer_recall
from orthon.midtrain.stages import load_plan, stage_recipe
from orthon.midtrain.timeline import FORMED, checkpoint_point, formation_steps, run_timeline, write_timeline
from orthon.pretrain.checkpoint import Checkpointer
from orthon.pretrain.model import GLMForCausalLM
from orthon.pretrain.recipe import load_recipe
from orthon.pretrain.weights import load_weights

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")

TINY_MODEL = ["model.hidden_size=32", "model.num_attention_heads=2", "model.q_lora_rank=16", "model.kv_lora_rank=16",
              "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
              "model.intermediate_size=32", "model.moe_intermediate_size=16", "model.n_routed_experts=2",
              "model.num_experts_per_tok=1", "model.index_n_heads=2", "model.index_head_dim=8",
              "model.index_topk=16", "model.max_position_embeddings=256"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """configs/retrieval_tiny.yaml at a tiny size: 6 steps of 4 x 32 tokens, a checkpoint every 2."""
    tmp = tmp_path_factory.mktemp("retrieval")
    overrides = TINY_MODEL + [
        f"train.run_dir={tmp / 'pre'}", f"train.builtin_dir={tmp / 'builtin'}", "train.checkpoint_interval=2",
        "train.eval_interval=0", "train.progress=false", "train.micro_batch_size=4", "data.seq_len=32",
        "builtin.retrieval.docs=400", "builtin.retrieval.max_tokens=31", "builtin.retrieval.long_docs=40",
        "builtin.retrieval.long_max_tokens=127", "builtin.retrieval.filler_tokens=2000", "builtin.workers=1",
        "builtin.valid_fraction=0.1", "schedule.warmup_tokens=128", "schedule.total_tokens=768",
        "batch.start_batch_tokens=128", "batch.end_batch_tokens=128"]
    assert run_cli("pretrain", ["-c", str(ROOT / "configs/retrieval_tiny.yaml"), "--sample", "", *overrides]) == 0
    return tmp


def test_recipe_trains_on_the_retrieval_corpus(pretrained):
    recipe = load_recipe(pretrained / "pre" / "config.yaml")
    assert [(s.name, s.weight) for s in recipe.data.sources] == [("kv", 1.0), ("copy", 2.0), ("haystack", 1.0)]
    assert [s.name for s in recipe.data.valid] == ["kv", "copy", "haystack", "filler"]
    assert load_tokenizer(recipe.data.tokenizer).vocab_size == recipe.model.vocab_size == 103
    steps = [json.loads(line)["step"] for line in (pretrained / "pre" / "metrics.jsonl").open() if '"loss"' in line]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [p.name for p in Checkpointer(pretrained / "pre").step_dirs()] == ["step_00000002", "step_00000004",
                                                                               "step_00000006"]


def test_checkpoint_model_load_equals_final_weights(pretrained):
    recipe = load_recipe(pretrained / "pre" / "config.yaml")
    model = GLMForCausalLM(recipe.model)
    checkpointer = Checkpointer(pretrained / "pre")
    first, last = checkpointer.step_dirs()[0], checkpointer.step_dirs()[-1]
    state = checkpointer.load_model(last, model)
    assert (state["step"], state["tokens"]) == (6, 768)
    final = load_weights(pretrained / "pre" / "final").state_dict()
    assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items() if k in final)
    checkpointer.load_model(first, model)
    assert not torch.equal(model.lm_head.weight, final["lm_head.weight"])


def test_timeline_points_equal_the_checkpoints_models(pretrained, tmp_path):
    cfg = LongEvalConfig(lengths=[32], depths=[0.2, 0.8], trials=3, haystack="filler")
    result = run_timeline(pretrained / "pre", cfg, log=lambda *_: None)
    assert result["length"] == 32 and [p["step"] for p in result["points"]] == [2, 4, 6]
    # The last checkpoint is the final weights: its point is what checkpoint_point measures on them.
    recipe = load_recipe(pretrained / "pre" / "config.yaml")
    final = load_weights(pretrained / "pre" / "final").eval()
    expected = checkpoint_point(final, load_tokenizer(recipe.data.tokenizer),
                                Haystack.from_valid(recipe.data.valid, "filler"), cfg, 32)
    last = result["points"][-1]
    assert {k: pytest.approx(v, rel=1e-5) for k, v in expected.items()} == {k: last[k] for k in expected}
    # Six steps teach no copying: the repeat costs what the random half does (about ln 103).
    assert last["copy_repeat_nll"] > 3.5 and abs(last["copy_gain"]) < 0.5
    assert last["copy_gain"] == pytest.approx(last["copy_first_nll"] - last["copy_repeat_nll"])
    assert result["formed"] == {"copy_gain": None, "induction": None, "passkey": None}
    assert "passkey >= 0.9 from step None" in write_timeline(result, tmp_path)
    assert json.loads((tmp_path / "timeline.json").read_text())["points"][0]["step"] == 2
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_formation_steps_are_the_first_crossings():
    points = [{"step": s, "copy_gain": c, "induction": i, "passkey": p}
              for s, c, i, p in ((250, 0.1, 0.02, 0.0), (500, 0.99, 0.29, 0.0), (750, 1.0, 0.3, 0.4),
                                 (1000, 0.8, 0.8, 0.9), (1250, 3.0, 0.9, 1.0))]
    assert formation_steps(points) == {"copy_gain": 750, "induction": 750, "passkey": 1000}
    assert formation_steps(points[:2]) == {"copy_gain": None, "induction": None, "passkey": None}
    assert FORMED == {"copy_gain": (1.0, "above"), "induction": (0.3, "above"), "passkey": (0.9, "above")}


def test_passkey_prompts_place_the_configured_needle(pretrained):
    recipe = load_recipe(pretrained / "pre" / "config.yaml")
    tok = load_tokenizer(recipe.data.tokenizer)
    haystack = Haystack.from_valid(recipe.data.valid, "filler")
    cfg = LongEvalConfig(lengths=[64], trials=4, needle="\nGATE = {key}\n", question="\nGATE =")
    keys, needles, prompts = passkey_prompts(tok, haystack, cfg, 64, 0.5)
    assert (keys, prompts) == passkey_prompts(tok, haystack, cfg, 64, 0.5)[::2]  # the same for a seed
    question = tok.encode("\nGATE =")
    for key, needle, prompt in zip(keys, needles, prompts):
        assert needle == tok.encode(f"\nGATE = {key}\n") and len(needle) == 11
        at = round(0.5 * (64 - len(needle) - len(question)))
        assert len(prompt) == 64 and prompt[at : at + len(needle)] == needle and prompt[-len(question):] == question
        rest = prompt[:at] + prompt[at + len(needle) : -len(question)]
        assert set(tok.decode(rest)) <= set("abcdefghijklmnopqrstuvwxyz .\n")  # filler text around it


def test_haystack_by_name():
    from orthon.data.config import StoreSource

    with pytest.raises(ConfigError, match="no held-out store named 'filler'.*'code', 'recall'"):
        Haystack.from_valid([StoreSource("x", 1.0, "code"), StoreSource("y", 1.0, "recall")], "filler")


def test_long_eval_config_checks_needle_and_question():
    with pytest.raises(ConfigError, match="needle"):
        LongEvalConfig(needle="\nPASSKEY = \n")
    with pytest.raises(ConfigError, match="question"):
        LongEvalConfig(question="\nKEY =")
    with pytest.raises(ConfigError, match="attention"):
        LongEvalConfig(attention=["dense", "dense"])


def test_dense_and_sparse_evaluation_of_one_run(pretrained):
    cfg = LongEvalConfig(lengths=[32, 64], depths=[0.5], trials=2, ppl_length=64, ppl_buckets=2, ppl_samples=2,
                         haystack="filler", attention=["dense", "sparse"])
    results = evaluate_runs({"pre": str(pretrained / "pre")}, cfg, log=lambda *_: None)
    assert list(results) == ["pre (dense)", "pre (sparse)"]
    assert [r["sparse_attention"] for r in results.values()] == [False, True]
    # The saved run is dense: "saved" measures what "dense" does.
    saved = evaluate_run(pretrained / "pre", cfg, log=lambda *_: None)
    assert saved["passkey_answer_nll"] == results["pre (dense)"]["passkey_answer_nll"]
    # At 64 tokens the random indexers' top-16 keeps part of the attention: the sparse model differs.
    assert saved["passkey_answer_nll"][64] != results["pre (sparse)"]["passkey_answer_nll"][64]
    assert saved["passkey_answer_nll"][32] != results["pre (sparse)"]["passkey_answer_nll"][32]


def test_indexer_recall_by_length_is_the_query_weighted_recall(pretrained):
    recipe = load_recipe(pretrained / "pre" / "config.yaml")
    model = load_weights(pretrained / "pre" / "final").eval()
    tok = load_tokenizer(recipe.data.tokenizer)
    haystack = Haystack.from_valid(recipe.data.valid, "filler")
    cfg = LongEvalConfig(lengths=[16, 48], depths=[0.1, 0.9], trials=2)
    got = indexer_recall_by_length(model, tok, haystack, cfg)
    assert list(got) == [48]  # at 16 tokens the top-16 holds every key
    parts = [indexer_recall(model, torch.tensor(passkey_prompts(tok, haystack, cfg, 48, d)[2])) for d in (0.1, 0.9)]
    assert got[48]["queries"] == sum(p["queries"] for p in parts) == 2 * 2 * model.config.num_hidden_layers * (48 - 16)  # 2 depths, 2 prompts, every layer
    for key in ("recall", "oracle_recall"):
        assert got[48][key] == pytest.approx(sum(p[key] * p["queries"] for p in parts) / got[48]["queries"])
    assert 0 < got[48]["recall"] <= got[48]["oracle_recall"] + 1e-6


def test_indexer_recall_on_documents_is_recall_on_held_out_windows(pretrained):
    import random
    recipe = load_recipe(pretrained / "pre" / "config.yaml")
    model = load_weights(pretrained / "pre" / "final").eval()
    cfg = LongEvalConfig(lengths=[16, 48], recall_store="kv", recall_windows=3, seed=5)
    documents = Haystack.from_valid(recipe.data.valid, "kv")
    got = indexer_recall_on_documents(model, documents, cfg)
    assert list(got) == [48]
    rng = random.Random(5)
    want = indexer_recall(model, torch.tensor([documents.window(48, rng) for _ in range(3)]))
    assert got[48] == {k: want[k] for k in ("recall", "oracle_recall", "queries")}
    assert got[48]["queries"] == 3 * model.config.num_hidden_layers * (48 - 16)  # 3 windows, the queries past k keys
    # Through evaluate_run: reported when the run has the store, skipped (and said) when it has not.
    base = dict(lengths=[48], depths=[0.5], trials=1, ppl_length=48, ppl_buckets=1, ppl_samples=1, haystack="filler")
    said = []
    r = evaluate_run(pretrained / "pre", LongEvalConfig(**base, recall_store="kv", recall_windows=3, seed=5), said.append)
    assert r["indexer_recall_documents"][48]["queries"] == got[48]["queries"]
    r = evaluate_run(pretrained / "pre", LongEvalConfig(**base, recall_store="long"), said.append)
    assert "indexer_recall_documents" not in r and any("no held-out store 'long'" in line for line in said)


def test_plan_data_overrides_the_source_runs(pretrained, tmp_path):
    builtin = pretrained / "builtin" / "stores"
    data = {"sources": [{"path": str(builtin / "train_long"), "name": "long", "weight": 1.0}],
            "valid": [{"path": str(builtin / "valid_long"), "name": "long"},
                      {"path": str(builtin / "valid_filler"), "name": "filler"}]}
    plan = MidtrainPlan(stages=[StageConfig(name="s128", seq_len=128, tokens=512, rope_theta=40000.0)],
                        source=str(pretrained / "pre"), batch_tokens=256, data=data)
    recipe = stage_recipe(load_recipe(pretrained / "pre" / "config.yaml"), plan, 0, tmp_path / "stage")
    assert [s.name for s in recipe.data.sources] == ["long"] and [s.name for s in recipe.data.valid] == ["long", "filler"]
    assert recipe.data.seq_len == 128 and recipe.data.seed == 1234 + 1000
    assert recipe.data.tokenizer == load_recipe(pretrained / "pre" / "config.yaml").data.tokenizer  # kept
    with pytest.raises(ConfigError, match="data.seq_len: set by each stage"):
        MidtrainPlan(stages=plan.stages, data={"seq_len": 64})
    with pytest.raises(ConfigError, match="data.sources"):
        MidtrainPlan(stages=plan.stages, data={"sources": [{"path": "x", "weight": 0.0}]})


def test_midtrain_retrieval_plan_loads_and_fits_the_recipe():
    plan = load_plan(ROOT / "configs/midtrain_retrieval.yaml", ["source="])
    model = load_recipe(ROOT / "configs/retrieval_tiny.yaml").model
    pretrain_len = load_recipe(ROOT / "configs/retrieval_tiny.yaml").data.seq_len
    plan.check_against_model(model)
    assert plan.stages[0].seq_len == 4 * pretrain_len and plan.stages[0].rope_theta > model.rope_theta
    dsa = [s for s in plan.stages if s.dsa != "off"]
    assert dsa[0].dsa == "indexer_warmup" and dsa[0].indexer_only_steps > 0
    assert all(model.index_topk * 8 <= s.seq_len for s in dsa)  # top-k at most 1/8 of the length
    assert any(s.index_share for s in plan.stages)
    assert plan.eval.haystack == "filler" and pretrain_len in plan.eval.lengths and 4 * pretrain_len in plan.eval.lengths
    assert yaml.safe_load((ROOT / "configs/midtrain_retrieval.yaml").read_text())["data"]["sources"]
