"""A step whose gradient is not finite is skipped (nothing updated, counted); too many in a row stop the
run as diverged, with one line naming the steps. With train.spike_sigma a spike is skipped too."""
import copy
import json
import math

import numpy as np
import pytest
import torch

from pretrain_support import make_stores, orthon, write_recipe
from orthon.core.errors import ConfigError, DivergedError
from orthon.core.step_guard import StepGuard
from orthon.pretrain.flops import ModelFlops
from orthon.pretrain.recipe import load_recipe
from orthon.pretrain.steps import NextTokenStep
from orthon.pretrain.trainer import Trainer


def test_the_skip_decision_and_its_limit():
    guard = StepGuard(limit=2)
    assert [guard.skip(step, norm) for step, norm in enumerate([1.0, math.nan, math.inf, 0.5, math.nan], 1)] == \
        [False, True, True, False, True]
    assert (guard.total, guard.in_a_row) == (3, 1)
    assert not guard.skip(6, 2.0) and guard.in_a_row == 0
    guard.skip(7, math.nan), guard.skip(8, -math.inf)
    with pytest.raises(DivergedError, match=r"not finite \(grad_norm nan\) at steps 7-9, more steps in a row than "
                                            r"train.max_nonfinite_skips = 2 allows.*weights are those of step 6"):
        guard.skip(9, math.nan)
    resumed = StepGuard(limit=2)
    resumed.load_state_dict(json.loads(json.dumps(guard.state_dict())))  # as a checkpoint carries it
    assert (resumed.total, resumed.in_a_row) == (guard.total, guard.in_a_row) == (6, 3)
    assert list(resumed.history["grad_norm"]) == [1.0, 0.5, 2.0]  # the finite ones
    with pytest.raises(DivergedError, match=r"at step 4, .* = 0 allows"):
        StepGuard(limit=0).skip(4, math.inf)


class PoisonedStep(NextTokenStep):
    """Pretraining's step with a NaN objective at the given steps (every gradient NaN, as a loss spike
    past the float range gives)."""

    def __init__(self, poisoned):
        super().__init__()
        self.poisoned = set(poisoned)

    def begin(self, trainer, batch):
        super().begin(trainer, batch)
        self.now = trainer.step + 1

    def loss(self, model, micro):
        objective, sums = super().loss(model, micro)
        return (objective * math.nan if self.now in self.poisoned else objective), sums


def _state(trainer):
    """The weights and each optimizer's state (not its LR, which the schedule sets before every step)."""
    return (copy.deepcopy(trainer.model.state_dict()),
            [copy.deepcopy(o.state_dict()["state"]) for o in trainer.optimizer.optimizers])


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_a_skipped_step_changes_nothing_but_the_data_position(tmp_path):
    stores = make_stores(tmp_path / "data")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stores, tmp_path / "run",
                                      train={"max_nonfinite_skips": 2}), [])
    trainer = Trainer(recipe, tmp_path / "run", log=lambda *_: None, step=PoisonedStep({2, 4, 5, 6, 7}))
    first = trainer.train_step()
    assert "skipped_steps" not in first and math.isfinite(first["grad_norm"])
    before, tokens = _state(trainer), trainer.tokens
    routers = list(trainer.model.moe_routers())
    biases = [r.e_score_correction_bias.clone() for r in routers]
    skipped = trainer.train_step()
    assert math.isnan(skipped["grad_norm"]) and skipped["skipped_steps"] == 1
    assert _equal(_state(trainer), before)  # weights, Muon momentum, AdamW moments and step counts
    assert all(torch.equal(r.e_score_correction_bias, b) for r, b in zip(routers, biases))
    assert all(r.expert_load.sum() == 0 for r in routers)  # its routing counts dropped, not carried over
    assert trainer.step == 2 and trainer.tokens > tokens  # the batch was consumed
    assert all(p.grad is None for p in trainer.model.parameters())

    third = trainer.train_step()  # finite again: an update, and the count of skips in a row restarts
    assert math.isfinite(third["grad_norm"]) and third["skipped_steps"] == 1
    assert not _equal(_state(trainer)[0], before[0])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())

    trainer.train_step(), trainer.train_step()  # steps 4 and 5: two in a row, the limit
    trainer.save_checkpoint()
    resumed = Trainer(recipe, tmp_path / "run", log=lambda *_: None, step=PoisonedStep({6, 7}))
    resumed.resume()
    assert (resumed.guard.total, resumed.guard.in_a_row) == (3, 2)
    with pytest.raises(DivergedError, match="at steps 4-6"):  # the count went on across the resume
        resumed.train_step()


def test_a_diverging_run_stops_with_one_line(tmp_path):
    """A learning rate of 1e20: step 1's update sends the weights out of range, every later gradient is
    NaN; after max_nonfinite_skips skips the command stops with exit code 2 and one line."""
    stores = make_stores(tmp_path / "data")
    recipe = write_recipe(tmp_path / "r.yaml", stores, tmp_path / "run", train={"max_steps": 20},
                          schedule={"peak_lr": 1e20, "floor_lr": 1e19, "warmup_tokens": 0})
    done = orthon("pretrain", "-c", recipe, "train.max_nonfinite_skips=3", check=False)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("orthon pretrain: not finite (grad_norm nan, loss nan) at steps 2-5, ")
    assert "Traceback" not in done.stderr
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped_steps", 0) for r in records if "loss" in r] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="max_nonfinite_skips: must be >= 0"):
        load_recipe(recipe, ["train.max_nonfinite_skips=-1"])


