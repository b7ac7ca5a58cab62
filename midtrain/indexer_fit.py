"""DSA adaptation: fit each lightning indexer to its layer's own attention.

The model's forward does not return attention probabilities (its dense path is fused SDPA), so forward
hooks on every MLAttention record the layer's input (and the top-k it used); the attention logits are
then recomputed here in MLA's absorbed form (queries folded into the latent space, keys = the per-token
latent), from the layer's own projections and the absorbed-attention functions of
``orthon.pretrain.attention``. The indexer runs on the *detached* layer input, so its KL
trains the indexer alone and never reaches the main model.

With IndexShare, a full layer's top-k also serves the "shared" layers after it, so its indexer fits
the mean of their attention distributions and its own (each summed over heads and normalised): a
target of its own layer alone leaves a shared layer whose attention differs (a previous-token layer
before an induction layer, say) without the keys it reads.

Memory: everything goes query chunk by query chunk, each chunk checkpointed: phase 1 holds
chunk x S logits at a time (per layer of the group), phase 2 chunk x k.

Training computes the same terms inside the forward, from the same pieces (``layer_target``,
``indexer_outputs``, ``group_terms``): orthon.midtrain.indexer_objective. The recorded path here serves
the evaluation (``indexer_recall``), the head probes and the tests.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from orthon.midtrain.losses import attention_distribution, indexer_kl, topk_recall
from orthon.pretrain.attention import (MLAttention, causal_mask, document_mask, gather_rows, index_scores,
                                      latent_scores)
from orthon.pretrain.topk import deterministic_topk

_FORWARD = inspect.signature(MLAttention.forward)


@dataclass
class LayerInput:
    layer: int
    x: torch.Tensor  # (B, T, hidden) attention input (after input_layernorm), detached
    cos: torch.Tensor
    sin: torch.Tensor
    q_slots: torch.Tensor
    doc_ids: torch.Tensor | None
    topk: torch.Tensor | None  # (B, T, k) keys the layer attended to; None: dense
    context: object = None  # the layer's ContextShard under context parallelism: x holds q_slots' positions

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every position's rows of the per-token t (this rank's alone without context parallelism)."""
        return t if self.context is None else self.context.gather(t)

    @property
    def key_docs(self) -> torch.Tensor | None:
        return self.doc_ids if self.context is None else self.context.key_docs


def layer_input(module: MLAttention, args, kwargs, output) -> LayerInput:
    """The record of an MLAttention forward (from a forward hook's arguments)."""
    bound = _FORWARD.bind(module, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if a["cache"] is not None:
        raise RuntimeError("recording a KV-cached attention forward is not supported")
    return LayerInput(module.layer, a["x"].detach(), a["cos"], a["sin"], a["q_slots"], a["doc_ids"], output[1],
                      a["context"])


class AttentionInputs:
    """Records every attention layer's input while ``recording()`` is active (not during the recompute
    of activation checkpointing, which runs the layers again in backward). With ``on_record`` each
    record is handed to it as the layer runs and not kept, so that a caller can reduce it at once."""

    def __init__(self, model: torch.nn.Module, on_record=None):
        self.active = False
        self.on_record = on_record
        self.records: list[LayerInput] = []
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True)
                        for m in model.modules() if isinstance(m, MLAttention)]

    def _hook(self, module, args, kwargs, output):
        if not self.active:
            return
        record = layer_input(module, args, kwargs, output)
        if self.on_record is not None:
            self.on_record(record)
        else:
            self.records.append(record)

    @contextmanager
    def recording(self):
        self.records, self.active = [], True
        try:
            yield self
        finally:
            self.active = False

    def take(self) -> list[LayerInput]:
        records, self.records = self.records, []
        return records

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclass
class IndexerTerms:
    kl_sum: torch.Tensor  # sum of per-query KLs over layers and queries (differentiable in the indexers)
    queries: int  # (layer, query) pairs in kl_sum
    recall_sum: float = 0.0  # phase 1: summed recall over queries with more than k visible keys
    recall_count: int = 0
    oracle_sum: float = 0.0  # phase 1: summed best-possible recall (the target's own top-k mass)


