"""RL under torchrun: 2 gloo processes (DDP or FSDP2) train on the same rollouts as 1 process and end at
the same weights. Rank 0 draws the prompts (under DDP both ranks generate a share of each round) and hands
each iteration's groups to both ranks; the DP schedule gives each rank a disjoint share of the
micro-batches (every sample trained once), balanced by FLOPs."""
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pretrain_support import orthon
from test_rl_loop import CACHED, TIMED, _pretrain_dir, _recipe

ITERATIONS = 3


def first_letter_reward(response: str, label) -> float:
    """A reward a random policy earns about half the time (its answer starts in the first half of the
    alphabet), so that groups have advantages and the runs really train."""
    text = response.strip().lower()
    return float(bool(text) and text[0] < "n")


def _run(tmp_path, pre, name, nproc, iterations=ITERATIONS, total_steps=0, resume=False, parallel="ddp", mode="sync",
         experts=1, kl_coef=0.0):
    run = tmp_path / name
    path = _recipe(tmp_path, run, iterations, total_steps=total_steps, name=f"{name}.yaml")
    recipe = yaml.safe_load(path.read_text())
    # fp32 Newton-Schulz: a reduction-order round-off could flip a bf16 rounding between the world sizes.
    recipe["optim"] = {"ns_dtype": "fp32"}
    recipe["train"]["parallel"] = parallel
    recipe["train"]["expert_parallel"] = experts
    recipe["rl"]["mode"] = mode
    recipe["rl"]["dp_schedule"] = {"micro_batch_tokens": 96}
    recipe["rl"]["reward"] = {"name": "test_rl_parallel.first_letter_reward"}
    if kl_coef:
        recipe["rl"].setdefault("loss", {})["kl_coef"] = kl_coef
    path.write_text(yaml.safe_dump(recipe))
    out = orthon("rl", "-c", path, *(["--resume"] if resume else ["--from", pre]), nproc=nproc)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return out, [r for r in records if "reward_mean" in r], _weights(run / "final")


def _trained_apart(one: dict, two: dict, start: dict) -> list:
    """The tensors where two runs of the same training differ by more than 1% of how far the training moved
    them, both as Frobenius norms. Not a fixed tolerance: the runs' micro-batches differ, so does the
    round-off of every sum, and AdamW turns a round-off in a near-zero gradient (a rare token's embedding
    row, an expert few tokens reach) into a visible step of one element (5.8e-6 on a weight whose largest
    move was 1.1e-3; 8.2e-6 against 7.3e-4 on an AMX Xeon): a largest-element measure would count those.
    A rank that dropped or doubled its share would be off by about the movement itself."""
    assert one.keys() == two.keys()
    apart = []
    for name in one:
        moved = (one[name].double() - start[name].double()).norm().item()
        gap = (two[name].double() - one[name].double()).norm().item()
        if gap > 0.01 * moved + 1e-7:
            apart.append((name, gap, moved))
    return apart


def _weights(directory):
    weights = {}
    for file in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_parallel")
    pre = _pretrain_dir(tmp)
    return tmp, pre, _run(tmp, pre, "one", 1)


# -m slow (about 12 s each): FSDP2 (its Ray trainer ranks: test_rl_cluster), DDP with expert parallelism.
@pytest.mark.parametrize("parallel,experts", [("ddp", 1), pytest.param("fsdp", 1, marks=pytest.mark.slow),
                                              pytest.param("ddp", 2, marks=pytest.mark.slow)])
