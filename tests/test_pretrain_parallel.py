"""Data parallelism: 2-process gloo runs (torchrun) with DDP and FSDP2 match the 1-process run with the
same global batch; a checkpoint saved at world size 2 resumes at world size 1.

The batch-size ramp rounds to whole (micro-batch x ranks) increments, so the 2-process runs use half
the micro-batch: both world sizes then take the same global batch at every step. Newton-Schulz runs in
fp32 here: with bf16 a float round-off difference between reduction orders can flip one bf16 rounding,
and the runs drift apart by more than round-off."""
import functools
import json

import pytest
import torch

import pretrain_support
from orthon.pretrain.hf_io import load_hf_state
from pretrain_support import losses, make_stores, orthon, records_up_to, resumed_from

write_recipe = functools.partial(pretrain_support.write_recipe, optim={"ns_dtype": "fp32"})

STEPS = 6


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    stores = make_stores(tmp / "data")
    run = tmp / "run"
    orthon("pretrain", "-c", write_recipe(tmp / "r.yaml", stores, run, train={"max_steps": 2 * STEPS, **EVAL}))
    return stores, losses(run), run


# Five held-out samples: 3 for rank 0 (two micro-batches of 2), 2 for rank 1 (one), so under expert
# parallelism rank 1 runs a filler forward to join rank 0's second one.
EVAL = {"eval_samples": 5, "eval_interval": 5}


def metric(run, key: str) -> dict[int, float]:
    """{step: value} of one metric of a run's metrics.jsonl."""
    return {r["step"]: r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r}


def _close(a: dict, b: dict, steps):
    for step in steps:
        assert a[step] == pytest.approx(b[step], rel=2e-5, abs=2e-5), (step, a[step], b[step])


# Four cases (about 15-22 s each) run with -m slow: the 4-rank HSDP case below covers FSDP2 with expert and
# context parallelism together; DDP + expert parallelism (here and in mid-training's test) and the launcher's
# 2-rank run cover plain DDP, FSDP2 + context parallelism plain FSDP2.
@pytest.mark.parametrize("mode,experts,context", [pytest.param("ddp", 1, 1, marks=pytest.mark.slow),
                                                  pytest.param("fsdp", 1, 1, marks=pytest.mark.slow), ("ddp", 2, 1),
                                                  pytest.param("fsdp", 2, 1, marks=pytest.mark.slow),
                                                  ("fsdp", 1, 2), pytest.param("ddp", 2, 2, marks=pytest.mark.slow)],
                         ids=["ddp", "fsdp", "ddp-expert-parallel", "fsdp-expert-parallel", "fsdp-context-parallel",
                              "ddp-expert-and-context-parallel"])
def test_two_processes_match_one(mode, experts, context, single, tmp_path):
    """The FSDP2 run also writes its checkpoints in the background (FSDP2's shards staged, every third
    step, written while the ranks train on). Expert parallelism: each rank holds 2 of the 4 experts and
    the tokens travel to them and back; the losses (and the held-out one at step 5) and the final weights are the 1-process run's only if the exchange, the expert gradients' reduction, Muon on the
    experts where they lie and the MoE bias update are all right. Context parallelism: both ranks take
    the 1-process run's sequences (its micro-batch of 4), each half of every sequence's positions, the
    attention's keys gathered from both; with expert parallelism too, each rank's tokens (its positions)
    go to the experts' ranks."""
    stores, reference, reference_run = single
    run = tmp_path / mode
    recipe = write_recipe(tmp_path / "r.yaml", stores, run, train={"max_steps": STEPS, "parallel": mode,
                                                                     "micro_batch_size": 2 * context, "checkpoint_interval": 3,
                                                                     "async_checkpoint": mode == "fsdp",
                                                                     "expert_parallel": experts,
                                                                     "context_parallel": context, **EVAL},
                          # ... and under activation checkpointing, each layer's exchange runs again in backward
                          runtime={"activation_checkpointing": mode == "ddp" and experts > 1})
    out = orthon("pretrain", "-c", recipe, nproc=2)
    # FSDP2 builds the model on the meta device, shards it, then draws each shard's values: the losses
    # match the 1-process run's only if those are the values a direct build draws.
    assert ("model built sharded (FSDP2 over 2 ranks)" in out.stdout + out.stderr) == (mode == "fsdp")
    assert ("expert parallelism: 2 of the 4 experts" in out.stdout + out.stderr) == (experts == 2)
    assert ("each sequence of 32 tokens split over 2 ranks (16 positions each)" in out.stdout) == (context == 2)
    _close(losses(run), reference, range(1, STEPS + 1))
    _close(metric(run, "eval_loss"), metric(reference_run, "eval_loss"), [5])
    # Muon's update is blind to a gradient's scale: the gradient norms show the expert gradients' own.
    _close(metric(run, "grad_norm"), metric(reference_run, "grad_norm"), range(1, STEPS + 1))
    # The largest attention logit over every rank's queries (each rank sees its own sequences or positions).
    _close(metric(run, "max_attn_logit"), metric(reference_run, "max_attn_logit"), range(1, STEPS + 1))
    # The busiest expert-parallel rank's rows against the mean: between 1 and the busiest expert's ratio
    # (a rank's share sums its experts'), the latter as in one process.
    experts_load, ranks_load = metric(run, "moe_load_max_over_mean"), metric(run, "moe_rank_load_max_over_mean")
    _close(experts_load, metric(reference_run, "moe_load_max_over_mean"), range(1, STEPS + 1))
    assert sorted(ranks_load) == (list(range(1, STEPS + 1)) if experts > 1 else [])
    assert all(1 <= ranks_load[step] <= experts_load[step] + 1e-9 for step in ranks_load)
    # The last checkpoint (two ranks' files; FSDP2's shards of every tensor) exported on its own is the
    # final/ the run gathered.
    orthon("export", run, "--step", "latest", "--out", tmp_path / "exported")
    final, exported = (load_hf_state(d) for d in (run / "final", tmp_path / "exported"))
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)