# ---------------------------------------------------------------- per-layer pieces
def _target(q_abs: tuple, latent: tuple, visible, scale):
    """The distribution an indexer fits over the keys of ``latent``: the mean, over the layers that use
    its top-k (its own first), of each layer's attention summed over heads and normalised."""
    dists = [attention_distribution(latent_scores(q, lat, scale), visible) for q, lat in zip(q_abs, latent)]
    return dists[0] if len(dists) == 1 else torch.stack(dists).mean(dim=0)


def _visible(slots, num_keys, q_docs, k_docs):
    if k_docs is None:
        return causal_mask(slots, num_keys)[None]
    return document_mask(q_docs, k_docs, slots)


def _dense_chunk(q_abs: tuple, latent: tuple, q_idx, w_idx, k_idx, visible, scale, idx_scale, topk: int):
    """Phase 1 on one query chunk: (KL sum, recall sum, oracle recall sum, queries counted for recall).
    ``q_abs`` / ``latent``: one entry per layer using the top-k (``_target``). The oracle is the mass on
    the target's own top-k: the best recall any k keys can reach."""
    with torch.no_grad():
        target = _target(q_abs, latent, visible, scale)
    scores = index_scores(q_idx, w_idx, k_idx, idx_scale)
    kl = indexer_kl(target, scores, visible).sum()
    with torch.no_grad():
        vis = visible.expand_as(scores)
        chosen = deterministic_topk(scores.detach().masked_fill(~vis, float("-inf")), topk)  # the model's rule
        counted = vis.sum(-1) > topk
        recall = topk_recall(target, chosen, vis.gather(-1, chosen))
        recall_sum = recall.masked_fill(~counted, 0.0).sum()
        oracle = target.topk(min(topk, target.shape[-1]), dim=-1).values.sum(-1)
        oracle_sum = oracle.masked_fill(~counted, 0.0).sum()
    return kl, recall_sum, oracle_sum, counted.sum()


def _sparse_chunk(q_abs: tuple, latent: tuple, q_idx, w_idx, k_idx, idx, sel_visible, scale, idx_scale):
    """Phase 2 on one query chunk: KL over the selected keys."""
    with torch.no_grad():
        target = _target(q_abs, tuple(gather_rows(lat, idx) for lat in latent), sel_visible, scale)
    picked = gather_rows(k_idx, idx)  # (B, C, k, d), differentiable in the indexer's key projection
    relu = torch.relu(torch.einsum("bcnd,bckd->bcnk", q_idx.float(), picked.float()) * idx_scale)
    scores = torch.einsum("bcn,bcnk->bck", w_idx.float(), relu)
    return indexer_kl(target, scores, sel_visible).sum()


def layer_target(attn: MLAttention, rec: LayerInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_abs, latent, q_resid) of a recorded layer, no gradient: its absorbed queries (this rank's
    positions), the latent of every position (gathered under context parallelism) and the normed q_a
    output the indexer's queries start from."""
    with torch.no_grad():
        q_abs, latent, q_resid = attn.absorbed_queries(rec.x, rec.cos, rec.sin)
        return q_abs, rec.gather(latent), q_resid


