"""The DSA indexer objective against a naive full-matrix computation, gradient isolation, IndexShare
records, and phase 1 raising recall."""
import pytest
import torch

from hf_reference import small_model
from orthon.midtrain.indexer_fit import AttentionInputs, indexer_recall, indexer_terms, layer_terms
from orthon.pretrain.attention import index_scores


pytestmark = pytest.mark.usefixtures("one_thread")


def _record(model, ids, doc_ids=None):
    probe = AttentionInputs(model)
    with torch.no_grad(), probe.recording():
        model.hidden_states(ids, doc_ids=doc_ids)
    probe.remove()
    return probe.take()


def _naive(attn, rec, k):
    """Expanded per-head attention over the full T x S matrix, KL and recall without chunks."""
    x, B, T = rec.x, rec.x.shape[0], rec.x.shape[1]
    q_resid, q_nope, q_rope, latent = attn.project(x, rec.cos, rec.sin)
    kv = attn.kv_b_proj(latent[..., : attn.rank]).view(B, T, attn.n_heads, attn.nope + attn.v_dim)
    k_full = torch.cat([kv[..., : attn.nope], latent[..., None, attn.rank :].expand(B, T, attn.n_heads, attn.rope)], -1)
    q = torch.cat([q_nope, q_rope], -1)
    visible = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(B, T, T)
    if rec.doc_ids is not None:
        visible = visible & (rec.doc_ids[:, :, None] == rec.doc_ids[:, None, :])
    logits = torch.einsum("bthd,bshd->bhts", q, k_full) * attn.scale
    p = torch.softmax(logits.masked_fill(~visible[:, None], float("-inf")), -1).mean(1)
    qi, wi = attn.indexer.queries(x, q_resid, rec.cos, rec.sin)
    scores = index_scores(qi, wi, attn.indexer.keys(x, rec.cos, rec.sin), attn.indexer.scale)
    logq = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), -1)
    kl = torch.where(visible, p * (p.clamp_min(1e-30).log() - logq), torch.zeros(())).sum()
    recalls = []
    for b in range(B):
        for t in range(T):
            keys = visible[b, t].nonzero().flatten()
            if len(keys) <= k:
                continue
            top = keys[scores[b, t, keys].argsort(descending=True, stable=True)[:k]]
            recalls.append(float(p[b, t, top].sum()))
    return float(kl), sum(recalls), len(recalls)


@pytest.mark.parametrize("docs", [False, True])
def test_phase1_terms_match_naive_full_matrix(docs):
    model = small_model("dsa", initializer_range=0.2, query_chunk=7, sparse_attention=False).eval()
    config = model.config
    ids = torch.randint(0, config.vocab_size, (2, 30))
    doc_ids = torch.tensor([[0] * 12 + [1] * 18, [0] * 30]) if docs else None
    records = _record(model, ids, doc_ids)
    assert [r.layer for r in records] == [0, 1, 2]
    for rec in records:
        attn = model.model.layers[rec.layer].self_attn
        with torch.no_grad():
            terms = layer_terms(attn, rec, "dense", chunk=7)
            kl, recall_sum, recall_count = _naive(attn, rec, config.index_topk)
        assert terms.queries == 60
        assert float(terms.kl_sum) == pytest.approx(kl, rel=1e-4)
        assert terms.recall_count == recall_count > 0
        assert terms.recall_sum == pytest.approx(recall_sum, rel=1e-4)


def test_phase2_over_every_key_equals_phase1_and_grads_reach_only_indexers():
    model = small_model("dsa", initializer_range=0.2, query_chunk=8)
    config = model.config
    T = 20
    records = _record(model, torch.randint(0, config.vocab_size, (2, T)))
    rec = records[0]
    attn = model.model.layers[0].self_attn
    dense = layer_terms(attn, rec, "dense", chunk=8)
    rec.topk = torch.arange(T).expand(2, T, T)  # "select" every key: invisible ones are masked out
    sparse = layer_terms(attn, rec, "sparse", chunk=8)
    torch.testing.assert_close(sparse.kl_sum, dense.kl_sum, rtol=1e-5, atol=1e-7)
    (sparse.kl_sum + dense.kl_sum).backward()
    for name, p in model.named_parameters():
        if ".indexer." in name and name.startswith("model.layers.0."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None or p.grad.abs().sum() == 0, f"{name} got a gradient from the indexer KL"


def test_shared_layers_reuse_topk_and_are_skipped():
    model = small_model("indexshare", query_chunk=16).eval()
    config = model.config
    records = _record(model, torch.randint(0, config.vocab_size, (1, 40)))
    assert [r.topk is not None for r in records] == [True] * 4
    assert torch.equal(records[1].topk, records[0].topk) and torch.equal(records[3].topk, records[2].topk)
    assert not torch.equal(records[2].topk, records[0].topk)
    terms = indexer_terms(model, records, "sparse")
    assert terms.queries == 2 * 40  # two full layers of 40 queries


def test_phase1_training_raises_recall_to_090():
    """Fit the indexers alone (as phase 1 does) on a model with concentrated attention: recall goes from
    chance (about k over the causal keys) to at least 0.9, the KL falls, the frozen model is untouched."""
    torch.manual_seed(0)
    model = small_model("dsa", initializer_range=0.5, index_topk=8, query_chunk=64, sparse_attention=False,
                        num_hidden_layers=2, first_k_dense_replace=2)
    config = model.config
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".indexer." not in n}
    params = [p for i in model.indexers() for p in i.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    ids = torch.randint(0, config.vocab_size, (2, 64))
    before = indexer_recall(model, ids)
    chance = sum(8 / (t + 1) for t in range(8, 64)) / 56  # k random keys of t + 1
    probe = AttentionInputs(model)
    for _ in range(70):
        with torch.no_grad(), probe.recording():
            model.hidden_states(ids)
        terms = indexer_terms(model, probe.take(), "dense")
        (terms.kl_sum / terms.queries).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = indexer_recall(model, ids)
    assert before["oracle_recall"] == pytest.approx(after["oracle_recall"])  # the model's attention is fixed
    assert after["oracle_recall"] > 0.95  # concentrated: top-k of the target holds nearly all of it
    assert before["recall"] < 1.5 * chance, (before, chance)
    assert after["recall"] >= 0.9, after
    assert after["kl"] < 0.05 * before["kl"]
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
