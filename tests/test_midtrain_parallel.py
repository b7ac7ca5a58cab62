"""Mid-training on 2 gloo processes equals 1 process: data-parallel under DDP with expert parallelism (each
rank its sequences and half of every MoE layer's experts), and context-parallel under FSDP2 (each rank half
of every sequence's positions, and half of every parameter); with -m slow, 4 ranks as HSDP pairs with
expert and context parallelism: the stages' losses, indexer KL and recall agree, and the final weights
match."""
import json

import pytest
import torch
from safetensors.torch import load_file

from pretrain_support import make_stores, orthon, write_recipe
from test_midtrain_stages import STAGES, plan, write_plan


def _records(run, stage, key):
    lines = (run / "stages" / stage / "metrics.jsonl").read_text().splitlines()
    return [json.loads(l)[key] for l in lines if f'"{key}"' in l]


def _match_one(tmp_path, layouts: dict) -> dict:
    """Mid-training from the same source on 1 process and on each layout {name: (ranks, train overrides)};
    every layout's records and every stage's final weights equal the one process's. Returns the layouts'
    outputs."""
    stores = make_stores(tmp_path / "data")
    # fp32 Newton-Schulz: in bf16, the ranks' different summation order flips single roundings.
    source = tmp_path / "pre"
    orthon("pretrain", "-c", write_recipe(tmp_path / "pre.yaml", stores, source, train={"max_steps": 6},
                                          optim={"algorithm": "muon", "ns_dtype": "fp32"}))
    runs, outputs = {}, {}
    for name, (n, train) in {"one": (1, {"micro_batch_size": 1}), **layouts}.items():
        runs[name] = tmp_path / name
        outputs[name] = orthon("midtrain", "-c", write_plan(tmp_path / f"{name}.yaml", plan(runs[name], train=train)),
                               "--from", source, "--no-eval", nproc=n).stdout
    # Records per stage, as the plan implies: one loss a step (512, 1024, 512 tokens at 256 a step), the
    # indexer KL on every step with an indexer objective (DSA stage, sparse IndexShare stage), the recall
    # on the DSA stage's 2 indexer-only steps.
    counts = {"00_long": (2, 0, 0), "01_dsa": (4, 4, 2), "02_share": (2, 2, 0)}
    for layout in layouts:
        for stage in STAGES:
            for key, count in zip(("loss", "indexer_kl", "indexer_recall"), counts[stage]):
                one, two = _records(runs["one"], stage, key), _records(runs[layout], stage, key)
                assert len(one) == len(two) == count, (layout, stage, key, len(one), len(two))
                assert all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(one, two)), (layout, stage, key, one, two)
        # Every stage's weights, not only the last: a stage whose trainable set differs from the wrapped
        # one (IndexShare's sparse-from-the-start stage) must still reduce the indexers' gradients.
        for stage in STAGES:
            final = [load_file(str(runs[n] / "stages" / stage / "final" / "model.safetensors")) for n in ("one", layout)]
            bad = [(name, float((value - final[1][name]).abs().max())) for name, value in final[0].items()
                   if not torch.allclose(value, final[1][name], atol=1e-4, rtol=1e-3)]
            assert not bad, (layout, stage, bad)
    return outputs


def test_two_processes_match_one(tmp_path):
    # One sequence per micro-batch, so every stage's batch splits evenly over 2 data ranks; under context
    # parallelism both ranks take the same two (the dense, indexer-only, sparse and IndexShare phases).
    out = _match_one(tmp_path, {
        "ddp-expert": (2, {"micro_batch_size": 1, "parallel": "ddp", "expert_parallel": 2}),
        "fsdp-context": (2, {"micro_batch_size": 2, "parallel": "fsdp", "context_parallel": 2})})
    for name in ("ddp-expert", "fsdp-context"):
        assert ("split over 2 ranks" in out[name]) == ("model built sharded" in out[name]) == (name == "fsdp-context")
        assert ("expert parallelism" in out[name]) == (name == "ddp-expert")


@pytest.mark.slow  # about 45 s: the source, one process and 4 ranks
def test_four_ranks_as_hsdp_pairs_with_expert_and_context_parallelism_match_one(tmp_path):
    """Ranks 0-1 and 2-3 each split the same sequences (context parallel), hold half of every parameter
    (FSDP2 within the pair, copies across) and the experts spread over the pair's column (expert parallel)."""
    out = _match_one(tmp_path, {"hsdp": (4, {"micro_batch_size": 1, "parallel": "fsdp", "fsdp_shard_ranks": 2,
                                             "expert_parallel": 2, "context_parallel": 2})})["hsdp"]
    assert "FSDP2 over 4 ranks, sharded within groups of 2" in out and "split over 2 ranks" in out
    assert "expert parallelism: 2 of the 4 experts" in out
