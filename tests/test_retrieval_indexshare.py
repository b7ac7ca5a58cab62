"""IndexShare's indexer target: a full layer's indexer fits the mean attention of every layer that uses its
top-k (its own and the shared layers after it), checked against a naive full-matrix computation."""
import pytest
import torch

from hf_reference import small_model
from orthon.midtrain.indexer_fit import AttentionInputs, indexer_recall, indexer_terms
from orthon.pretrain.attention import index_scores

pytestmark = pytest.mark.usefixtures("one_thread")


def _records(model, ids):
    probe = AttentionInputs(model)
    with torch.no_grad(), probe.recording():
        model.hidden_states(ids)
    probe.remove()
    return probe.take()


def _head_mean_probs(attn, rec):
    """(B, T, T) causal attention of one layer, expanded per head, averaged over heads."""
    x, B, T = rec.x, rec.x.shape[0], rec.x.shape[1]
    _, q_nope, q_rope, latent = attn.project(x, rec.cos, rec.sin)
    kv = attn.kv_b_proj(latent[..., : attn.rank]).view(B, T, attn.n_heads, attn.nope + attn.v_dim)
    k = torch.cat([kv[..., : attn.nope], latent[..., None, attn.rank :].expand(B, T, attn.n_heads, attn.rope)], -1)
    logits = torch.einsum("bthd,bshd->bhts", torch.cat([q_nope, q_rope], -1), k) * attn.scale
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).mean(1)


@torch.no_grad()
def test_full_indexer_fits_the_mean_attention_of_its_sharers():
    model = small_model("indexshare", initializer_range=0.2, query_chunk=7, sparse_attention=False).eval()
    k = model.config.index_topk
    ids = torch.randint(0, model.config.vocab_size, (2, 30))
    records = _records(model, ids)
    layers = model.model.layers
    assert [layers[r.layer].self_attn.indexer is not None for r in records] == [True, False, True, False]
    kl, recall, count, own_recall = 0.0, 0.0, 0, 0.0
    causal = torch.ones(30, 30, dtype=torch.bool).tril()
    for full, shared in ((records[0], records[1]), (records[2], records[3])):
        attn = layers[full.layer].self_attn
        own = _head_mean_probs(attn, full)
        target = (own + _head_mean_probs(layers[shared.layer].self_attn, shared)) / 2
        q_resid = attn.q_a_layernorm(attn.q_a_proj(full.x))
        qi, wi = attn.indexer.queries(full.x, q_resid, full.cos, full.sin)
        scores = index_scores(qi, wi, attn.indexer.keys(full.x, full.cos, full.sin), attn.indexer.scale)
        logq = torch.log_softmax(scores.masked_fill(~causal, float("-inf")), -1)
        kl += float(torch.where(causal, target * (target.clamp_min(1e-30).log() - logq), torch.zeros(())).sum())
        top = scores.masked_fill(~causal, float("-inf")).topk(k, dim=-1, sorted=True).indices[:, k:]  # t >= k
        recall += float(target[:, k:].gather(-1, top).sum())
        own_recall += float(own[:, k:].gather(-1, top).sum())
        count += top.shape[0] * top.shape[1]
    terms = indexer_terms(model, records, "dense")
    assert terms.queries == 2 * 2 * 30 and terms.recall_count == count
    assert float(terms.kl_sum) == pytest.approx(kl, rel=1e-4)
    assert terms.recall_sum == pytest.approx(recall, rel=1e-4)
    assert abs(terms.recall_sum - own_recall) > 1e-3  # the shared layers' attention is in the target
    # indexer_recall (what the evaluation reports) is the same group recall, with sparse attention on too.
    model.runtime.sparse_attention = True
    r = indexer_recall(model, ids)
    assert r["recall"] == pytest.approx(recall / count, rel=1e-4) and r["recall"] <= r["oracle_recall"] + 1e-6
