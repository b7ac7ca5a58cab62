"""Attention-head diagnostics: the probabilities equal the layer's own attention, and the scores give
hand-checked values on planted patterns."""
import pytest
import torch

from hf_reference import small_config
from orthon.midtrain.heads import (induction_score, layer_attention, previous_token_score,
                                   topk_mass, uniform_induction_score, uniform_previous_token_score)
from orthon.midtrain.indexer_fit import AttentionInputs
from orthon.pretrain.model import GLMForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")


def test_probabilities_reproduce_the_layers_attention_output():
    torch.manual_seed(0)
    model = GLMForCausalLM(small_config("moe")).eval()
    ids = torch.randint(0, 257, (2, 24))
    recorder = AttentionInputs(model)
    with torch.no_grad(), recorder.recording():
        model(ids)
    records = recorder.take()
    probs = layer_attention(model, ids)
    assert len(probs) == len(records) == 3
    for r, p in zip(records, probs):
        attn = model.model.layers[r.layer].self_attn
        _, q_nope, q_rope, latent = attn._project(r.x, r.cos, r.sin)
        B, T, H, _ = q_nope.shape
        v = attn.kv_b_proj(latent[..., : attn.rank]).view(B, T, H, attn.nope + attn.v_dim)[..., attn.nope :]
        with torch.no_grad():
            expected = attn._expanded(q_nope, q_rope, latent, None)  # (B, T, H, v): the layer's SDPA path
        assert p.shape == (2, 4, 24, 24)
        torch.testing.assert_close(p.sum(-1), torch.ones(2, 4, 24))
        assert float(p.triu(1).abs().max()) == 0.0  # causal
        torch.testing.assert_close(torch.einsum("bhts,bshv->bthv", p, v.float()), expected.float(), rtol=1e-4, atol=1e-5)


def _uniform(T):
    return torch.ones(T, T).tril().div(torch.arange(1, T + 1)[:, None])[None, None]


def test_scores_of_planted_heads():
    T, half = 12, 6
    prev = torch.zeros(1, 1, T, T)
    prev[0, 0, 0, 0] = 1.0
    prev[0, 0, torch.arange(1, T), torch.arange(T - 1)] = 1.0
    assert float(previous_token_score(prev)[0]) == 1.0
    uniform = _uniform(T)
    # 1/2, 1/3, ..., 1/12 averaged over the 11 queries with a previous token
    assert float(previous_token_score(uniform)[0]) == pytest.approx(sum(1 / k for k in range(2, 13)) / 11)
    assert uniform_previous_token_score(T) == pytest.approx(float(previous_token_score(uniform)[0]))
    induction = uniform.clone()
    for t in range(half + 1, T):
        induction[0, 0, t] = 0.0
        induction[0, 0, t, t - half + 1] = 1.0
    two = torch.cat([uniform, induction], dim=1)  # head 0 uniform, head 1 an induction head
    score = induction_score(two, half)
    assert float(score[1]) == 1.0
    assert float(score[0]) == pytest.approx(uniform_induction_score(half)) == pytest.approx((1 / 8 + 1 / 9 + 1 / 10 + 1 / 11 + 1 / 12) / 5)
    assert float(previous_token_score(two)[1]) < 0.5


def test_topk_mass_hand_checked():
    # Two heads over 4 keys; the queries t = 2 and t = 3 see more than k = 2 keys and are counted.
    a = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.2, 0.2, 0.6, 0], [0.1, 0.1, 0.1, 0.7]])
    b = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.6, 0.2, 0.2, 0], [0.7, 0.1, 0.1, 0.1]])
    probs = torch.stack([a, b])[None]
    # head-summed rows: t=2 -> (0.4, 0.2, 0.4) top-2 0.8; t=3 -> (0.4, 0.1, 0.1, 0.4) top-2 0.8
    assert topk_mass(probs, 2) == pytest.approx(0.8)
    assert topk_mass(probs, 4) == 1.0