def test_two_ranks_train_what_one_does(setup, parallel, experts):
    tmp, pre, (out1, one, w1) = setup
    out2, two, w2 = _run(tmp, pre, f"two_{parallel}_{experts}", 2, parallel=parallel, experts=experts)
    assert experts == 1 or "expert parallelism: 2 of the 4 experts" in out2.stdout + out2.stderr
    assert len(one) == len(two) == ITERATIONS
    # One summary line, from rank 0.
    assert out2.stdout.count("done: ") == 1
    for a, b in zip(one, two):
        # The same rollouts (rank 0 generates them as one process does) and every sample trained once.
        assert a["reward_mean"] == b["reward_mean"] and a["trained_samples"] == b["trained_samples"] == 12
        assert a["groups_all_equal"] < 1.0  # some groups have advantages: the steps move the weights
        assert a["trained_tokens"] == b["trained_tokens"] > 0
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
        assert a["logp_mismatch_max"] == b["logp_mismatch_max"] == 0.0
        # Micro-batches of at most 96 padded tokens and 5 samples: more than one per rank, as many on each.
        assert b["micro_batches"] * 2 >= a["micro_batches"] > 2 and b["micro_batches"] < a["micro_batches"]
        assert a["dp_balance"] == 1.0 and 1.0 <= b["dp_balance"] < 1.5
        # Under DDP both ranks generated a share of each round (FSDP2, expert parallelism: rank 0 alone);
        # every other figure, the rollout and reward counters gathered from the ranks included, is the one
        # process's.
        assert (a["rollout_ranks"], b["rollout_ranks"]) == (1, 2 if parallel == "ddp" and experts == 1 else 1)
        differ = {"micro_batches", "dp_balance", "rollout_ranks", "entropy", *TIMED, *CACHED}
        assert {k: v for k, v in a.items() if k not in differ} == {k: v for k, v in b.items() if k not in differ}
    assert not _trained_apart(w1, w2, _weights(pre / "final"))
    assert any(not torch.equal(w1[name], w2[name]) for name in w1)  # round-off differs: two ranks summed


@pytest.mark.parametrize("experts", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_kl_reference_placed_as_the_policy_trains_as_one_process(setup, experts):
    """kl_coef > 0 under FSDP2 on two ranks (and expert parallelism): the frozen reference is built sharded as
    the policy is (no rank loads it whole; its forward runs on both ranks together) and the run ends where
    one process's does; the KL term changed that end (a run without it ends elsewhere)."""
    tmp, pre, (_, _, plain) = setup
    _, one, w1 = _run(tmp, pre, f"one_kl_{experts}", 1, kl_coef=1.0)
    out, two, w2 = _run(tmp, pre, f"two_kl_fsdp_{experts}", 2, parallel="fsdp", experts=experts, kl_coef=1.0)
    assert "KL reference: " in out.stdout and "placed as the policy: sharded" in out.stdout
    start = _weights(pre / "final")
    assert [r["reward_mean"] for r in one] == [r["reward_mean"] for r in two]
    assert not _trained_apart(w1, w2, start)
    assert _trained_apart(plain, w1, start)


def test_two_ranks_train_asynchronously(setup):
    # rl.mode async: rank 0's producer threads generate beside its training; every iteration still
    # trains its groups on both ranks (the policy version moves by one each), with no hang at the end.
    tmp, pre, _ = setup
    out, records, weights = _run(tmp, pre, "two_async", 2, mode="async")
    assert [r["policy_version"] for r in records] == list(range(1, ITERATIONS + 1))
    assert all(r["trained_samples"] == 12 and r["trained_tokens"] > 0 for r in records)
    assert out.stdout.count("done: ") == 1 and weights


@pytest.mark.slow  # about 45 s on a 2-core CPU without AVX-512; one-rank resume: test_rl_loop
def test_two_ranks_resume_where_they_stopped(tmp_path):
    # Stopped after 2 of 4 iterations and resumed at world size 2 (rank 0's rollout manager state in the
    # checkpoint): the same records and the same weights, bit for bit, as the run that never stopped.
    pre = _pretrain_dir(tmp_path)
    _, whole, w_whole = _run(tmp_path, pre, "whole", 2, iterations=4, total_steps=4)
    _run(tmp_path, pre, "split", 2, iterations=2, total_steps=4)
    out, split, w_split = _run(tmp_path, pre, "split", 2, iterations=4, total_steps=4, resume=True)
    assert "resumed RL at iteration 2" in out.stdout + out.stderr
    assert ([{k: v for k, v in r.items() if k not in TIMED + CACHED} for r in split]
            == [{k: v for k, v in r.items() if k not in TIMED + CACHED} for r in whole])
    assert all(torch.equal(w_whole[k], w_split[k]) for k in w_whole)


@pytest.mark.slow  # about 25 s: four posttrain runs
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_posttrain_plan_trains_on_two_ranks_as_on_one(tmp_path, chat_tokenizer, parallel):
    # SFT then RL through `orthon posttrain` at world sizes 1 and 2: each stage ends at the same weights
    # (the SFT step shares RL's DP schedule; under FSDP2 final/ is gathered from the shards), and rank 0's
    # evaluation summary is the one process's.
    from orthon.pretrain import GLMForCausalLM, ModelConfig
    from orthon.pretrain.weights import save_weights
    from pretrain_support import MODEL

    source = tmp_path / "pre"
    torch.manual_seed(0)
    save_weights(GLMForCausalLM(ModelConfig(**{**MODEL, "vocab_size": chat_tokenizer.vocab_size})), source / "final")
    (source / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(chat_tokenizer.path)}}))
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "optim": {"ns_dtype": "fp32"},
        "train": {"progress": False, "micro_batch_size": 3, "checkpoint_interval": 50, "parallel": parallel},
        "rl": {"iterations": 1, "prompts_per_iteration": 3, "max_new_tokens": 6, "eval_samples": 1,
               "eval_interval": 0, "buffer": {"num_repeat_per_sample": 2}, "drop_zero_std_groups": False,
               "max_sampling_rounds": 1, "task_args": {"difficulty": 1, "eval_size": 2},
               "reward": {"name": "test_rl_parallel.first_letter_reward"}}}))
    finals = {}
    for nproc in (1, 2):
        run = tmp_path / f"post{nproc}"
        plan = {"recipe": "base.yaml", "run_dir": str(run), "stages": [
            {"name": "sft", "kind": "sft", "set": {"sft": {"examples": 8, "steps": 2, "batch_size": 5}}},
            {"name": "reasoning_rl"}]}
        (tmp_path / f"plan{nproc}.yaml").write_text(yaml.safe_dump(plan))
        out = orthon("posttrain", "-c", tmp_path / f"plan{nproc}.yaml", "--from", source, nproc=nproc)
        assert out.stdout.count("held-out reward of each stage's model") == 1
        finals[nproc] = {stage: _weights(run / stage / "final") for stage in ("sft", "reasoning_rl")}
        finals[nproc]["evaluation"] = json.loads((run / "stages.json").read_text())["evaluation"]
    assert finals[1]["evaluation"] == finals[2]["evaluation"]
    before = _weights(source / "final")
    for stage in ("sft", "reasoning_rl"):
        one, two = finals[1][stage], finals[2][stage]
        assert any(not torch.equal(one[k], before[k]) for k in one)  # the stage trained
        assert not _trained_apart(one, two, before), stage
        before = one


