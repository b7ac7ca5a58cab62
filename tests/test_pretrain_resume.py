"""Kill the pretraining process with SIGKILL mid-run and resume: the same losses, bit for bit, and every
sample seen exactly once."""
import json
import sys

import pytest

from orthon.pretrain.checkpoint import Checkpointer
from pretrain_support import kill_when, losses, make_stores, orthon, records_up_to, resumed_from, sample_ids, write_recipe

STEPS = 24


def test_sigkill_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    stores = make_stores(tmp_path / "data")
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    orthon("pretrain", "-c", write_recipe(tmp_path / "ref.yaml", stores, ref_dir, train={"max_steps": STEPS}))

    recipe = write_recipe(tmp_path / "run.yaml", stores, run_dir, train={"max_steps": STEPS})
    kill_when([sys.executable, "-m", "orthon.launch.cli", "pretrain", "-c", recipe],
              run_dir / "checkpoints" / "step_00000012")
    killed_at = max(losses(run_dir))
    assert 12 <= killed_at < STEPS
    before = (run_dir / "metrics.jsonl").read_text().splitlines()

    out = orthon("pretrain", "--resume", run_dir)
    # It resumed from a checkpoint the killed run saved (every 4 steps, from step 12 on), not from scratch:
    # the killed run's own records up to that step are kept, timings and all (a fresh start that happened
    # to reproduce the losses would have rewritten them).
    path, step = resumed_from(out.stdout + out.stderr)
    assert path == run_dir / "checkpoints" / f"step_{step:08d}" and step % 4 == 0 and 12 <= step <= killed_at
    kept = records_up_to(before, step)
    assert len(kept) >= step and (run_dir / "metrics.jsonl").read_text().splitlines()[: len(kept)] == kept
    ref, got = losses(ref_dir), losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref  # bit-identical: the same floats, not merely close

    seen = sample_ids(run_dir)
    assert len(seen) == len(set(seen)), "a sample was seen twice"
    assert seen == sample_ids(ref_dir), "the resumed run skipped or reordered samples"


def test_corrupted_checkpoint_falls_back_to_the_previous_good_one(tmp_path):
    stores = make_stores(tmp_path / "data")
    run_dir = tmp_path / "run"
    orthon("pretrain", "-c", write_recipe(tmp_path / "r.yaml", stores, run_dir, train={"max_steps": 8}))
    newest = run_dir / "checkpoints" / "step_00000008"
    victim = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # truncated
    out = orthon("pretrain", "--resume", run_dir, "train.max_steps=10")
    log = out.stdout + out.stderr
    assert "step_00000008 is unusable" in log and "truncated" in log
    assert resumed_from(log) == (run_dir / "checkpoints" / "step_00000004", 4)
    assert sorted(losses(run_dir)) == list(range(1, 11))  # steps 5..10 run again after the fallback


@pytest.mark.slow  # about 30 s: two 2-rank runs
def test_two_ranks_split_the_checks_and_agree_on_a_corrupt_checkpoint(tmp_path):
    """Resuming on two ranks, each checksums half the newest checkpoint's files; a flipped byte in a file
    of rank 1's half (same size: only a checksum finds it) makes both ranks fall back to the previous
    checkpoint together, and the run goes on from there as the uninterrupted one did."""
    stores = make_stores(tmp_path / "data")
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", stores, run_dir, train={"max_steps": 8, "micro_batch_size": 2},
                          optim={"ns_dtype": "fp32"})
    orthon("pretrain", "-c", recipe, nproc=2)
    reference = losses(run_dir)
    newest = run_dir / "checkpoints" / "step_00000008"
    files = sorted(json.loads((newest / "manifest.json").read_text())["files"])
    victim = newest / files[1]  # the second file: rank 1's share of two
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = orthon("pretrain", "--resume", run_dir, "train.max_steps=8", nproc=2)
    log = out.stdout + out.stderr
    assert f"step_00000008 is unusable, falling back: {newest}: file {files[1]} fails its checksum" in log, log[-3000:]
    assert resumed_from(log) == (run_dir / "checkpoints" / "step_00000004", 4)
    resumed = losses(run_dir)
    assert all(resumed[s] == pytest.approx(reference[s], rel=2e-5, abs=2e-5) for s in range(1, 9))


def _ids_by_step(run_dir):
    return {r["step"]: r["ids"] for r in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines())}


@pytest.mark.slow  # about 37 s: three runs of the CLI
def test_resume_from_an_earlier_step_and_past_some_data(tmp_path):
    """`--resume RUN --step N` goes back to step N's checkpoint (the later ones set aside, not deleted) and
    retraces the run exactly; `--skip-batches K` then moves the data past the next K batches, as one
    does to step over a loss spike tied to its data."""
    stores = make_stores(tmp_path / "data")
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", stores, run_dir, train={"max_steps": 8, "checkpoint_interval": 2},
                          batch={"start_batch_tokens": 256, "end_batch_tokens": 256})  # 8 sequences every step
    orthon("pretrain", "-c", recipe)
    original, original_ids = losses(run_dir), _ids_by_step(run_dir)
    ckpts = run_dir / "checkpoints"

    out = orthon("pretrain", "--resume", run_dir, "--step", "4")
    log = out.stdout + out.stderr
    assert resumed_from(log) == (ckpts / "step_00000004", 4)
    assert "the later checkpoints (step_00000006, step_00000008) moved to" in log
    assert sorted(p.name for p in (ckpts / "abandoned").iterdir()) == ["step_00000006", "step_00000008"]
    assert losses(run_dir) == original and _ids_by_step(run_dir) == original_ids  # retraced exactly
    assert [p.name for p in Checkpointer(run_dir).step_dirs()][-2:] == ["step_00000006", "step_00000008"]

    out = orthon("pretrain", "--resume", run_dir, "--step", "4", "--skip-batches", "2", "train.max_steps=6")
    log = out.stdout + out.stderr
    assert resumed_from(log)[1] == 4 and "skipped 2 batches (16 sequences, 512 tokens) of data after step 4" in log
    ids = _ids_by_step(run_dir)
    assert ids[5] == original_ids[7] and ids[6] == original_ids[8]  # steps 5 and 6's batches stepped over
    assert sorted(losses(run_dir)) == list(range(1, 7)) and losses(run_dir)[4] == original[4]
    assert sorted(p.name for p in (ckpts / "abandoned").iterdir()) == [
        "step_00000006", "step_00000006.1", "step_00000008", "step_00000008.1"]

    refused = orthon("pretrain", "--resume", run_dir, "--step", "5", check=False)
    assert refused.returncode == 2 and "no checkpoint of step 5 (it has steps 2, 4, 6)" in refused.stderr
    refused = orthon("pretrain", "-c", recipe, "--skip-batches", "2", check=False)
    assert refused.returncode == 2 and "--step and --skip-batches go with --resume RUN_DIR" in refused.stderr
