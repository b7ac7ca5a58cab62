"""RL's step plug-in: loss masks (masked tokens get no gradient and leave the normaliser), the KL to a
frozen reference model, checked against hand computations, and the split of an update over micro-batches
and data-parallel ranks (orthon.rl.dp_schedule) that leaves the gradient unchanged."""
import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch

from orthon.pretrain import GLMForCausalLM, ModelConfig
from orthon.rl.config import DPScheduleConfig, LossConfig
from orthon.rl.logprobs import sequence_log_probs
from orthon.rl.loss import icepop_token_loss
from orthon.rl.sample import Sample, SampleStatus
from orthon.rl.steps import PolicyStep
from pretrain_support import MODEL

pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(micro_size=64, world=1, rank=0):
    return SimpleNamespace(device=torch.device("cpu"), world=world, rank=rank, data_world=world, data_rank=rank,
                           cfg=SimpleNamespace(micro_batch_size=micro_size), autocast=contextlib.nullcontext)


def _model(seed=0):
    torch.manual_seed(seed)
    return GLMForCausalLM(ModelConfig(**MODEL))


def _sample(model, seed, mask, shift=0.1):
    """A sample whose rollout log-probs are the model's own, moved by up to ``shift`` (rho within IcePop's band)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 300, (5 + len(mask),), generator=g).tolist()
    with torch.no_grad():
        lp = sequence_log_probs(model, [tokens], [len(mask)]).log_probs[0]
    rollout = (lp + shift * (2 * torch.rand(len(mask), generator=g) - 1)).clamp(max=0.0)
    return Sample("p", tokens, response_length=len(mask), loss_mask=list(mask), rollout_log_probs=rollout,
                  reward=1.0, status=SampleStatus.COMPLETED)


def _step_grads(model, step, batch, micro_size, world=1, rank=0):
    """One rank's share of a step: (summed objective, gradients, the micro-batches it ran)."""
    model.zero_grad(set_to_none=True)
    trainer = _trainer(micro_size, world, rank)
    step.begin(trainer, batch)
    total, micros = 0.0, step.micro_batches(batch, micro_size, trainer.device)
    for micro in micros:
        objective, _ = step.loss(model, micro)
        objective.backward()
        total += float(objective.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, micros


def _hand_loss(model, batch, eps_low=0.2, eps_high=0.28):
    """The IcePop + clip loss written out over the kept tokens only (masked tokens dropped), token mean."""
    terms = []
    for sample, adv in batch:
        lp = sequence_log_probs(model, [sample.tokens], [sample.response_length]).log_probs[0]
        keep = torch.tensor(sample.loss_mask, dtype=torch.bool)
        rho = torch.exp(lp[keep] - sample.rollout_log_probs[keep])
        terms.append(-torch.minimum(rho * adv, rho.clamp(1 - eps_low, 1 + eps_high) * adv))
    return torch.cat(terms).sum() / sum(int(sum(s.loss_mask)) for s, _ in batch)


def test_masked_tokens_get_the_gradient_of_tokens_dropped_from_the_loss():
    model = _model()
    batch = [(_sample(model, 1, [1, 1, 0, 1, 0, 1, 1]), 1.3), (_sample(model, 2, [0, 1, 1, 1, 0]), -0.7)]
    step = PolicyStep(LossConfig())
    value, grads, micros = _step_grads(model, step, batch, micro_size=1)  # one sample per micro-batch
    assert [len(m) for m in micros] == [1, 1]
    model.zero_grad(set_to_none=True)
    hand = _hand_loss(model, batch)
    hand.backward()
    assert value == pytest.approx(float(hand.detach()), rel=1e-6)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-8, msg=name)
    # The masks matter: the same samples with every token trained give another gradient.
    ones = [(Sample(s.instance_id, s.tokens, s.response_length, [1] * s.response_length, s.rollout_log_probs,
                    s.reward, status=s.status), a) for s, a in batch]
    _, grads_ones, _ = _step_grads(model, PolicyStep(LossConfig()), ones, micro_size=1)
    assert not torch.allclose(grads_ones["lm_head.weight"], grads["lm_head.weight"], rtol=1e-3)


