"""The mid-training objectives: hand-checked values, references, and the chunked cross-entropy's memory."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from orthon.pretrain.loss import chunked_cross_entropy
from orthon.midtrain.losses import (attention_distribution, indexer_kl, token_nll,
                                    topk_recall)


def test_attention_distribution_by_hand():
    # One query, two heads, three keys; key 2 invisible.
    logits = torch.tensor([[[[0.0, math.log(3.0), 5.0], [math.log(3.0), 0.0, -1.0]]]])  # (1, 1, 2, 3)
    visible = torch.tensor([[[True, True, False]]])
    dist = attention_distribution(logits, visible)
    # head 0: (1/4, 3/4), head 1: (3/4, 1/4); summed (1, 1), normalised (1/2, 1/2)
    torch.testing.assert_close(dist, torch.tensor([[[0.5, 0.5, 0.0]]]))


def test_attention_distribution_is_mean_of_head_softmaxes():
    logits = torch.randn(2, 5, 3, 7)
    visible = torch.rand(2, 5, 7) > 0.3
    visible[..., 0] = True
    dist = attention_distribution(logits, visible)
    expected = torch.softmax(logits.masked_fill(~visible[:, :, None], float("-inf")), -1).mean(2)
    torch.testing.assert_close(dist, expected)
    torch.testing.assert_close(dist.sum(-1), torch.ones(2, 5))


def test_indexer_kl_by_hand_and_against_kl_div():
    target = torch.tensor([[[0.5, 0.5, 0.0]]])
    scores = torch.tensor([[[0.0, math.log(3.0), 100.0]]])  # the invisible key's huge score must not count
    visible = torch.tensor([[[True, True, False]]])
    # prediction over the visible keys: (1/4, 3/4); KL = 0.5 ln 2 + 0.5 ln(2/3) = 0.5 ln(4/3)
    assert indexer_kl(target, scores, visible).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)

    target = torch.softmax(torch.randn(3, 4, 6), -1)
    scores = torch.randn(3, 4, 6, requires_grad=True)
    visible = torch.ones(3, 4, 6, dtype=torch.bool)
    ours = indexer_kl(target, scores, visible)
    ref = F.kl_div(torch.log_softmax(scores, -1), target, reduction="none").sum(-1)
    torch.testing.assert_close(ours, ref)
    # zero exactly where the prediction equals the target
    assert indexer_kl(target, target.log(), visible).abs().max() < 1e-6


def test_topk_recall_by_hand():
    target = torch.tensor([[[0.1, 0.6, 0.3, 0.0]]])
    indices = torch.tensor([[[1, 3]]])
    assert topk_recall(target, indices, torch.tensor([[[True, True]]])).item() == pytest.approx(0.6)
    indices = torch.tensor([[[2, 0]]])
    assert topk_recall(target, indices, torch.tensor([[[True, False]]])).item() == pytest.approx(0.3)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_cross_entropy_matches_full_and_never_holds_full_logits():
    B, T, D, V = 2, 24, 8, 50
    hidden = torch.randn(B, T, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    labels[0, :5] = -100
    ref = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    with _LargestTensor() as probe:
        ours = chunked_cross_entropy(hidden, weight, labels, chunk=7)
        grads = torch.autograd.grad(ours, (hidden, weight))
    torch.testing.assert_close(ours, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    # The largest tensor alive at any op: the (V, D) weight gradient or a 7 x V chunk of logits, never B*T x V.
    assert probe.largest <= max(7 * V, V * D, B * T * D) < B * T * V


def test_token_nll_per_position():
    hidden, weight = torch.randn(2, 9, 4), torch.randn(11, 4)
    labels = torch.randint(0, 11, (2, 9))
    labels[1, 3] = -100
    nll = token_nll(hidden, weight, labels, chunk=4)
    ref = F.cross_entropy((hidden @ weight.t()).transpose(1, 2), labels, ignore_index=-100, reduction="none")
    torch.testing.assert_close(nll, ref)
    assert nll[1, 3] == 0
