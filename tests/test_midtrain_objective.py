"""The indexer KL computed inside the forward (orthon.midtrain.indexer_objective) against the same KL
computed after it from recorded inputs: the value, and the indexers' gradients delivered by the surrogate
added to the objective, with IndexShare groups, activation checkpointing, the main model's gradients
untouched by the KL, and no backward through a frozen main model (phase 1)."""
import pytest
import torch

from hf_reference import small_model
from orthon.midtrain.indexer_fit import AttentionInputs, indexer_terms
from orthon.midtrain.indexer_objective import IndexerObjective
from orthon.midtrain.optimizer import is_indexer_param

pytestmark = pytest.mark.usefixtures("one_thread")

SCALE = 0.37  # what the step multiplies the KL sum by (world / queries); any number checks the scaling


def _model(mode, checkpointing):
    torch.manual_seed(0)
    model = small_model("indexshare", initializer_range=0.2, query_chunk=7, sparse_attention=mode == "sparse",
                        activation_checkpointing=checkpointing)
    return model.train()


def _grads(model, keep):
    return {n: p.grad.clone() for n, p in model.named_parameters() if keep(n) and p.grad is not None}


def _reference(mode, ids, labels):
    """The post-forward KL (recorded inputs, then indexer_terms) and its indexer gradients (x SCALE), and
    the LM loss's gradients of the main model alone."""
    model = _model(mode, False)
    probe = AttentionInputs(model)
    with probe.recording():
        lm = model(ids, labels=labels).loss
    terms = indexer_terms(model, probe.take(), mode)
    probe.remove()
    (terms.kl_sum * SCALE).backward()
    indexer = _grads(model, is_indexer_param)
    model.zero_grad()
    lm.backward()
    return float(terms.kl_sum.detach()), terms.recall_sum, indexer, _grads(model, lambda n: not is_indexer_param(n))


@pytest.mark.parametrize("mode", ["dense", "sparse"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_in_forward_kl_equals_the_post_forward_one(mode, checkpointing):
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    kl, recall, want_indexer, want_main = _reference(mode, ids, labels)

    model = _model(mode, checkpointing)
    objective = IndexerObjective(model)
    with objective.recording(mode, SCALE):
        lm = model(ids, labels=labels).loss
    objective.remove()
    assert float(objective.terms.kl_sum) == pytest.approx(kl, rel=1e-5)
    assert objective.terms.recall_sum == pytest.approx(recall, rel=1e-5)
    assert objective.terms.queries == 2 * 2 * 30  # two full layers, 2 x 30 queries each
    (lm + objective.surrogate).backward()
    got_indexer = _grads(model, is_indexer_param)
    assert sorted(got_indexer) == sorted(want_indexer) and len(got_indexer) == 2 * 5  # wq_b, wk, k_norm (2), weights_proj
    for name, want in want_indexer.items():
        torch.testing.assert_close(got_indexer[name], want, rtol=1e-4, atol=1e-7, msg=name)
    # The main model's gradients are the LM loss's alone: no KL reaches it.
    got_main = _grads(model, lambda n: not is_indexer_param(n))
    assert sorted(got_main) == sorted(want_main)
    for name, want in want_main.items():
        torch.testing.assert_close(got_main[name], want, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_frozen_main_model_runs_no_backward_through_its_layers(checkpointing):
    """Phase 1: the main model frozen, the LM loss builds no graph and the surrogate's backward gives the
    indexers their gradients without running a layer again (activation checkpointing recomputes a layer's
    forward when a backward passes through it)."""
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    _, _, want, _ = _reference("dense", ids, torch.roll(ids, -1, 1))
    model = _model("dense", checkpointing)
    for name, p in model.named_parameters():
        p.requires_grad_(is_indexer_param(name))
    objective = IndexerObjective(model)
    with objective.recording("dense", SCALE):
        lm = model(ids, labels=torch.roll(ids, -1, 1)).loss
    objective.remove()
    assert not lm.requires_grad
    runs = []
    handles = [layer.register_forward_hook(lambda *_: runs.append(1)) for layer in model.model.layers]
    objective.surrogate.backward()
    for handle in handles:
        handle.remove()
    assert runs == []
    got = _grads(model, lambda n: True)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-7, msg=name)
