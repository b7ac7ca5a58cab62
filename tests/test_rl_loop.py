"""`orthon rl` end to end on a small random policy: the loop runs, engine and trainer log-probs agree,
metrics / plot / checkpoints are written, and a resumed run continues where it stopped."""
import json
import math
import re

import pytest
import torch
import yaml

from orthon.pretrain import GLMForCausalLM, ModelConfig, RuntimeOptions
from orthon.pretrain.weights import save_weights
from plot_support import cycle_colour, pixels_of, read_png
from pretrain_support import MODEL, orthon
from test_data_support import train_tiny_tokenizer

# An iteration's figures that differ between runs of the same arithmetic: wall times, and what depends on
# them or on the process (FLOPs a second, peak memory).
TIMED = ("iteration_time_s", "wait_s", "train_s", "sync_s", "eval_s", "tflops_per_device", "memory_peak_gib")
# Prompt tokens an engine found in its prefix cache: the cache is the engine's, not the run's resumable
# state (a resumed run's engine starts empty, as SGLang's does), and each rank's engine holds its own.
CACHED = ("prompt_tokens_cached",)


def _pretrain_dir(tmp_path):
    run = tmp_path / "pre"
    tok = train_tiny_tokenizer(tmp_path / "tok", vocab_size=512)
    torch.manual_seed(0)
    model = GLMForCausalLM(ModelConfig(**{**MODEL, "vocab_size": 512, "index_topk": 8}),
                           runtime=RuntimeOptions(sparse_attention=True))
    save_weights(model, run / "final")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(tok)}}))
    return run


def _recipe(tmp_path, run_dir, iterations, logprobs="rescore", total_steps=0, name="rl.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({
        "train": {"run_dir": str(run_dir), "checkpoint_interval": 2, "progress": False, "micro_batch_size": 5},
        "schedule": {"peak_lr": 1e-3, "floor_lr": 1e-3, "warmup_steps": 2, "total_steps": total_steps},
        "rl": {"iterations": iterations, "prompts_per_iteration": 3, "max_new_tokens": 12,
               "engine": {"logprobs": logprobs}, "eval_interval": 2,
               "task_args": {"difficulty": 1, "eval_size": 6}, "buffer": {"num_repeat_per_sample": 4}},
    }))
    return path


def _records(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


SUMMARY = re.compile(r"done: (\d+) iterations; held-out mean reward (\S+) -> (\S+) \(best (\S+)\), "
                     r"greedy (\S+) -> (\S+);")


def _printed_summary(stdout, records):
    """The final line's numbers, and what the metrics file says they should be (3 decimals)."""
    evals = [r for r in records if "eval_reward" in r]
    want = (str(max(r["step"] for r in records)), *(f"{x:.3f}" for x in (
        evals[0]["eval_reward"], evals[-1]["eval_reward"], max(r["eval_reward"] for r in evals),
        evals[0]["eval_greedy"], evals[-1]["eval_greedy"])))
    return SUMMARY.search(stdout).groups(), want


def test_rl_loop_runs_and_resumes(tmp_path):
    pre, run = _pretrain_dir(tmp_path), tmp_path / "rl"
    out = orthon("rl", "-c", _recipe(tmp_path, run, 3), "--from", pre)
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    # What the run prints is what it logged: the first evaluation, and the summary over all of them.
    start = records[0]
    assert f"iteration 0: held-out reward {start['eval_reward']:.3f} (greedy {start['eval_greedy']:.3f})" in out.stdout
    got, want = _printed_summary(out.stdout, records)
    assert got == want and got[0] == "3"
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["lr"] for r in steps] == [5e-4, 1e-3, 1e-3]  # linear warmup over 2 iterations
    evals = [r for r in records if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 3] and all(0 <= r["eval_greedy"] <= 1 for r in evals)
    for r in steps:
        # Rescored: the trainer's own forward of the weights that sampled them, no mismatch.
        assert r["logp_mismatch_max"] == 0.0
        assert r["masked_fraction"] == 0.0
        assert r["buffer_consumed_groups"] == 3 * r["step"]
        assert r["policy_version"] == r["step"]
        # A freshly initialised policy over 512 tokens is near uniform: entropy just under ln 512.
        assert 0.95 * math.log(512) < r["entropy"] <= math.log(512)
        assert 0 < r["response_length"] <= 12  # max_new_tokens
    # The plot: 7 x 4.2 inches at 110 dpi, three curves (train reward, held-out sampled, held-out greedy)
    # in matplotlib's first three line colours.
    image = read_png(run / "reward.png")
    assert image.shape == (462, 770, 3)
    assert [pixels_of(image, cycle_colour(i)) > 20 for i in range(3)] == [True] * 3
    # The final weights are a whole policy of the source's architecture: every tensor, in its shape.
    from safetensors.torch import load_file

    final, source = (load_file(str(d / "final" / "model.safetensors")) for d in (run, pre))
    assert {k: v.shape for k, v in final.items()} == {k: v.shape for k, v in source.items()}

    out = orthon("rl", "-c", _recipe(tmp_path, run, 5), "--resume")
    assert "resumed RL at iteration 3" in out.stdout + out.stderr
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2, 3, 4, 5]
    # The resumed run kept the first part's records: its summary starts at the iteration-0 evaluation.
    assert records[0] == start
    got, want = _printed_summary(out.stdout, records)
    assert got == want and got[0] == "5"