# The DDP, plain FSDP2 and HSDP cases (about 17-23 s each) run with -m slow: HSDP with context parallelism on
# the same mesh covers FSDP2 over expert replicas, and the 2-rank DDP + expert parallelism cases (pretraining's
# and mid-training's) DDP's exchange.
@pytest.mark.parametrize("mode,shard_ranks,context", [pytest.param("ddp", 0, 1, marks=pytest.mark.slow),
                                                      pytest.param("fsdp", 0, 1, marks=pytest.mark.slow),
                                                      pytest.param("fsdp", 2, 1, marks=pytest.mark.slow), ("fsdp", 2, 2)],
                         ids=["ddp", "fsdp", "hsdp", "hsdp-context-parallel"])
def test_four_ranks_with_two_expert_replicas_match_one(mode, shard_ranks, context, single, tmp_path):
    """A 2 x 2 mesh: ranks 0-1 and 2-3 each hold all 4 experts between them (2 each), ranks 0 and 2 the
    same two: their gradients are summed over that column (DDP) or reduce-scattered over it (FSDP2, which
    then holds 1 of the 4 experts' shards a rank, built sharded). HSDP: the rest of the model sharded
    within ranks 0-1 and 2-3 and replicated across them (Muon's owners gather within a pair). Each rank
    takes 1 sequence of a micro-batch, so the global batch is the 1-process run's; with context
    parallelism ranks 0-1 and 2-3 each take 2 sequences, each rank half of their positions."""
    stores, reference, reference_run = single
    run = tmp_path / mode
    recipe = write_recipe(tmp_path / "r.yaml", stores, run, train={"max_steps": 4, "parallel": mode,
                                                                     "micro_batch_size": context, "context_parallel": context,
                                                                     "checkpoint_interval": 0, "expert_parallel": 2,
                                                                     "eval_interval": 4, "eval_samples": 5,
                                                                     "fsdp_shard_ranks": shard_ranks})
    out = orthon("pretrain", "-c", recipe, nproc=4)
    assert ("FSDP2 over 4 ranks, sharded within groups of 2" in out.stdout) == (shard_ranks == 2)
    shared = ", FSDP2-sharded among them)" if mode == "fsdp" else ")"
    assert f"expert parallelism: 2 of the 4 experts of each MoE layer on each rank (2 ranks hold the same ones{shared}" in out.stdout
    _close(losses(run), reference, range(1, 5))
    _close(metric(run, "grad_norm"), metric(reference_run, "grad_norm"), range(1, 5))


@pytest.mark.slow  # about 25 s: a 2-process run, then its resume on one
@pytest.mark.parametrize("experts", [1, 2], ids=["fsdp", "fsdp-expert-parallel"])
def test_saved_at_world_two_resumes_at_world_one(experts, single, tmp_path):
    """Expert parallelism: the checkpoint holds each expert stack whole (its two ranks' halves), which one
    process loads as plain tensors."""
    stores, reference, _ = single
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", stores, run, train={"max_steps": STEPS, "parallel": "fsdp",
                                                                     "micro_batch_size": 2, "expert_parallel": experts})
    orthon("pretrain", "-c", recipe, nproc=2)
    before = (run / "metrics.jsonl").read_text().splitlines()
    out = orthon("pretrain", "--resume", run, f"train.max_steps={2 * STEPS}", "train.micro_batch_size=4")
    # Resumed from the 2-process run's last checkpoint, whose records it keeps as written (a 1-process
    # start from scratch would also match the reference losses, but rewrite these lines).
    assert resumed_from(out.stdout + out.stderr) == (run / "checkpoints" / f"step_{STEPS:08d}", STEPS)
    assert (run / "metrics.jsonl").read_text().splitlines()[: len(before)] == records_up_to(before, STEPS) == before
    _close(losses(run), reference, range(1, 2 * STEPS + 1))


@pytest.mark.slow  # about 30 s: a source run, then a 1-process and a 2-process continuation
def test_continued_pretraining_on_sharded_ranks_matches_one_process(tmp_path):
    """train.init_from under FSDP2: each rank reads the source's tensors one at a time into its shards
    (no rank loads the whole model) and trains as one process started from the same weights does."""
    stores = make_stores(tmp_path / "data")
    source = tmp_path / "source"
    orthon("pretrain", "-c", write_recipe(tmp_path / "s.yaml", stores, source, train={"max_steps": 3}))
    runs = {}
    for nproc in (1, 2):
        runs[nproc] = tmp_path / f"run{nproc}"
        recipe = write_recipe(tmp_path / f"r{nproc}.yaml", stores, runs[nproc],
                              train={"max_steps": 3, "parallel": "fsdp", "micro_batch_size": 4 // nproc,
                                     "init_from": str(source)})
        out = orthon("pretrain", "-c", recipe, nproc=nproc)
        assert ("model built sharded" in out.stdout + out.stderr) == (nproc == 2)
    _close(losses(runs[2]), losses(runs[1]), range(1, 4))
    assert losses(runs[1])[1] < losses(source)[1] - 0.1  # it did start from the trained weights