def indexer_outputs(attn: MLAttention, x, q_resid, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_idx, w_idx, k_idx) of this rank's positions, differentiable in the indexer's parameters."""
    q_idx, w_idx = attn.indexer.queries(x, q_resid, cos, sin)
    return q_idx, w_idx, attn.indexer.keys(x, cos, sin)


def group_terms(rec: LayerInput, targets: list, q_idx, w_idx, k_idx, mode: str, chunk: int, topk: int,
                scale: float, idx_scale: float) -> IndexerTerms:
    """The indexer objective of one full-indexer layer from its pieces (no parameter read here): ``targets``
    the (q_abs, latent) of the layers that use its top-k (its own first, then IndexShare's sharers), the
    indexer's queries, head weights and keys (every position's), query chunk by query chunk. mode
    "dense": KL over all visible keys (phase 1, with recall); "sparse": KL over the keys the layer
    selected (phase 2)."""
    B, T = q_idx.shape[:2]
    latent, k_docs = targets[0][1], rec.key_docs
    S = latent.shape[1]
    kl = q_idx.new_zeros((), dtype=torch.float32)
    recall_sum, oracle_sum = q_idx.new_zeros((), dtype=torch.float32), q_idx.new_zeros((), dtype=torch.float32)
    recall_count = q_idx.new_zeros((), dtype=torch.long)
    use_sparse = mode == "sparse" and rec.topk is not None
    for start in range(0, T, chunk):
        c = slice(start, start + chunk)
        slots = rec.q_slots[c]
        q_docs = None if rec.doc_ids is None else rec.doc_ids[:, c]
        queries, latents = tuple(q[:, c] for q, _ in targets), tuple(lat for _, lat in targets)
        if use_sparse:
            idx = rec.topk[:, c]
            sel_visible = idx <= slots[None, :, None]
            if k_docs is not None:
                sel_visible = sel_visible & (k_docs.gather(1, idx.reshape(B, -1)).view_as(idx) == q_docs[..., None])
            kl = kl + torch.utils.checkpoint.checkpoint(
                _sparse_chunk, queries, latents, q_idx[:, c], w_idx[:, c], k_idx, idx, sel_visible, scale, idx_scale,
                use_reentrant=False)
        else:
            visible = _visible(slots, S, q_docs, k_docs)
            part, r_sum, o_sum, r_count = torch.utils.checkpoint.checkpoint(
                _dense_chunk, queries, latents, q_idx[:, c], w_idx[:, c], k_idx, visible, scale, idx_scale, topk,
                use_reentrant=False)
            kl = kl + part
            recall_sum, oracle_sum, recall_count = recall_sum + r_sum, oracle_sum + o_sum, recall_count + r_count
    return IndexerTerms(kl, B * T, float(recall_sum), int(recall_count), float(oracle_sum))


def layer_terms(attn: MLAttention, rec: LayerInput, mode: str, chunk: int,
                sharers: list[tuple[MLAttention, LayerInput]] = ()) -> IndexerTerms:
    """The indexer objective of one full-indexer layer from recorded inputs (``group_terms``), its
    indexer run on the detached input so the KL never reaches the main model. ``sharers``: the
    IndexShare layers that reuse its top-k (with their recorded inputs), whose attention joins the target."""
    q_abs, latent, q_resid = layer_target(attn, rec)
    targets = [(q_abs, latent)] + [layer_target(a, r)[:2] for a, r in sharers]
    q_idx, w_idx, k_idx = indexer_outputs(attn, rec.x, q_resid, rec.cos, rec.sin)
    return group_terms(rec, targets, q_idx, w_idx, rec.gather(k_idx), mode, chunk, attn.config.index_topk,
                       attn.scale, attn.indexer.scale)


def add_terms(a: IndexerTerms | None, b: IndexerTerms) -> IndexerTerms:
    if a is None:
        return b
    return IndexerTerms(a.kl_sum + b.kl_sum, a.queries + b.queries, a.recall_sum + b.recall_sum,
                        a.recall_count + b.recall_count, a.oracle_sum + b.oracle_sum)


def indexer_terms(model, records: list[LayerInput], mode: str) -> IndexerTerms:
    """Sum of layer_terms over the layers that run their own indexer, each with the IndexShare layers
    that reuse its top-k (the records are in layer order, as the forward made them)."""
    layers = model.model.layers
    chunk = model.runtime.query_chunk
    groups: list[tuple[MLAttention, LayerInput, list]] = []
    for rec in records:
        attn = layers[rec.layer].self_attn
        if attn.indexer is not None:
            groups.append((attn, rec, []))
        elif groups:  # IndexShare: this layer reuses the previous full layer's top-k
            groups[-1][2].append((attn, rec))
    total = None
    for attn, rec, sharers in groups:
        total = add_terms(total, layer_terms(attn, rec, mode, chunk, sharers))
    if total is None:
        raise RuntimeError("indexer_terms: no layer with an indexer was recorded")
    return total


@torch.no_grad()
def indexer_recall(model, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> dict:
    """Share of dense attention mass (summed over heads, normalised) on each indexer's top-k, over the
    queries with more than index_topk visible keys; also the mean KL. Runs the model densely."""
    sparse, training = model.runtime.sparse_attention, model.training
    model.runtime.sparse_attention = False
    model.eval()
    probe = AttentionInputs(model)
    try:
        with probe.recording():
            model.hidden_states(input_ids, doc_ids=doc_ids)
        terms = indexer_terms(model, probe.take(), "dense")
    finally:
        probe.remove()
        model.runtime.sparse_attention = sparse
        model.train(training)
    n = max(terms.recall_count, 1)
    return {"recall": terms.recall_sum / n, "oracle_recall": terms.oracle_sum / n,
            "kl": float(terms.kl_sum) / terms.queries, "queries": terms.recall_count}