def test_resumed_run_equals_uninterrupted(tmp_path):
    """Interrupted at iteration 2 and resumed, the run logs the same metrics and ends on the same weights
    as one that never stopped (same seeds; the schedule's length fixed, so both parts share it)."""
    from safetensors.torch import load_file

    pre = _pretrain_dir(tmp_path)
    whole, split = tmp_path / "whole", tmp_path / "split"
    orthon("rl", "-c", _recipe(tmp_path, whole, 4, total_steps=4, name="whole.yaml"), "--from", pre)
    orthon("rl", "-c", _recipe(tmp_path, split, 2, total_steps=4, name="split.yaml"), "--from", pre)
    orthon("rl", "-c", _recipe(tmp_path, split, 4, total_steps=4, name="split.yaml"), "--resume")
    drop = TIMED + CACHED
    a = [{k: v for k, v in r.items() if k not in drop} for r in _records(whole)]
    b = [{k: v for k, v in r.items() if k not in drop} for r in _records(split)]
    assert [r["step"] for r in b] == [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert b == a
    wa, wb = (load_file(str(run / "final" / "model.safetensors")) for run in (whole, split))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_default_decode_logprobs_match_the_trainer(tmp_path):
    """The engine's default log-probs (from the logits each token was sampled from, through the fused
    decode path) agree with the trainer's recompute on the same weights to float32 round-off."""
    pre, run = _pretrain_dir(tmp_path), tmp_path / "rl"
    orthon("rl", "-c", _recipe(tmp_path, run, 3, logprobs="decode"), "--from", pre)
    steps = [r for r in _records(run) if "reward_mean" in r]
    assert len(steps) == 3
    for r in steps:
        assert 0.0 < r["logp_mismatch_max"] < 1e-4  # not bit-equal (another code path), but round-off
        assert r["masked_fraction"] == 0.0


@pytest.mark.slow  # about 30 s: an older checkpoint layout, two runs
def test_a_checkpoint_from_before_the_rollout_manager_resumes(tmp_path):
    """The synchronous loop's checkpoints kept the task, buffer and reward counts at the top level of the
    trainer state; resumed from one, the run continues as if never stopped."""
    from orthon.core.files import sha256_file
    from orthon.pretrain.checkpoint import MANIFEST, TRAINER_STATE

    pre = _pretrain_dir(tmp_path)
    whole, split = tmp_path / "whole", tmp_path / "split"
    orthon("rl", "-c", _recipe(tmp_path, whole, 4, total_steps=4, name="whole.yaml"), "--from", pre)
    orthon("rl", "-c", _recipe(tmp_path, split, 2, total_steps=4, name="split.yaml"), "--from", pre)
    newest = sorted((split / "checkpoints").glob("step_*"))[-1]
    state = json.loads((newest / TRAINER_STATE).read_text())
    rollout = state.pop("rollout")
    assert rollout["queue"] == [] and rollout["drawn"] == rollout["task"]["issued"]  # what the old layout implies
    state.update(task=rollout["task"], buffer=rollout["buffer"], reward_stats=rollout["reward_stats"])
    (newest / TRAINER_STATE).write_text(json.dumps(state))
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["files"][TRAINER_STATE] = {"size": (newest / TRAINER_STATE).stat().st_size,
                                        "sha256": sha256_file(newest / TRAINER_STATE)}
    (newest / MANIFEST).write_text(json.dumps(manifest))

    out = orthon("rl", "-c", _recipe(tmp_path, split, 4, total_steps=4, name="split.yaml"), "--resume")
    assert "resumed RL at iteration 2" in out.stdout + out.stderr
    # That layout kept no rollout counters: the prompt tokens count again from the resume.
    drop = TIMED + CACHED + ("prompt_tokens",)
    a, b = ([{k: v for k, v in r.items() if k not in drop} for r in _records(run)] for run in (whole, split))
    assert b == a


def test_the_progress_bar_keeps_the_latest_held_out_reward():
    from orthon.rl.trainer import ProgressPostfix

    postfix = ProgressPostfix()
    assert postfix({"reward_mean": 0.123}) == {"reward": "0.12"}  # nothing evaluated yet
    assert postfix({"reward_mean": 0.5, "eval_reward": 0.3047}) == {"reward": "0.50", "held_out": "0.30"}
    assert postfix({"reward_mean": 0.25}) == {"reward": "0.25", "held_out": "0.30"}  # until the next evaluation


def test_the_cluster_driver_sees_the_latest_held_out_reward_between_evaluations():
    """The Ray driver polls the trainer actor and sees only some iterations: each poll carries the latest
    held-out reward, so the bar shows it although the polled iteration did not evaluate."""
    import collections
    from types import SimpleNamespace

    from orthon.rl.cluster import TrainerActor
    from orthon.rl.trainer import ProgressPostfix

    side = SimpleNamespace(messages=collections.deque(["iteration 0: held-out reward 0.261"]),
                           trainer=SimpleNamespace(iteration=7, last_stats={"reward_mean": 0.5}, held_out=0.261))
    iteration, stats, messages = TrainerActor.progress(side)
    assert (iteration, messages) == (7, ["iteration 0: held-out reward 0.261"])
    assert ProgressPostfix()(stats) == {"reward": "0.50", "held_out": "0.26"}
    side.trainer.last_stats = {"reward_mean": 0.5, "eval_reward": 0.4}  # an evaluating iteration's own figure wins
    assert TrainerActor.progress(side)[1]["eval_reward"] == 0.4 and side.messages == collections.deque()
