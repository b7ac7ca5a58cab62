"""GRPO advantages, the IcePop loss, aggregation and OPD advantages, on hand-checked numbers."""
import math

import pytest
import torch

from orthon.core.config import ConfigError, build
from orthon.rl.config import LossConfig, OPDConfig
from orthon.rl.loss import (
    aggregate_loss,
    full_vocab_kl,
    grpo_advantages,
    icepop_token_loss,
    opd_kl_penalty_advantages,
    opd_sampled_advantages,
    token_entropy,
)

RHOS = [0.3, 0.49, 0.5, 0.75, 1.0, 1.5, 2.0, 2.01, 3.0]
KEPT = [False, False, True, True, True, True, True, False, False]


def _logps(rhos, base=-2.0):
    """logp_rollout = base, logp_train = base + log(rho): exp of the difference is rho in fp32."""
    rollout = torch.full((1, len(rhos)), base)
    train = (rollout + torch.log(torch.tensor([rhos]))).requires_grad_(True)
    return train, rollout


# ---------------------------------------------------------------- GRPO advantage


def test_grpo_advantage_hand_computed_group():
    # mean 0.5; unbiased std sqrt(4 * 0.25 / 3) = 0.57735; A = +-0.5 / 0.57735 = +-0.866025
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025]]), atol=1e-6)
    # population std 0.5: A = +-1
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), unbiased=False)
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0]]))
    # [1, 2, 3]: mean 2, unbiased std 1
    assert torch.allclose(grpo_advantages(torch.tensor([[1.0, 2.0, 3.0]])), torch.tensor([[-1.0, 0.0, 1.0]]))


def test_grpo_zero_std_group_gives_zero_and_groups_are_independent():
    flat = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    adv = grpo_advantages(flat, group_size=4)
    assert adv.shape == (8,)
    assert torch.equal(adv[:4], torch.zeros(4))
    assert torch.allclose(adv[4:], torch.tensor([-0.866025, -0.866025, 0.866025, 0.866025]), atol=1e-6)
    assert torch.equal(grpo_advantages(torch.tensor([[0.0], [1.0]])), torch.zeros(2, 1))  # G = 1
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(flat, group_size=3)


# ---------------------------------------------------------------- IcePop


def test_icepop_drops_exactly_the_tokens_outside_the_band():
    train, rollout = _logps(RHOS)
    mask = torch.ones_like(rollout)
    loss, metrics = icepop_token_loss(train, rollout, torch.tensor([1.0]), mask)
    loss.sum().backward()

    # With A = +1 a kept token has gradient -rho unless the clip holds it (rho > 1.28: 1.5 and 2).
    expected = torch.tensor([0.0, 0.0, -0.5, -0.75, -1.0, 0.0, 0.0, 0.0, 0.0])
    assert torch.allclose(train.grad[0], expected, atol=1e-6)
    assert metrics["masked_fraction"].item() == pytest.approx(4 / 9)
    assert metrics["kept_tokens"].item() == 5 and metrics["trained_tokens"].item() == 9
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 9)  # 1.5 and 2.0
    mean_abs = sum(abs(math.log(r)) for r in RHOS) / 9
    assert metrics["logp_abs_diff"].item() == pytest.approx(mean_abs, rel=1e-5)
    # Dropped tokens contribute no loss; kept ones -min(rho, clip(rho)).
    values = [0, 0, -0.5, -0.75, -1.0, -1.28, -1.28, 0, 0]
    assert torch.allclose(loss[0], torch.tensor(values), atol=1e-6)
    # Negative advantage: -min(-rho, -clip) = max(rho, clip(rho)); gradient rho unless rho < 0.8.
    train, rollout = _logps(RHOS)
    loss, _ = icepop_token_loss(train, rollout, torch.tensor([-1.0]), mask)
    loss.sum().backward()
    assert torch.allclose(train.grad[0], torch.tensor([0, 0, 0, 0, 1.0, 1.5, 2.0, 0, 0]), atol=1e-6)
    assert [bool(k) for k in (loss[0] != 0)] == KEPT


