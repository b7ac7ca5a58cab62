"""Kill the pretraining process with SIGKILL mid-run and resume: the same losses, bit for bit, and every
sample seen exactly once."""
import json
import sys

import pytest

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
