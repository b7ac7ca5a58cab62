"""`orthon rl` end to end on a small random policy: the loop runs, engine and trainer log-probs agree,
metrics / plot / checkpoints are written, and a resumed run continues where it stopped."""
import json

import torch
import yaml

from orthon.pretrain import GLMForCausalLM, ModelConfig
from orthon.pretrain.weights import save_weights
from pretrain_support import MODEL, orthon
from test_data_support import train_tiny_tokenizer


def _pretrain_dir(tmp_path):
    run = tmp_path / "pre"
    tok = train_tiny_tokenizer(tmp_path / "tok", vocab_size=512)
    torch.manual_seed(0)
    model = GLMForCausalLM(ModelConfig(**{**MODEL, "vocab_size": 512, "sparse_attention": True, "index_topk": 8}))
    save_weights(model, run / "final")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(tok)}}))
    return run


def _recipe(tmp_path, run_dir, iterations):
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump({"rl": {
        "run_dir": str(run_dir), "iterations": iterations, "prompts_per_iteration": 3, "max_new_tokens": 12,
        "lr": 1e-3, "lr_warmup_iterations": 2, "engine": {"logprobs": "rescore"}, "eval_interval": 2, "checkpoint_interval": 2, "progress": False, "micro_batch_size": 5,
        "task_args": {"difficulty": 1, "eval_size": 6}, "buffer": {"num_repeat_per_sample": 4},
    }}))
    return path


def test_rl_loop_runs_and_resumes(tmp_path):
    pre, run = _pretrain_dir(tmp_path), tmp_path / "rl"
    out = orthon("rl", "-c", _recipe(tmp_path, run, 3), "--from", pre)
    assert "held-out reward" in out.stdout and "held-out mean reward" in out.stdout and "greedy" in out.stdout
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["lr"] for r in steps] == [5e-4, 1e-3, 1e-3]  # linear warmup over 2 iterations
    evals = [r for r in records if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 3] and all(0 <= r["eval_greedy"] <= 1 for r in evals)
    for r in steps:
        # The engine rescored its samples with the trainer's own scoring: the same bits, no mismatch.
        assert r["logp_mismatch_max"] == 0.0
        assert r["masked_fraction"] == 0.0
        assert r["buffer_consumed_groups"] == 3 * r["step"]
        assert r["policy_version"] == r["step"]
    assert (run / "reward.png").stat().st_size > 0 and (run / "final" / "model.safetensors").exists()

    out = orthon("rl", "-c", _recipe(tmp_path, run, 5), "--resume", "rl.iterations=5")
    assert "resumed RL" in out.stdout + out.stderr and "at iteration 3" in out.stdout + out.stderr
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2, 3, 4, 5]
