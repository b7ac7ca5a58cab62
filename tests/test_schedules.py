"""LR and batch-size schedules at the GLM-5 recipe's numbers, as functions of tokens consumed."""
import pytest

from orthon.core.config import ConfigError, build
from orthon.optim import (
    BatchRampConfig,
    OptimConfig,
    ScheduleConfig,
    batch_size_at,
    batch_size_tokens,
    lr_at,
    lr_multiplier,
    micro_batches_per_rank,
    midtrain_schedule,
)
from orthon.optim.schedules import linear_decay_lr, tokens_after_steps, warmup_cosine_lr

M = 2**20
B = 10**9


def test_pretraining_lr_at_spec_numbers():
    cfg = ScheduleConfig()
    assert (cfg.peak_lr, cfg.floor_lr, cfg.total_tokens) == (2e-4, 4e-5, 27 * 10**12)
    warm = cfg.warmup_tokens
    assert lr_at(cfg, 0) == 0.0
    assert lr_at(cfg, warm // 2) == pytest.approx(1e-4)
    assert lr_at(cfg, warm) == pytest.approx(2e-4)
    middle = warm + (cfg.total_tokens - warm) // 2
    assert lr_at(cfg, middle) == pytest.approx((2e-4 + 4e-5) / 2)  # cos(pi/2) = 0
    quarter = warm + (cfg.total_tokens - warm) // 4
    assert lr_at(cfg, quarter) == pytest.approx(4e-5 + 1.6e-4 * 0.5 * (1 + 2**-0.5))
    assert lr_at(cfg, cfg.total_tokens) == pytest.approx(4e-5)
    assert lr_at(cfg, 2 * cfg.total_tokens) == pytest.approx(4e-5)
    assert lr_multiplier(cfg, warm) == pytest.approx(1.0)
    assert lr_multiplier(cfg, cfg.total_tokens) == pytest.approx(0.2)


def test_midtraining_linear_decay_endpoints():
    cfg = midtrain_schedule()
    assert cfg.total_tokens == 1_550 * B
    assert lr_at(cfg, 0) == pytest.approx(4e-5)
    assert lr_at(cfg, 775 * B) == pytest.approx(2.5e-5)
    assert lr_at(cfg, 1_550 * B) == pytest.approx(1e-5)
    assert lr_at(cfg, 2_000 * B) == pytest.approx(1e-5)
    # the first stage (1T of the 1.55T tokens at 32K) ends at 4e-5 - 3e-5 * 1/1.55
    assert lr_at(cfg, 1_000 * B) == pytest.approx(4e-5 - 3e-5 / 1.55)


def test_batch_ramp_at_spec_numbers():
    cfg = BatchRampConfig()
    micro, dp = 4096, 1024  # one 4K sequence per rank per micro-batch: increments of 4M tokens
    assert batch_size_at(cfg, 0, micro, dp) == 16 * M
    assert batch_size_at(cfg, 250 * B, micro, dp) == 40 * M
    assert batch_size_at(cfg, 500 * B, micro, dp) == 64 * M
    assert batch_size_at(cfg, 5_000 * B, micro, dp) == 64 * M
    assert micro_batches_per_rank(cfg, 0, micro, dp) == 4
    assert micro_batches_per_rank(cfg, 500 * B, micro, dp) == 16
    # Between increments the batch rounds down to whole micro-batch x dp units:
    # at 100B, 16M + 48M/5 = 25.6M -> 6 x 4M = 24M.
    assert batch_size_at(cfg, 100 * B, micro, dp) == 24 * M


def test_batch_ramp_is_whole_increments_and_monotone():
    increment = 3 * 4096
    sizes = [batch_size_tokens(t * B, 16 * M, 64 * M, 500 * B, increment) for t in range(0, 600, 7)]
    assert all(s % increment == 0 for s in sizes)
    assert sizes == sorted(sizes) and sizes[-1] == 64 * M // increment * increment
    assert batch_size_tokens(0, 100, 200, 10, 1000) == 1000  # never below one increment


def test_resume_lands_on_the_same_batch_and_lr():
    ramp = BatchRampConfig(start_batch_tokens=4096, end_batch_tokens=16384, ramp_tokens=200_000)
    sched = ScheduleConfig(warmup_tokens=50_000, total_tokens=1_000_000)
    tokens, trace = 0, []
    for _ in range(40):
        trace.append((tokens, batch_size_at(ramp, tokens, 512, 2), lr_at(sched, tokens)))
        tokens += trace[-1][1]
    resumed_at = tokens_after_steps(ramp, 25, 512, 2)
    assert resumed_at == trace[25][0]
    assert (batch_size_at(ramp, resumed_at, 512, 2), lr_at(sched, resumed_at)) == trace[25][1:]
    assert trace[0][1] == 4096 and trace[-1][1] == 16384


def test_floor_above_peak_and_other_bad_values():
    with pytest.raises(ConfigError, match="floor_lr: 0.0003 exceeds peak_lr 0.0002"):
        build(ScheduleConfig, {"floor_lr": 3e-4})
    with pytest.raises(ConfigError, match="schedule.floor_lr"):
        build(ScheduleConfig, {"floor_lr": 3e-4}, "schedule")
    with pytest.raises(ValueError, match="floor 0.001 exceeds its peak 0.0001"):
        warmup_cosine_lr(0, 1e-4, 1e-3, 10, 100)
    with pytest.raises(ValueError, match="exceeds its peak"):
        linear_decay_lr(0, 1e-5, 4e-5, 100)
    with pytest.raises(ValueError, match="increment"):
        batch_size_tokens(0, 16 * M, 64 * M, 500 * B, 0)
    with pytest.raises(ConfigError, match="end_batch_tokens"):
        build(BatchRampConfig, {"end_batch_tokens": 1024})
    with pytest.raises(ConfigError, match="total_tokens"):
        build(ScheduleConfig, {"warmup_tokens": 100, "total_tokens": 100})
    with pytest.raises(ConfigError, match="momentum"):
        build(OptimConfig, {"momentum": 1.5})
    with pytest.raises(ConfigError, match="ns_coefficients"):
        build(OptimConfig, {"ns_coefficients": [1, 2]})


def test_optim_config_defaults_are_the_spec():
    cfg = build(OptimConfig, {})
    assert (cfg.momentum, cfg.nesterov, cfg.ns_steps, cfg.rms_scale, cfg.weight_decay) == (0.95, True, 5, 0.2, 0.1)
    assert cfg.ns_coefficients == (3.4445, -4.7750, 2.0315)
    assert (cfg.ns_dtype, cfg.muon_split, cfg.head_to_muon, cfg.algorithm) == ("bf16", True, False, "muon")
