"""The trainer's step options: several optimizer steps per rollout, and dropping zero-std groups with
DAPO's refill."""
import pytest
import torch

from orthon.data.tokenizer import load_tokenizer
from orthon.pretrain.flops import ModelFlops
from orthon.pretrain.logprobs import sequence_log_probs
from orthon.rl.sample import Sample, SampleStatus
from orthon.core.config import build
from orthon.optim import lr_at
from orthon.optim.config import ScheduleConfig
from orthon.rl.recipe import RLRecipe
from orthon.rl.train_config import RLConfig
from orthon.rl.trainer import RLTrainer
from orthon.pretrain.weights import load_config
from test_rl_loop import _pretrain_dir

pytestmark = pytest.mark.usefixtures("one_thread")

G = 4


def _trainer(tmp_path, name, loss=None, own_engine=False, **overrides):
    pre = _pretrain_dir(tmp_path / name)
    model = load_config(pre / "final")
    recipe = build(RLRecipe, {
        "train": {"run_dir": str(tmp_path / name / "rl"), "progress": False, "micro_batch_size": 3,
                  "init_from": str(pre / "final")},
        "schedule": {"peak_lr": 1e-3, "floor_lr": 1e-3},
        "rl": {"buffer": {"num_repeat_per_sample": G}, "loss": loss or {}, **overrides}})
    recipe.model = model
    import yaml

    tokenizer = load_tokenizer(yaml.safe_load((pre / "config.yaml").read_text())["data"]["tokenizer"])
    if own_engine:  # an engine the caller made (as orthon serve's or a test's): the trainer leaves it as it is
        from orthon.engine.in_process import InProcessEngine
        from orthon.pretrain.weights import load_weights

        return RLTrainer(recipe, tokenizer, engine=InProcessEngine(load_weights(pre / "final"), recipe.rl.engine))
    return RLTrainer(recipe, tokenizer)


def _groups(trainer, rewards, first_id=0):
    """Groups of G samples with the given rewards; rollout log-probs are the trainer's own (rescore)."""
    g = torch.Generator().manual_seed(first_id)
    groups = []
    for i, row in enumerate(rewards):
        seqs = [torch.randint(3, 500, (9,), generator=g).tolist() for _ in row]
        with torch.no_grad():
            lp = sequence_log_probs(trainer.model, seqs, [4] * len(row)).log_probs
        groups.append([Sample(f"p{first_id + i}", s, response_length=4, loss_mask=[1] * 4, rollout_log_probs=lp[j].clone(),
                              reward=r, status=SampleStatus.COMPLETED) for j, (s, r) in enumerate(zip(seqs, row))])
    return groups


def _steps(trainer) -> int:
    return max((int(s["step"]) for opt in trainer.optimizer.optimizers for s in opt.state.values()), default=0)


def test_updates_per_iteration_take_that_many_steps(tmp_path):
    trainer = _trainer(tmp_path, "a", updates_per_iteration=2)
    # Before each optimizer step, the mean |logp - rollout logp| of its batch under the weights it starts from.
    diffs, flops, train_step = [], [], trainer.trainer.train_step

    def recording(batch, tokens):
        with torch.no_grad():
            lp = sequence_log_probs(trainer.model, [s.tokens for s, _ in batch], [s.response_length for s, _ in batch])
        diffs.append(float((lp.log_probs - torch.stack([s.rollout_log_probs for s, _ in batch])).abs().mean()))
        metrics = train_step(batch, tokens=tokens)
        flops.append((metrics["tflops_per_device"] * 1e12 * metrics["step_time_s"], len(batch), metrics["step_time_s"]))
        return metrics

    trainer.trainer.train_step = recording
    stats = trainer.train_on(_groups(trainer, [[1, 0, 0, 1], [0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 1, 1]]))
    assert _steps(trainer) == 2 and len(diffs) == 2
    # The first step runs on the rollout's weights: no mismatch beyond round-off (its micro-batches of 3 are
    # not the rescoring batch of 16, and on AVX-512 CPUs the GEMMs then round differently: 4.8e-7 seen); the
    # second is off-policy, and the logged mean is over both steps' tokens (2 groups x 4 samples x 4 tokens
    # each): half the second step's.
    assert stats["logp_mismatch_max"] < 1e-6
    assert diffs[0] < 1e-6 and diffs[1] > 1e-4
    assert stats["logp_abs_diff"] == pytest.approx((diffs[0] + diffs[1]) / 2, rel=1e-3)
    # Each step's model FLOPs: its samples' 8 input tokens each (9 tokens, the last one only a target).
    per_sample = ModelFlops.of(trainer.recipe.model).sequences([8])
    assert [(pytest.approx(f, rel=1e-9), n) for f, n, _ in flops] == [(per_sample * 8, 8)] * 2
    # The iteration's figure: both updates' FLOPs over their time together.
    assert stats["tflops_per_device"] == pytest.approx(per_sample * 16 / 1e12 / sum(t for *_, t in flops), rel=1e-9)


