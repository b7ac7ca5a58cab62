"""Deterministic top-k: total order on (score, -position)."""
import torch

from orthon.pretrain.topk import deterministic_topk, ordered_key


def test_hand_checked_ties_go_to_lower_position():
    scores = torch.tensor([[0.0, 3.0, 0.0, 3.0, -1.0, 0.0]])
    assert deterministic_topk(scores, 1).tolist() == [[1]]
    assert deterministic_topk(scores, 2).tolist() == [[1, 3]]
    assert deterministic_topk(scores, 4).tolist() == [[1, 3, 0, 2]]
    assert deterministic_topk(scores, 6).tolist() == [[1, 3, 0, 2, 5, 4]]


def test_negative_zero_ties_with_zero_and_negatives_order_correctly():
    scores = torch.tensor([[-0.0, 0.0, -2.5, -1e-30, float("-inf"), 7.0]])
    assert deterministic_topk(scores, 6).tolist() == [[5, 0, 1, 3, 2, 4]]
    keys = ordered_key(torch.tensor([-3.0, -1.0, -1e-20, 0.0, 1e-20, 1.0, 3.0]))
    assert torch.all(keys[1:] > keys[:-1])


def test_matches_stable_descending_sort_and_is_repeatable():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (64, 300), generator=g).float() / 2  # many ties
    expected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :37]
    for _ in range(3):
        assert torch.equal(deterministic_topk(scores, 37), expected)
