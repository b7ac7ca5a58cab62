"""Attention-head diagnostics: the probabilities equal the layer's own attention whatever the query
chunking, and the scores give hand-checked values on planted patterns."""
import pytest
import torch
import torch.nn.functional as F

from hf_reference import small_config
from orthon.midtrain.heads import (attention_rows, best_head, induction_probs, layer_scores, previous_token_probs,
                                   topk_masses, uniform_induction_score, uniform_previous_token_score)
from orthon.midtrain.indexer_fit import AttentionInputs
from orthon.pretrain.model import GLMForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")


def _model_and_records(T=24):
    torch.manual_seed(0)
    model = GLMForCausalLM(small_config("moe")).eval()
    ids = torch.randint(0, 257, (2, T))
    recorder = AttentionInputs(model)
    with torch.no_grad(), recorder.recording():
        model(ids)
    return model, ids, recorder.take()


def test_chunked_rows_reproduce_the_layers_attention_output():
    model, _, records = _model_and_records()
    assert len(records) == 3
    for r in records:
        attn = model.model.layers[r.layer].self_attn
        # 2 x 4 heads x 24 keys x 4 bytes = 768 bytes a query: a budget of 5 queries' rows
        chunks = list(attention_rows(attn, r.x, r.cos, r.sin, budget_bytes=5 * 768))
        assert [q0 for q0, _ in chunks] == [0, 5, 10, 15, 20]
        p = torch.cat([F.pad(rows, (0, 24 - rows.shape[-1])) for _, rows in chunks], dim=2)
        _, q_nope, q_rope, latent = attn.project(r.x, r.cos, r.sin)
        B, T, H, _ = q_nope.shape
        v = attn.kv_b_proj(latent[..., : attn.rank]).view(B, T, H, attn.nope + attn.v_dim)[..., attn.nope :]
        with torch.no_grad():
            expected = attn._expanded(q_nope, q_rope, latent, None)  # (B, T, H, v): the layer's SDPA path
        assert p.shape == (2, 4, 24, 24)
        torch.testing.assert_close(p.sum(-1), torch.ones(2, 4, 24))
        assert float(p.triu(1).abs().max()) == 0.0  # causal
        torch.testing.assert_close(torch.einsum("bhts,bshv->bthv", p, v.float()), expected.float(), rtol=1e-4, atol=1e-5)


def test_layer_scores_do_not_depend_on_the_chunking():
    model, ids, _ = _model_and_records()
    whole = layer_scores(model, ids, k=4, half=12)
    chunked = layer_scores(model, ids, k=4, half=12, budget_bytes=3 * 768)
    assert len(whole) == 3 and set(whole[0]) == {"previous_token", "induction", "topk_mass"}
    for a, b in zip(whole, chunked):
        assert a == pytest.approx(b, rel=1e-6)
        assert 0.0 < a["previous_token"] < 1.0 and 4 / 24 < a["topk_mass"] <= 1.0


def _uniform(T):
    return torch.ones(T, T).tril().div(torch.arange(1, T + 1)[:, None])[None, None]


def _chunks(probs, size):
    return [(q0, probs[:, :, q0 : q0 + size, : q0 + size]) for q0 in range(0, probs.shape[2], size)]


def test_scores_of_planted_heads():
    T, half = 12, 6
    prev = torch.zeros(1, 1, T, T)
    prev[0, 0, 0, 0] = 1.0
    prev[0, 0, torch.arange(1, T), torch.arange(T - 1)] = 1.0
    assert best_head([previous_token_probs(prev)]) == 1.0
    uniform = _uniform(T)
    # 1/2, 1/3, ..., 1/12 averaged over the 11 queries with a previous token
    assert best_head([previous_token_probs(uniform)]) == pytest.approx(sum(1 / k for k in range(2, 13)) / 11)
    assert uniform_previous_token_score(T) == pytest.approx(best_head([previous_token_probs(uniform)]))
    induction = uniform.clone()
    for t in range(half + 1, T):
        induction[0, 0, t] = 0.0
        induction[0, 0, t, t - half + 1] = 1.0
    two = torch.cat([uniform, induction], dim=1)  # head 0 uniform, head 1 an induction head
    per_head = induction_probs(two, half).mean(dim=(0, 2))
    assert float(per_head[1]) == 1.0
    assert float(per_head[0]) == pytest.approx(uniform_induction_score(half)) == pytest.approx((1 / 8 + 1 / 9 + 1 / 10 + 1 / 11 + 1 / 12) / 5)
    assert float(previous_token_probs(two).mean(dim=(0, 2))[1]) < 0.5
    # The same values, query chunk by query chunk (chunks of 5 split the repeat's queries 7..11).
    for fn in (previous_token_probs, lambda rows, q0=0: induction_probs(rows, half, q0)):
        whole = fn(two)
        torch.testing.assert_close(torch.cat([fn(rows, q0) for q0, rows in _chunks(two, 5)], dim=-1), whole)


def test_topk_mass_hand_checked():
    # Two heads over 4 keys; the queries t = 2 and t = 3 see more than k = 2 keys and are counted.
    a = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.2, 0.2, 0.6, 0], [0.1, 0.1, 0.1, 0.7]])
    b = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.6, 0.2, 0.2, 0], [0.7, 0.1, 0.1, 0.1]])
    probs = torch.stack([a, b])[None]
    # head-averaged rows: t=2 -> (0.4, 0.2, 0.4) top-2 0.8; t=3 -> (0.4, 0.1, 0.1, 0.4) top-2 0.8
    torch.testing.assert_close(topk_masses(probs, 2), torch.tensor([[0.8, 0.8]]))
    torch.testing.assert_close(torch.cat([topk_masses(rows, 2, q0) for q0, rows in _chunks(probs, 3)], dim=-1),
                               torch.tensor([[0.8, 0.8]]))
    assert topk_masses(probs, 4).numel() == 0  # no query sees more than 4 keys
