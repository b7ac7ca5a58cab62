"""The fused decode step computes what the model's cached forward computes, in every layer kind."""
import pytest
import torch

from hf_reference import randomize_router_bias, small_model
from orthon.engine.fused_decode import DecodeWeights

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    ("moe", dict(sparse_attention=False)),
    ("dsa", dict()),  # index_topk 8: most steps select
    ("indexshare", dict()),  # shared layers reuse the previous full layer's top-k
    ("moe", dict(n_routed_experts=8, n_group=4, topk_group=2, sparse_attention=True, index_topk=8)),
    ("moe", dict(n_shared_experts=0)),
]


def _model(case, **overrides):
    torch.manual_seed(0)
    model = small_model(case, **overrides).eval()
    randomize_router_bias(model)
    return model


def _left_padded(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(2, vocab, (n,), generator=g)
    pads = torch.tensor([width - n for n in lengths])
    slots = torch.arange(width)
    docs = torch.where(slots[None] < pads[:, None], -1, 0)
    return ids, pads, docs, (slots[None] - pads[:, None]).clamp(min=0)


@pytest.mark.parametrize("case,overrides", CASES)
@pytest.mark.parametrize("lengths", [(5,), (3, 9, 14, 6, 2, 11, 7, 4)])  # one row: sparse experts; eight: all at once
def test_fused_step_equals_the_cached_forward(case, overrides, lengths):
    model = _model(case, **overrides)
    fused = DecodeWeights(model)
    ids, pads, docs, positions = _left_padded(lengths, model.config.vocab_size)
    B, width = ids.shape
    steps = 16
    with torch.no_grad():
        ref_cache, fused_cache = model.new_cache(B, width + steps), model.new_cache(B, width + steps)
        for cache in (ref_cache, fused_cache):
            hidden, _ = model.hidden_states(ids, cache, positions, doc_ids=docs)
        tokens = model.lm_head(hidden[:, -1]).argmax(-1)
        for step in range(steps):
            pos = (width + step - pads)[:, None]
            ref, _ = model.hidden_states(tokens[:, None], ref_cache, pos)
            got = fused.step(tokens, fused_cache, pos)
            torch.testing.assert_close(got, ref[:, -1], atol=2e-5, rtol=1e-5)
            tokens = model.lm_head(ref[:, -1]).argmax(-1)
    assert fused_cache.length == ref_cache.length == width + steps
    for a, b in zip(fused_cache.latent, ref_cache.latent):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_refresh_follows_new_weights():
    model = _model("dsa")
    fused = DecodeWeights(model)
    ids = torch.randint(2, model.config.vocab_size, (2, 12))

    def step():
        with torch.no_grad():
            cache = model.new_cache(2, 13)
            model.hidden_states(ids[:, :-1], cache)
            return fused.step(ids[:, -1], cache), model.hidden_states(ids)[0][:, -1]

    before, _ = step()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    stale, ref = step()
    assert (stale - ref).abs().max() > 1e-3  # the fused weights are copies: stale until refreshed
    assert fused.stale()
    fused.refresh()
    got, ref = step()
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    assert (got - before).abs().max() > 1e-3


def test_attention_bias_is_refused():
    with pytest.raises(ValueError, match="attention biases"):
        DecodeWeights(_model("moe", attention_bias=True))


def test_stale_after_any_in_place_change():
    model = _model("moe")
    fused = DecodeWeights(model)
    assert not fused.stale()
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj.add_(0.0)
    assert fused.stale()
    fused.refresh()
    assert not fused.stale()