def test_the_mindspore_backend_skips_them_too(tmp_path):
    """MindSporeTrainer (PyNative) with every gradient of step 2 made NaN: weights and optimizer state
    stay as they were, the skip is counted, step 3 updates again."""
    pytest.importorskip("mindspore", reason="MindSpore is not installed (extra: pip install 'orthon[mindspore]')")
    from orthon.backends.mindspore.trainer import MindSporeTrainer

    stores = make_stores(tmp_path / "data")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", stores, tmp_path / "run"), ["backend=mindspore"])
    trainer = MindSporeTrainer(recipe, tmp_path / "run", log=lambda *_: None)
    grad_fn = trainer.grad_fn

    def poisoned(*inputs):
        out, grads = grad_fn(*inputs)
        return out, (tuple(g * math.nan for g in grads) if trainer.step + 1 == 2 else grads)

    trainer.grad_fn = poisoned

    def state():
        optimizer = trainer.optimizer.state_dict()  # its moments and step counts (not the schedule's position)
        return [p.asnumpy().copy() for p in trainer.params], {k: optimizer[k] for k in ("momentum", "exp_avg", "exp_avg_sq", "steps")}

    trainer.train_step()
    weights, optimizer = state()
    skipped = trainer.train_step()
    assert math.isnan(skipped["grad_norm"]) and skipped["skipped_steps"] == 1 and trainer.step == 2
    after_weights, after_optimizer = state()
    assert all(np.array_equal(a, b) for a, b in zip(weights, after_weights))
    assert _equal(after_optimizer, optimizer) and optimizer["momentum"] and optimizer["exp_avg"]
    third = trainer.train_step()
    assert not all(np.array_equal(a, p.asnumpy()) for a, p in zip(weights, trainer.params))
    assert all(np.isfinite(p.asnumpy()).all() for p in trainer.params)
    # Its step metrics carry the torch Trainer's model FLOPs (orthon.pretrain.flops) and memory.
    flops = ModelFlops.of(recipe.model).sequences([recipe.data.seq_len] * (third["batch_tokens"] // recipe.data.seq_len))
    assert third["tflops_per_device"] * 1e12 * third["step_time_s"] == pytest.approx(flops, rel=1e-9)
    assert third["memory_peak_gib"] > 0.1 and "mfu_pct" not in third  # no peak given: no MFU


def test_spikes_are_skipped_and_a_lasting_change_is_not():
    """spike_sigma 6 over a window of 20: nothing is judged before 10 steps of history; a norm far above
    the window is skipped; a loss jump too; a level that stays is accepted after a few steps."""
    import random

    lines = []
    guard = StepGuard(limit=5, spike_sigma=6.0, window=20, log=lines.append)
    rng = random.Random(0)
    assert not guard.skip(1, 50.0, 3.0)  # no history yet: not judged
    steps = iter(range(2, 1000))
    for _ in range(30):
        assert not guard.skip(next(steps), 1.0 + rng.gauss(0, 0.05), 3.0 + rng.gauss(0, 0.01))
    assert guard.skip(next(steps), 1.0 + 10 * 0.05 * 6, 3.0)  # about 10 sigma of the window's norms
    assert "grad_norm" in lines[-1] and "sigma above the last 20 steps' mean: skipped as a spike" in lines[-1]
    assert guard.skip(next(steps), 1.0, 4.0)  # the loss alone
    assert "loss 4 is" in lines[-1] and guard.total == 2
    assert guard.in_a_row == 0  # spikes are not divergence

    shifted = StepGuard(limit=5, spike_sigma=6.0, window=20, log=lines.append)
    for step in range(1, 31):
        shifted.skip(step, 1.0 + rng.gauss(0, 0.05))
    # A new level that stays: its first step is a spike; once in the window it widens the spread.
    assert [shifted.skip(step, 3.0) for step in range(31, 41)] == [True] + [False] * 9

    off = StepGuard(limit=5)  # spike_sigma 0: only non-finite steps
    for step in range(1, 40):
        assert not off.skip(step, 1.0 if step < 39 else 1e6, 3.0)


def test_a_spike_step_is_skipped_in_training(tmp_path):
    """The objective times 1000 at step 14 (a norm ~1000x): with spike_sigma 6 over 10 steps that step
    changes nothing and is counted; without it, it is applied."""
    stores = make_stores(tmp_path / "data")
    for sigma, skipped in ((6.0, True), (0.0, False)):
        recipe = load_recipe(write_recipe(tmp_path / f"r{sigma}.yaml", stores, tmp_path / f"run{sigma}",
                                          train={"spike_sigma": sigma, "spike_window": 10}), [])
        trainer = Trainer(recipe, tmp_path / f"run{sigma}", log=lambda *_: None, step=ScaledStep({14: 1000.0}))
        for _ in range(13):
            assert "skipped_steps" not in trainer.train_step()
        before = _state(trainer)
        metrics = trainer.train_step()
        assert _equal(_state(trainer), before) == skipped
        assert metrics.get("skipped_steps", 0) == int(skipped)


class ScaledStep(NextTokenStep):
    """Pretraining's step with the objective scaled at the given steps (a spike with a finite gradient)."""

    def __init__(self, scales):
        super().__init__()
        self.scales = scales

    def begin(self, trainer, batch):
        super().begin(trainer, batch)
        self.now = trainer.step + 1

    def loss(self, model, micro):
        objective, sums = super().loss(model, micro)
        return objective * self.scales.get(self.now, 1.0), sums