def test_the_trainer_rescores_what_the_engine_would(tmp_path):
    """rl.engine.logprobs: rescore in the synchronous loop: its engine keeps the sampling step's log-probs and
    the trainer's forwards replace them (the first update's samples in its own forward, the second's before
    it): the old log-probs of an engine that rescores itself, to round-off, and the same update, without
    the engine's extra forward over every sample generated."""
    overrides = dict(engine={"logprobs": "rescore", "max_batch_size": 8}, updates_per_iteration=2,
                     prompts_per_iteration=4, max_new_tokens=6)
    ours, theirs = _trainer(tmp_path, "a", **overrides), _trainer(tmp_path, "b", own_engine=True, **overrides)
    assert ours.trainer_rescores and not theirs.trainer_rescores
    assert (ours.engine.config.logprobs, theirs.engine.config.logprobs) == ("decode", "rescore")
    groups = [trainer.collect_groups()[0] for trainer in (ours, theirs)]
    flat = [[s for g in gs for s in g] for gs in groups]
    assert len(flat[0]) == 4 * G and [s.tokens for s in flat[0]] == [s.tokens for s in flat[1]]
    for a, b in zip(*flat):  # rewards that teach something (a random policy earns none)
        a.reward = b.reward = float(sum(a.tokens) % 2)
        # The sampling step's log-probs, which the trainer must replace, made unmistakable (they are
        # within float round-off of the rescore otherwise).
        a.rollout_log_probs = torch.full_like(a.rollout_log_probs, -1.0)
    before = [p.detach().clone() for p in ours.model.parameters()]
    stats = ours.train_on(groups[0]), theirs.train_on(groups[1])
    for a, b in zip(*flat):
        torch.testing.assert_close(a.rollout_log_probs, b.rollout_log_probs, atol=1e-4, rtol=0)
    assert stats[0]["logp_mismatch_max"] == 0.0 and _steps(ours) == _steps(theirs) == 2
    # The same two updates, to round-off: the engine's waves and the trainer's micro-batches group the
    # samples differently, and a first Adam step's sign can flip on a near-zero gradient.
    with torch.no_grad():
        moved = sum(float((p - p0).abs().sum()) for p, p0 in zip(ours.model.parameters(), before))
        apart = sum(float((p - q).abs().sum()) for p, q in zip(ours.model.parameters(), theirs.model.parameters()))
    assert moved > 0 and apart < 0.01 * moved


def _script_rollouts(trainer, rounds):
    """Replace generation by groups with scripted rewards, one list of groups per rollout round."""
    calls = []

    def rollout(n):
        groups = _groups(trainer, rounds[len(calls)], first_id=100 * len(calls))
        calls.append(len(groups))
        for sample in (s for g in groups for s in g):
            trainer.buffer.add(sample)
        return {"rollout_failed": 0}

    trainer.rollout.generate = rollout
    return calls


