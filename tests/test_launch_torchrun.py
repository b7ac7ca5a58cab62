"""`orthon launch torchrun --nproc-per-node 2 --run -- pretrain ...` really trains with two gloo processes:
each step splits its batch between two ranks, the checkpoint has one shard a rank, and the losses are
those of one process taking the same global batch (as in test_pretrain_parallel)."""
import functools
import json

import pytest

import pretrain_support
from orthon.pretrain.checkpoint import verify
from pretrain_support import losses, make_stores, orthon

write_recipe = functools.partial(pretrain_support.write_recipe, optim={"ns_dtype": "fp32"})

STEPS = 4


@pytest.mark.parametrize("background", [pytest.param(False, id="foreground-saves"),
                                        pytest.param(True, id="background-saves", marks=pytest.mark.slow)])
def test_launched_torchrun_trains_on_two_processes(tmp_path, background):
    """With train.async_checkpoint the step-2 checkpoint is written by a thread on a gloo group of its own
    while the ranks train on (their gradient all-reduces on the default group)."""
    stores = make_stores(tmp_path / "data")
    launched, single = tmp_path / "launched", tmp_path / "single"
    train = {"max_steps": STEPS, "checkpoint_interval": 2, "eval_interval": STEPS}
    recipe = write_recipe(tmp_path / "two.yaml", stores, launched,
                          train={**train, "micro_batch_size": 2, "async_checkpoint": background})
    proc = orthon("launch", "torchrun", "--nproc-per-node", 2, "--run", "--", "pretrain", "-c", recipe)
    assert f"done: step {STEPS}" in proc.stdout
    records = [r for r in map(json.loads, (launched / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    # 2 ranks x 2 micro-batches each x 2 sequences x 32 tokens = the 256-token batch of every step
    assert [(r["batch_tokens"], r["micro_batches"]) for r in records] == [(256, 2)] * STEPS
    for step in (2, STEPS):
        verify(launched / "checkpoints" / f"step_{step:08d}")
        shards = sorted(p.name for p in (launched / "checkpoints" / f"step_{step:08d}").glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"]
    orthon("pretrain", "-c", write_recipe(tmp_path / "one.yaml", stores, single, train={**train, "micro_batch_size": 4}))
    reference = losses(single)
    for step, loss in losses(launched).items():
        assert loss == pytest.approx(reference[step], rel=2e-5, abs=2e-5), step