def test_kl_to_the_reference_by_hand():
    kl_coef = 0.25
    model = _model()
    reference = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    batch = [(_sample(model, 3, [1, 1, 1, 0, 1, 1]), 0.8)]
    step = PolicyStep(LossConfig(kl_coef=kl_coef), reference=reference)
    value, grads, _ = _step_grads(model, step, batch, micro_size=4)
    sample, adv = batch[0]
    keep = torch.tensor(sample.loss_mask, dtype=torch.bool)
    model.zero_grad(set_to_none=True)
    lp = sequence_log_probs(model, [sample.tokens], [sample.response_length]).log_probs[0]
    with torch.no_grad():
        ref = sequence_log_probs(reference, [sample.tokens], [sample.response_length]).log_probs[0]
    d = ref - lp
    kl = torch.exp(d) - d - 1.0  # the k3 estimator of KL(pi_train || pi_ref), per token
    assert (kl[keep] > 0).all()
    hand = _hand_loss(model, batch) + kl_coef * kl[keep].sum() / int(keep.sum())
    hand.backward()
    assert value == pytest.approx(float(hand.detach()), rel=1e-6)
    torch.testing.assert_close(grads["lm_head.weight"], model.lm_head.weight.grad, rtol=1e-5, atol=1e-8)


def test_kl_gradient_per_token_by_hand():
    """d loss / d logp_t of the KL term is kl_coef * (1 - exp(logp_ref - logp_t)) / n on trained tokens."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    token_loss, _ = icepop_token_loss(logp, logp.detach(), torch.zeros(1), mask, kl_coef=0.5, logp_ref=ref)
    (token_loss.sum() / mask.sum()).backward()
    expected = 0.5 * (1 - torch.exp(ref - logp.detach())) * mask / 3
    torch.testing.assert_close(logp.grad, expected)


def test_kl_needs_a_reference():
    with pytest.raises(ValueError, match="reference"):
        PolicyStep(LossConfig(kl_coef=0.1)).begin(None, [])


def test_micro_batches_and_ranks_leave_the_gradient_unchanged():
    # Seven samples of 8-16 tokens. One micro-batch of everything, micro-batches of at most 40 padded
    # tokens, and the same split over 2 ranks (each rank's objective is times the world size, as DDP
    # averages): the same gradient every way, and every sample trained exactly once.
    model = _model()
    masks = [[1] * n for n in (3, 11, 5, 8, 2, 9, 6)]
    batch = [(_sample(model, 10 + i, m), 0.3 * i - 0.9) for i, m in enumerate(masks)]
    whole_value, whole, micros = _step_grads(model, PolicyStep(LossConfig()), batch, micro_size=64)
    assert len(micros) == 1 and len(micros[0]) == 7
    capped = DPScheduleConfig(micro_batch_tokens=40)
    value, grads, micros = _step_grads(model, PolicyStep(LossConfig(), dp_schedule=capped), batch, micro_size=64)
    lengths = [[len(s.tokens) for s, _ in m] for m in micros]
    assert len(micros) > 2 and all(len(m) * max(m) <= 40 for m in lengths)
    assert sorted(n for m in lengths for n in m) == sorted(len(s.tokens) for s, _ in batch)
    assert value == pytest.approx(whole_value, rel=1e-5)
    for name in whole:
        torch.testing.assert_close(grads[name], whole[name], rtol=1e-4, atol=1e-7, msg=name)
    shares = [_step_grads(model, PolicyStep(LossConfig(), dp_schedule=capped), batch, 64, world=2, rank=r)
              for r in (0, 1)]
    assert len(shares[0][2]) == len(shares[1][2])  # DDP: every rank runs as many backward passes
    ran = sorted(s.instance_id + str(s.tokens) for _, _, ms in shares for m in ms for s, _ in m)
    assert ran == sorted(s.instance_id + str(s.tokens) for s, _ in batch)
    for name in whole:
        torch.testing.assert_close((shares[0][1][name] + shares[1][1][name]) / 2, whole[name], rtol=1e-4, atol=1e-7)


def test_a_rank_without_samples_runs_one_at_weight_zero():
    # One sample, two ranks: rank 1 has none, yet must run a forward and backward (DDP's all-reduce
    # waits for every rank); its gradient is zero everywhere, and rank 0 alone gives the whole gradient.
    model = _model()
    batch = [(_sample(model, 20, [1, 1, 0, 1]), 1.0)]
    _, whole, _ = _step_grads(model, PolicyStep(LossConfig()), batch, 64)
    step = PolicyStep(LossConfig())
    value, empty, micros = _step_grads(model, step, batch, 64, world=2, rank=1)
    assert micros == [[]] and value == 0.0 and empty
    assert all(float(g.abs().max()) == 0.0 for g in empty.values())
    _, first, micros = _step_grads(model, PolicyStep(LossConfig()), batch, 64, world=2, rank=0)
    assert [len(m) for m in micros] == [1]
    for name in whole:
        torch.testing.assert_close(first[name] / 2, whole[name], rtol=1e-5, atol=1e-8)
