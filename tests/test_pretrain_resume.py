"""Kill the pretraining process with SIGKILL mid-run and resume: the same losses, bit for bit, and every
sample seen exactly once."""
import sys


from pretrain_support import kill_when, losses, make_stores, orthon, sample_ids, write_recipe

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

    out = orthon("pretrain", "--resume", run_dir)
    assert "resumed from" in out.stdout + out.stderr
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
    assert "resumed from" in log and "step_00000004" in log