def test_zero_std_groups_are_dropped_exactly(tmp_path):
    rewards = [[1, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    dropping = _trainer(tmp_path, "a", drop_zero_std_groups=True, prompts_per_iteration=4)
    _script_rollouts(dropping, [rewards])
    kept, stats = dropping.collect_groups()
    assert [g[0].instance_id for g in kept] == ["p1", "p3"]
    assert stats["groups_all_equal"] == 0.5 and stats["reward_mean"] == pytest.approx(7 / 16)
    assert stats["sampling_rounds"] == 1 and stats["groups_kept"] == 2
    # Keeping the zero-std groups changes the step: their tokens dilute the token-mean loss.
    dropping.train_on(kept)
    keeping = _trainer(tmp_path, "c")
    keeping.train_on(_groups(keeping, rewards))
    assert any(not torch.equal(p, q) for p, q in zip(keeping.model.parameters(), dropping.model.parameters()))


def test_refill_rounds_until_enough_informative_groups(tmp_path):
    trainer = _trainer(tmp_path, "a", drop_zero_std_groups=True, prompts_per_iteration=2, max_sampling_rounds=3)
    calls = _script_rollouts(trainer, [[[1, 1, 1, 1], [0, 1, 0, 0]], [[0, 0, 0, 0], [1, 1, 0, 1]], [[1, 0, 1, 0]] * 2])
    kept, stats = trainer.collect_groups()
    assert len(calls) == 2  # the second round filled the batch; the third never ran
    assert [g[0].instance_id for g in kept] == ["p1", "p101"]
    assert stats["sampling_rounds"] == 2 and stats["groups_all_equal"] == 0.5
    assert stats["reward_mean"] == pytest.approx(8 / 16)
    # More informative groups than the batch holds: the extra ones are dropped and counted.
    trainer = _trainer(tmp_path, "b", drop_zero_std_groups=True, prompts_per_iteration=1, max_sampling_rounds=3)
    _script_rollouts(trainer, [[[1, 0, 0, 0], [0, 1, 1, 1]]])
    kept, stats = trainer.collect_groups()
    assert len(kept) == 1 and stats["groups_extra_dropped"] == 1 and stats["groups_kept"] == 1
    # Rounds run out: the step trains on what it has.
    trainer = _trainer(tmp_path, "c", drop_zero_std_groups=True, prompts_per_iteration=2, max_sampling_rounds=2)
    calls = _script_rollouts(trainer, [[[1, 1, 1, 1], [0, 1, 0, 0]], [[0, 0, 0, 0]] * 2])
    kept, stats = trainer.collect_groups()
    assert len(calls) == 2 and len(kept) == 1 and stats["groups_all_equal"] == 0.75


def test_refill_needs_the_filter():
    from orthon.core.errors import ConfigError

    with pytest.raises(ConfigError, match="max_sampling_rounds"):
        RLConfig(max_sampling_rounds=2)


def test_nothing_to_learn_takes_no_step(tmp_path):
    trainer = _trainer(tmp_path, "a", drop_zero_std_groups=True)
    _script_rollouts(trainer, [[[1, 1, 1, 1], [0, 0, 0, 0]]])
    before = [p.clone() for p in trainer.model.parameters()]
    kept, stats = trainer.collect_groups()
    assert kept == [] and stats["groups_all_equal"] == 1.0
    assert trainer.train_on(kept) == {} and _steps(trainer) == 0
    assert all(torch.equal(p, q) for p, q in zip(before, trainer.model.parameters()))


def test_lr_warmup_then_cosine_to_the_floor_by_steps():
    """RL's schedule is the one schedule module counting optimizer steps: step s runs at the value for
    s + 1, so the warmup reaches the peak on its last step and the decay ends on the run's last step."""
    cfg = ScheduleConfig(peak_lr=1e-4, floor_lr=1e-5, warmup_steps=10, total_steps=250)
    # Warmup 1/10 .. 10/10 of lr over steps 0..9, then the cosine from step 9 (lr) to 249 (floor):
    # its midpoint, step 129, is halfway between lr and the floor.
    expected = {0: 1e-5, 4: 5e-5, 9: 1e-4, 129: 0.55e-4, 249: 1e-5}
    assert {i: lr_at(cfg, 0, i) for i in expected} == pytest.approx(expected)
    assert all(lr_at(cfg, 0, i) >= lr_at(cfg, 0, i + 1) for i in range(9, 249))  # monotone decay
    constant = ScheduleConfig(peak_lr=1e-4, floor_lr=1e-4, warmup_steps=10, total_steps=250)
    assert [lr_at(constant, 0, i) for i in (9, 100, 249)] == pytest.approx([1e-4] * 3)
    # The RL recipe fills total_steps from its iterations x updates per iteration.
    recipe = build(RLRecipe, {"schedule": {"warmup_steps": 3}, "rl": {"iterations": 7, "updates_per_iteration": 2}})
    assert recipe.schedule.total_steps == 14 and recipe.schedule.by_steps