def test_the_ray_cluster_is_refused_under_torchrun():
    # rl.cluster runs its own trainer and engines as Ray actors: every torchrun rank would start a cluster.
    import subprocess
    import sys

    from pretrain_support import ROOT, env

    proc = subprocess.run([sys.executable, "-m", "orthon.launch.cli", "rl", "-c", "configs/rl_tiny_ray.yaml",
                           "--from", "runs/nosuch"], cwd=ROOT, env={**env(), "WORLD_SIZE": "2"},
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "not under torchrun" in proc.stdout + proc.stderr


def test_round_shares_and_errors_by_hand():
    from types import SimpleNamespace
    import collections

    from orthon.core.errors import EngineUnavailable
    from orthon.rl.rank_rollouts import RankRollouts, shares
    from orthon.rl.rewards.registry import RewardStats

    assert shares(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert shares([9], 2) == [[9], []]

    def manager(roll):
        return SimpleNamespace(_roll=roll, counters=collections.Counter(), reward=SimpleNamespace(stats=RewardStats()))

    def counting(items):
        m.counters["truncated"] += 1
        m.reward.stats.record("ok", "passed")
        return [f"sample {i}" for i in items]

    m = manager(counting)
    # One process: the round is rank 0's share alone, and its own counts are not added twice.
    assert RankRollouts(m, 0, 1).roll([1, 2]) == ["sample 1", "sample 2"]
    assert m.counters["truncated"] == 1 and m.reward.stats.calls == 1 and m.reward.stats.passed == 1

    def down(items):
        raise EngineUnavailable("engine 0 is down")

    def broken(items):
        raise ValueError("bad plug-in")

    # A rank's error is the round's: an engine down stays EngineUnavailable (the round is retried).
    with pytest.raises(EngineUnavailable, match="rank 0: EngineUnavailable: engine 0 is down"):
        RankRollouts(manager(down), 0, 1).roll([1])
    with pytest.raises(RuntimeError, match="rank 0: ValueError: bad plug-in"):
        RankRollouts(manager(broken), 0, 1).roll([1])