def test_icepop_asymmetric_clip_bounds_are_0_8_and_1_28():
    rhos = [0.79, 0.81, 1.27, 1.29]
    train, rollout = _logps(rhos)
    mask = torch.ones_like(rollout)
    loss, _ = icepop_token_loss(train, rollout, torch.tensor([1.0]), mask)
    loss.sum().backward()
    # A > 0: only the upper bound binds, at 1.28.
    assert [g != 0 for g in train.grad[0].tolist()] == [True, True, True, False]
    assert loss[0, 3].item() == pytest.approx(-1.28)
    train, rollout = _logps(rhos)
    loss, metrics = icepop_token_loss(train, rollout, torch.tensor([-1.0]), mask)
    loss.sum().backward()
    # A < 0: only the lower bound binds, at 0.8.
    assert [g != 0 for g in train.grad[0].tolist()] == [False, True, True, True]
    assert loss[0, 0].item() == pytest.approx(0.8)
    assert metrics["clip_fraction"].item() == pytest.approx(1 / 4)


def test_loss_mask_zero_tokens_have_zero_loss_and_gradient_even_with_garbage():
    train, rollout = _logps([1.0, 1.2, 0.9, 1.1])
    rollout = rollout.clone()
    rollout[0, 1] = -float("inf")  # padding may hold anything
    rollout[0, 3] = 5.0
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    loss, metrics = icepop_token_loss(train, rollout, torch.tensor([2.0]), mask, logits=torch.zeros(1, 4, 8))
    aggregate_loss(loss, mask).backward()
    # Trained tokens: rho 1.0 and 0.9 (inside the clip band), A = 2: loss -rho * A, gradient of the
    # token mean over 2 tokens -rho * A / 2. Masked tokens: exactly 0 (no NaN from the garbage).
    assert torch.allclose(loss[0], torch.tensor([-2.0, 0.0, -1.8, 0.0]), atol=1e-6)
    assert torch.allclose(train.grad[0], torch.tensor([-1.0, 0.0, -0.9, 0.0]), atol=1e-6)
    assert loss[0, 1] == 0 and loss[0, 3] == 0
    assert train.grad[0, 1] == 0 and train.grad[0, 3] == 0
    assert metrics["trained_tokens"].item() == 2 and metrics["masked_fraction"].item() == 0
    assert metrics["entropy"].item() == pytest.approx(math.log(8), rel=1e-6)


def test_kl_coefficient_zero_adds_nothing_and_positive_adds_k3():
    train, rollout = _logps([0.7, 1.0, 1.3])
    mask = torch.ones_like(rollout)
    ref = torch.full_like(rollout, float("nan"))  # never read when kl_coef = 0
    plain, _ = icepop_token_loss(train, rollout, torch.tensor([1.0]), mask)
    (g_plain,) = torch.autograd.grad(plain.sum(), train)
    with_ref, _ = icepop_token_loss(train, rollout, torch.tensor([1.0]), mask, kl_coef=0.0, logp_ref=ref)
    (g_ref,) = torch.autograd.grad(with_ref.sum(), train)
    assert torch.equal(plain, with_ref) and torch.equal(g_plain, g_ref)
    # k3 with logp_ref - logp_train = -1: exp(-1) + 1 - 1 = 0.367879, times 0.5
    ref = train.detach() - 1.0
    with_kl, metrics = icepop_token_loss(train, rollout, torch.tensor([1.0]), mask, kl_coef=0.5, logp_ref=ref)
    assert torch.allclose(with_kl - plain, torch.full_like(plain, 0.5 * math.exp(-1)), atol=1e-6)
    assert float(metrics["kl"]) == pytest.approx(math.exp(-1)) and "kl" not in icepop_token_loss(
        train, rollout, torch.tensor([1.0]), mask)[1]  # the k3 estimate itself, logged where it is in the loss
    with pytest.raises(ValueError, match="logp_ref"):
        icepop_token_loss(train, rollout, torch.tensor([1.0]), mask, kl_coef=0.1)


def test_rho_weighted_keep_option():
    train, rollout = _logps([0.4, 1.5, 2.5])
    mask = torch.ones_like(rollout)
    loss, metrics = icepop_token_loss(train, rollout, torch.tensor([2.0]), mask, keep_weight="rho")
    loss.sum().backward()
    # logp_old = logp_train: r = 1 (value), so loss = -k * A on the kept token and gradient -k * A.
    assert torch.allclose(loss[0], torch.tensor([0.0, -3.0, 0.0]), atol=1e-6)
    assert torch.allclose(train.grad[0], torch.tensor([0.0, -3.0, 0.0]), atol=1e-6)
    assert metrics["masked_fraction"].item() == pytest.approx(2 / 3)


def test_token_entropy_hand_value():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert token_entropy(logits).item() == pytest.approx(1.5 * math.log(2), rel=1e-6)


# ---------------------------------------------------------------- aggregation


