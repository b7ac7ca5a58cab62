"""The stage runner end to end on a small pretraining run, through the CLI: RoPE base change, phase 1
touching only the indexers, IndexShare, the LR segments, optimizer state carried across stages, bad
plans failing before training, and SIGKILL + resume inside a stage reproducing the uninterrupted run."""
import json
import re
import subprocess
import sys

import pytest
import torch
import yaml

from pretrain_support import (ROOT, env, kill_when, make_stores, orthon, records_up_to, resumed_from, sample_ids,
                              write_recipe)

# `orthon midtrain`, whether or not launch/cli.py lists it yet.
CLI = ("import sys; from orthon.launch import cli; "
       "cli.COMMANDS.setdefault('midtrain', ('orthon.launch.cmd_midtrain', 'mid-training')); "
       "sys.exit(cli.main(sys.argv[1:]))")
STAGES = ["00_long", "01_dsa", "02_share"]


def midtrain_cmd(*args):
    return [sys.executable, "-c", CLI, "midtrain", *map(str, args)]


def midtrain(*args, check=True):
    proc = subprocess.run(midtrain_cmd(*args), capture_output=True, text=True, env=env(), cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"midtrain {args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def plan(run_dir, **changes):
    stages = [
        {"name": "long", "seq_len": 64, "tokens": 512, "rope_theta": 100000.0},
        {"name": "dsa", "seq_len": 64, "tokens": 1024, "dsa": "indexer_warmup", "indexer_only_steps": 2,
         "indexer_lr": 0.01, "lr_mode": "hold", "attention_scale": 2.0},
        {"name": "share", "seq_len": 128, "tokens": 512, "dsa": "sparse", "index_share": True},
    ]
    p = {"run_dir": str(run_dir), "lr_start": 0.004, "lr_end": 0.001, "batch_tokens": 256,
         "train": {"micro_batch_size": 2, "checkpoint_interval": 2, "keep_last": 10, "progress": False,
                   "log_sample_ids": True, "loss_chunk": 48},
         "runtime": {"query_chunk": 24}, "stages": stages}
    p["train"].update(changes.pop("train", {}))
    p.update(changes)
    return p


def write_plan(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("midtrain_src")
    stores = make_stores(tmp / "data")
    orthon("pretrain", "-c", write_recipe(tmp / "pre.yaml", stores, tmp / "pre", train={"max_steps": 6}))
    return tmp / "pre"


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("midtrain_ref")
    out = midtrain("-c", write_plan(tmp / "plan.yaml", plan(tmp / "mid")), "--from", source, "--no-eval")
    return tmp / "mid", out.stdout + out.stderr


def _metrics(run, stage):
    return [json.loads(l) for l in (run / "stages" / stage / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]


def _load_ckpt(run, stage, step):
    """(model, optimizer) of a stage's checkpoint, as the runner rebuilds them."""
    from orthon.pretrain.recipe import load_recipe
    from orthon.midtrain.optimizer import StageOptimizer
    from orthon.pretrain.checkpoint import Checkpointer
    from orthon.pretrain.model import GLMForCausalLM

    directory = run / "stages" / stage
    recipe = load_recipe(directory / "config.yaml")
    model = GLMForCausalLM(recipe.model)
    optimizer = StageOptimizer(model, recipe.optim, recipe.schedule)
    Checkpointer(directory).load(directory / "checkpoints" / f"step_{step:08d}", model, optimizer.optimizers)
    return model, optimizer


def test_stages_run_with_their_settings(reference):
    run, log = reference
    assert "continuing" in log
    # Pretraining never trains the indexers: their state is the only one the first stage starts without.
    import re

    carried = re.search(r"carried optimizer state for (\d+) of (\d+) parameters; fresh state for (\d+) without "
                        r"state there \(e\.g\. (\S+)\)", log)
    assert carried and int(carried[1]) + int(carried[3]) == int(carried[2]) and ".indexer." in carried[4]
    assert log.count("attention logits scaled by 2 (q_b_proj)") == 1  # the DSA stage's hand-over only
    from orthon.pretrain.recipe import load_recipe

    recipes = [load_recipe(run / "stages" / s / "config.yaml") for s in STAGES]
    assert [r.data.seq_len for r in recipes] == [64, 64, 128]
    assert [r.model.rope_theta for r in recipes] == [100000.0] * 3  # raised at the first stage, kept after
    assert [r.model.indexer_types for r in recipes] == [None, None, ["full", "shared"]]
    for s in STAGES:
        assert (run / "stages" / s / "stage_done.json").is_file() and (run / "stages" / s / "final" / "model.safetensors").is_file()
    phases = [[r["phase"] for r in _metrics(run, s)] for s in STAGES]
    assert phases == [["dense"] * 2, ["indexer_only"] * 2 + ["sparse"] * 2, ["sparse"] * 2]
    # One linear decay 0.004 -> 0.001 over the decay stages (512 + 512 tokens); the DSA stage holds.
    lrs = [[r["lr"] for r in _metrics(run, s)] for s in STAGES]
    assert lrs[0] == pytest.approx([0.004, 0.004 - 0.003 * 256 / 1024])
    assert lrs[1] == pytest.approx([0.0025] * 4)
    assert lrs[2] == pytest.approx([0.0025, 0.0025 - 0.003 * 256 / 1024])
    dsa = _metrics(run, "01_dsa")
    assert [r["indexer_lr"] for r in dsa] == pytest.approx([0.01, 0.01, 0.0025, 0.0025])
    assert all(0 < r["indexer_recall"] <= r["oracle_recall"] + 1e-6 for r in dsa[:2])
    # Mid-training continues the pretrained model: its first loss is far below a random model's ln(300).
    assert _metrics(run, "00_long")[0]["loss"] < 0.8 * torch.log(torch.tensor(300.0)).item()


def test_phase1_moves_only_the_indexers_and_keeps_main_optimizer_state(reference):
    run, _ = reference
    before, opt_before = _load_ckpt(run, "00_long", 2)  # the first stage's last checkpoint
    after, opt_after = _load_ckpt(run, "01_dsa", 2)  # after the two indexer-only steps
    moved = []
    for (name, p), q in zip(before.named_parameters(), after.parameters()):
        if ".indexer." in name:
            moved.append(not torch.equal(p, q))
        elif name.endswith("q_b_proj.weight"):  # the stage's attention_scale 2, applied at its start
            assert torch.equal(2 * p, q), name
        else:
            assert torch.equal(p, q), f"{name} changed during the indexer-only steps"
    assert moved and all(moved)
    names_a = {id(p): n for n, p in before.named_parameters()}
    names_b = {n: p for n, p in after.named_parameters()}
    for opt_a, opt_b in zip(opt_before.main.optimizers, opt_after.main.optimizers):
        assert len(opt_a.state) == len(opt_b.state) > 0
        for p, state in opt_a.state.items():
            other = opt_b.state[names_b[names_a[id(p)]]]
            for key, value in state.items():
                assert torch.equal(value, other[key]), (names_a[id(p)], key)


def test_indexshare_stage_drops_shared_indexers(reference):
    run, _ = reference
    model, _ = _load_ckpt(run, "02_share", 2)
    kinds = [layer.self_attn.indexer is not None for layer in model.model.layers]
    assert kinds == [True, False]
    assert model.runtime.sparse_attention and model.config.indexer_types == ["full", "shared"]


def test_finished_plan_reruns_nothing(reference, source):
    run, _ = reference
    stages = run / "stages"
    stamps = {p: p.stat().st_mtime_ns for p in stages.rglob("*") if p.is_file()}
    out = midtrain("--resume", run, "--no-eval")
    # No stage started, no file under stages/ was written again (a deterministic rerun would rewrite
    # the metrics with the same bytes, so compare modification times), and none was added.
    assert re.search(r"stage \d+ '\w+': seq_len", out.stdout) is None, out.stdout
    assert {p: p.stat().st_mtime_ns for p in stages.rglob("*") if p.is_file()} == stamps
    # The rerun prints each stage's recorded summary: the steps and tokens the plan gives (512, 1024 and
    # 512 tokens at 256 a step), and the last training loss and held-out loss of the stage's metrics file.
    for stage, name, steps, tokens in zip(STAGES, ["long", "dsa", "share"], [2, 4, 2], [512, 1024, 512]):
        records = [json.loads(line) for line in (stages / stage / "metrics.jsonl").read_text().splitlines()]
        loss = [r["loss"] for r in records if "loss" in r][-1]
        held_out = [r["final_eval_loss"] for r in records if "final_eval_loss" in r][-1]
        assert (f"stage {name}: {steps} steps, {tokens:,} tokens, train loss {loss:.4f}, "
                f"held-out loss {held_out:.4f}") in out.stdout, out.stdout


def test_bad_plans_fail_before_training(source, tmp_path, monkeypatch):
    from orthon.core.errors import ConfigError
    from orthon.midtrain.stages import load_plan, prepare

    bad = {
        "seq_len": ("length goes down", lambda p: p["stages"][2].update(seq_len=32), "stages[2].seq_len"),
        "budget": ("zero budget", lambda p: p["stages"][0].update(tokens=0), "stages[0].tokens"),
        "share": ("IndexShare before DSA", lambda p: p["stages"][0].update(index_share=True), "stages[0].index_share"),
        "sparse": ("sparse before DSA", lambda p: p["stages"][0].update(dsa="sparse"), "stages[0].dsa"),
        "too_long": ("beyond the model's positions", lambda p: p["stages"][2].update(seq_len=512, batch_tokens=512),
                     "stages[2].seq_len"),
        "train_key": ("not a TrainConfig key", lambda p: p["train"].update(micro_batch=3), "train.micro_batch"),
        "stage_key": ("a key each stage sets", lambda p: p["train"].update(run_dir="x"), "train.run_dir"),
        "runtime": ("a bad runtime value", lambda p: p["runtime"].update(sparse_impl="fast"), "runtime.sparse_impl"),
    }
    for key, (why, change, path) in bad.items():
        data = plan(tmp_path / key, source=str(source))
        change(data)
        with pytest.raises(ConfigError, match=path.replace("[", r"\[").replace("]", r"\]")):
            prepare(load_plan(write_plan(tmp_path / f"{key}.yaml", data)))
    # A later stage's context-parallel degree that the world (4 ranks here) cannot take: refused at the
    # start, not when that stage begins.
    data = plan(tmp_path / "context", source=str(source))
    data["stages"][2]["context_parallel"] = 3
    with monkeypatch.context() as patch:
        patch.setenv("WORLD_SIZE", "4")
        with pytest.raises(ConfigError, match=r"stages\[2\] \(share\): train.context_parallel = 3 does not divide the 4"):
            prepare(load_plan(write_plan(tmp_path / "context.yaml", data)))
        data["stages"][2]["context_parallel"] = 4  # 128 tokens in 8 chunks: fits
        prepare(load_plan(write_plan(tmp_path / "context.yaml", data)))
    # Through the CLI: exit status 2, the message, and nothing written.
    data = plan(tmp_path / "cli")
    data["stages"][2]["seq_len"] = 32
    out = midtrain("-c", write_plan(tmp_path / "cli.yaml", data), "--from", source, check=False)
    assert out.returncode == 2 and "config error: stages[2].seq_len: 32 is shorter than" in out.stderr, out.stderr
    assert not (tmp_path / "cli").exists()


def test_a_source_without_checkpoints_is_refused_in_one_line(source, tmp_path):
    """A run directory holding only final/ (weights, no optimizer state) cannot be continued: the CLI says
    so in one line (exit status 2), not with a traceback."""
    import shutil

    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    shutil.copy(source / "config.yaml", weights_only / "config.yaml")
    shutil.copytree(source / "final", weights_only / "final")
    out = midtrain("-c", write_plan(tmp_path / "plan.yaml", plan(tmp_path / "mid")), "--from", weights_only,
                   check=False)
    assert out.returncode == 2, out.stderr
    assert f"{weights_only}: no checkpoint to continue from" in out.stderr and "Traceback" not in out.stderr


def test_sigkill_inside_a_stage_and_resume_reproduces_the_run(reference, source, tmp_path):
    ref, _ = reference
    run = tmp_path / "mid"
    kill_when(midtrain_cmd("-c", write_plan(tmp_path / "plan.yaml", plan(run)), "--from", source, "--no-eval"),
              run / "stages" / "01_dsa" / "checkpoints" / "step_00000002")  # end of phase 1
    assert not (run / "stages" / "02_share").exists() or not (run / "stages" / "02_share" / "stage_done.json").exists()
    before = {s: (run / "stages" / s / "metrics.jsonl").read_text().splitlines() for s in STAGES
              if (run / "stages" / s / "metrics.jsonl").is_file()}

    out = midtrain("--resume", run, "--no-eval")
    # Resumed inside the killed stage from one of its checkpoints, not started again: its records up to
    # that step are the killed run's own lines, timings and all (a rerun would rewrite them).
    path, step = resumed_from(out.stdout + out.stderr)
    stage = path.parent.parent.name
    assert path == run / "stages" / stage / "checkpoints" / f"step_{step:08d}" and stage in before
    kept = records_up_to(before[stage], step)
    assert len(kept) >= step and (run / "stages" / stage / "metrics.jsonl").read_text().splitlines()[: len(kept)] == kept
    for stage in STAGES:
        got, want = _metrics(run, stage), _metrics(ref, stage)
        assert [r["step"] for r in got] == [r["step"] for r in want]
        for a, b in zip(got, want):  # bit-identical: the same floats, not merely close
            assert {k: a[k] for k in ("loss", "lr", "grad_norm", "indexer_kl") if k in a} == \
                   {k: b[k] for k in ("loss", "lr", "grad_norm", "indexer_kl") if k in b}, stage
        seen = sample_ids(run / "stages" / stage)
        assert seen == sample_ids(ref / "stages" / stage) and len(seen) == len(set(seen)), stage


def test_a_continued_pretraining_run_is_a_valid_source(source, tmp_path):
    """A source run that itself started from another run (train.init_from): its stages start from the
    source's weights, not from the source's own origin."""
    from orthon.core.config import build
    from orthon.pretrain.recipe import load_recipe
    from orthon.midtrain.config import MidtrainPlan
    from orthon.midtrain.stages import stage_recipe

    continued = load_recipe(source / "config.yaml", [f"train.init_from={source}"])
    recipe = stage_recipe(continued, build(MidtrainPlan, plan(tmp_path / "mid"), ""), 0, tmp_path / "mid" / "s0")
    assert recipe.train.init_from == ""
    assert recipe.model.rope_theta == 100000.0


def test_resume_continues_the_run_it_names_even_when_moved(reference, tmp_path):
    """--resume RUN works on RUN, not on the run_dir its plan.yaml recorded (a copied or moved run, or a
    relative run_dir seen from another directory, must not continue the original)."""
    import shutil

    ref, _ = reference
    copy = tmp_path / "moved"
    shutil.copytree(ref, copy)
    last = copy / "stages" / STAGES[-1]
    (last / "stage_done.json").unlink()
    shutil.rmtree(last / "final")
    stamps = {p: p.stat().st_mtime_ns for p in ref.rglob("*") if p.is_file()}
    midtrain("--resume", copy, "--no-eval")
    assert (last / "stage_done.json").is_file() and (last / "final").is_dir()
    # Resumed at the stage's end, no step ran: the summary reports the last logged step's loss, not nothing.
    logged = [r["loss"] for r in _metrics(copy, STAGES[-1]) if "loss" in r]
    assert json.loads((last / "stage_done.json").read_text())["loss"] == logged[-1]
    assert {p: p.stat().st_mtime_ns for p in ref.rglob("*") if p.is_file()} == stamps  # the original untouched


def test_attention_scale_multiplies_the_logits_and_leaves_the_indexer_alone():
    from orthon.midtrain.heads import attention_rows
    from orthon.midtrain.stages import scale_attention_logits
    from orthon.pretrain import GLMForCausalLM, ModelConfig
    from orthon.pretrain.attention import index_scores
    from orthon.pretrain.layers import rope_cos_sin
    from pretrain_support import MODEL

    torch.manual_seed(0)
    model = GLMForCausalLM(ModelConfig(**MODEL))
    attn = model.model.layers[1].self_attn
    x = torch.randn(2, 40, MODEL["hidden_size"])
    cos, sin = rope_cos_sin(torch.arange(40), MODEL["qk_rope_head_dim"], model.config.rope_theta, x.dtype)

    def probs_and_index():
        q_resid = attn.project(x, cos, sin)[0]
        q_idx, w_idx = attn.indexer.queries(x, q_resid, cos, sin)
        scores = index_scores(q_idx, w_idx, attn.indexer.keys(x, cos, sin), attn.indexer.scale)
        return next(attention_rows(attn, x, cos, sin))[1], scores

    before, index_before = probs_and_index()
    scale_attention_logits(model, 1.5)
    after, index_after = probs_and_index()
    # softmax(1.5 * logits) row by row: log-probabilities are logits less a per-row constant.
    want = torch.softmax(1.5 * before.log(), dim=-1)
    assert torch.allclose(after, want, atol=1e-6) and not torch.allclose(after, before, atol=1e-3)
    assert torch.equal(index_after, index_before)
    with pytest.raises(Exception, match="attention_scale: must be positive"):
        from orthon.midtrain.config import StageConfig
        StageConfig(name="s", seq_len=8, tokens=8, attention_scale=0.0)
