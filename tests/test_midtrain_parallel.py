"""Mid-training on 2 gloo processes equals 1 process: the stages' losses, indexer KL and recall agree,
and the final weights match."""
import json

import torch
from safetensors.torch import load_file

from pretrain_support import make_stores, orthon, write_recipe
from test_midtrain_stages import STAGES, plan, write_plan


def _records(run, stage, key):
    lines = (run / "stages" / stage / "metrics.jsonl").read_text().splitlines()
    return [json.loads(l)[key] for l in lines if f'"{key}"' in l]


def test_two_processes_match_one(tmp_path):
    stores = make_stores(tmp_path / "data")
    # fp32 Newton-Schulz: in bf16, the ranks' different summation order flips single roundings.
    source = tmp_path / "pre"
    orthon("pretrain", "-c", write_recipe(tmp_path / "pre.yaml", stores, source, train={"max_steps": 6},
                                          optim={"algorithm": "muon", "ns_dtype": "fp32"}))
    runs = {}
    for n in (1, 2):
        runs[n] = tmp_path / f"mid{n}"
        # One sequence per micro-batch, so every stage's batch splits evenly over 2 ranks.
        orthon("midtrain", "-c", write_plan(tmp_path / f"plan{n}.yaml", plan(runs[n], train={"micro_batch_size": 1})), "--from", source,
               "--no-eval", nproc=n)
    # Records per stage, as the plan implies: one loss a step (512, 1024, 512 tokens at 256 a step), the
    # indexer KL on every step with an indexer objective (DSA stage, sparse IndexShare stage), the recall
    # on the DSA stage's 2 indexer-only steps.
    counts = {"00_long": (2, 0, 0), "01_dsa": (4, 4, 2), "02_share": (2, 2, 0)}
    for stage in STAGES:
        for key, count in zip(("loss", "indexer_kl", "indexer_recall"), counts[stage]):
            one, two = _records(runs[1], stage, key), _records(runs[2], stage, key)
            assert len(one) == len(two) == count, (stage, key, len(one), len(two))
            assert all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(one, two)), (stage, key, one, two)
    # Every stage's weights, not only the last: a stage whose trainable set differs from the wrapped
    # one (IndexShare's sparse-from-the-start stage) must still reduce the indexers' gradients.
    for stage in STAGES:
        final = [load_file(str(runs[n] / "stages" / stage / "final" / "model.safetensors")) for n in (1, 2)]
        bad = [(name, float((value - final[1][name]).abs().max())) for name, value in final[0].items()
               if not torch.allclose(value, final[1][name], atol=1e-4, rtol=1e-3)]
        assert not bad, (stage, bad)