def test_token_and_sequence_aggregation():
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [10.0, 77.0, 77.0, 77.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert aggregate_loss(loss, mask, "token").item() == pytest.approx((1 + 2 + 3 + 10) / 4)
    assert aggregate_loss(loss, mask, "sequence").item() == pytest.approx((2.0 + 10.0) / 2)
    assert aggregate_loss(loss, mask, "token", denominator=8).item() == pytest.approx(16 / 8)
    assert aggregate_loss(loss, mask, "sequence", denominator=4).item() == pytest.approx(12 / 4)
    with pytest.raises(ValueError, match="mode"):
        aggregate_loss(loss, mask, "batch")


# ---------------------------------------------------------------- OPD


def test_opd_form1_is_the_exact_full_vocab_kl():
    p_teacher = torch.tensor([0.7, 0.2, 0.1])
    p_student = torch.tensor([0.2, 0.5, 0.3])
    # 0.7 ln 3.5 + 0.2 ln 0.4 + 0.1 ln(1/3)
    kl = 0.7 * math.log(3.5) + 0.2 * math.log(0.4) + 0.1 * math.log(1 / 3)
    assert kl == pytest.approx(0.583815, abs=1e-6)
    teacher = torch.log(p_teacher).expand(1, 2, 3) + 4.0  # logits: any shift
    student = torch.log(p_student).expand(1, 2, 3).clone().requires_grad_(True)
    mask = torch.tensor([[1, 0]])
    adv = opd_kl_penalty_advantages(torch.tensor([0.5]), teacher, student, mask, coef=2.0)
    assert not adv.requires_grad
    assert adv[0, 0].item() == pytest.approx(0.5 - 2.0 * kl, abs=1e-5)
    assert adv[0, 1].item() == 0.0
    reverse = opd_kl_penalty_advantages(None, teacher, student, mask, direction="student_teacher")
    kl_rev = sum(q * math.log(q / p) for p, q in zip(p_teacher.tolist(), p_student.tolist()))
    assert reverse[0, 0].item() == pytest.approx(-kl_rev, abs=1e-5)
    # A teacher with zero probability on a token: that term is 0, not NaN.
    t = torch.tensor([[[0.0, 0.0, -float("inf")]]])
    s = torch.zeros(1, 1, 3)
    assert full_vocab_kl(t, s).item() == pytest.approx(0.5 * math.log(0.5 / (1 / 3)) * 2, abs=1e-6)


def test_opd_form2_is_the_stop_gradient_log_ratio():
    teacher = torch.tensor([[-0.5, -1.0, -3.0]])
    student = torch.tensor([[-1.0, -0.25, -2.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    adv = opd_sampled_advantages(teacher, student, mask)
    assert not adv.requires_grad
    assert torch.allclose(adv, torch.tensor([[0.5, -0.75, 0.0]]))
    # Used as the advantage of the policy loss, it changes nothing about the gradient path:
    # the gradient equals that with the same numbers as a plain constant.
    rollout = student.detach().clone()
    loss, _ = icepop_token_loss(student, rollout, adv, mask)
    (g_opd,) = torch.autograd.grad(aggregate_loss(loss, mask), student)
    loss_c, _ = icepop_token_loss(student, rollout, torch.tensor([[0.5, -0.75, 0.0]]), mask)
    (g_const,) = torch.autograd.grad(aggregate_loss(loss_c, mask), student)
    assert torch.equal(g_opd, g_const)
    # On-policy (rho = 1): gradient = -A / n_tokens on each trained token.
    assert torch.allclose(g_opd, torch.tensor([[-0.25, 0.375, 0.0]]))
    scaled = opd_sampled_advantages(teacher, student, mask, coef=2.0, advantages=torch.tensor([1.0]))
    assert torch.allclose(scaled, torch.tensor([[2.0, -0.5, 0.0]]))


def test_configs_have_spec_defaults_and_reject_bad_values():
    cfg = build(LossConfig, {})
    assert (cfg.icepop_beta, cfg.eps_low, cfg.eps_high, cfg.kl_coef) == (2.0, 0.2, 0.28, 0.0)
    assert cfg.keep_weight == "one" and cfg.aggregation == "token"
    opd = build(OPDConfig, {})
    assert (opd.form, opd.coef, opd.group_size, opd.batch_size) == ("sampled", 1.0, 1, 1024)
    with pytest.raises(ConfigError, match="icepop_beta"):
        build(LossConfig, {"icepop_beta": 0.5})
    with pytest.raises(ConfigError, match="keep_weight"):
        build(LossConfig, {"keep_weight": "both"})
