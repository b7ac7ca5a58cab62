"""The DSA indexers' KL inside the model's forward, as mid-training's step trains them.

Everything that reads a layer's parameters runs in that layer's forward (a forward hook on its
attention): the no-gradient target (the layer's absorbed queries and latent) and the indexer's
differentiable queries, head weights and keys. When the last layer reading a full layer's top-k has
run (IndexShare's sharers follow their full layer), the group's KL is computed from those pieces and
differentiated at once with respect to the indexer's outputs (``torch.autograd.grad``), and a surrogate
sum(output * gradient), added to the step's objective, gives the indexer's parameters the same
gradients in the step's backward, without any backward through layers the LM loss does not train (phase
1's frozen model). The indexer runs on the detached layer input: its KL trains the indexer alone. Under
FSDP2 each indexer is its own unit, gathered again for the surrogate's backward
(``orthon.pretrain.parallel.wrap``): a KL computed after the whole forward would read the layers'
parameters FSDP2 has freed.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from orthon.midtrain.indexer_fit import (IndexerTerms, LayerInput, add_terms, group_terms, indexer_outputs,
                                         layer_input, layer_target)


def _keep(t):
    return t


@dataclass
class _Group:
    """A full-indexer layer, the targets of the layers that use its top-k, and its indexer's outputs."""
    rec: LayerInput
    attn: torch.nn.Module
    targets: list = field(default_factory=list)
    outputs: tuple = ()  # (q_idx, w_idx, k_idx) of this rank's positions, in the indexer's graph


class IndexerObjective:
    """Hooks on every attention layer of ``model``; active inside ``recording``. After the forward,
    ``terms`` holds the step's indexer terms (kl_sum detached) and ``surrogate`` the objective to add."""

    def __init__(self, model: torch.nn.Module):
        layers = [layer.self_attn for layer in model.model.layers]
        full = [a.layer for a in layers if a.indexer is not None]
        # The last layer of each full layer's group: the layer before the next full one, or the last.
        self.last = {i: (full[n + 1] if n + 1 < len(full) else len(layers)) - 1 for n, i in enumerate(full)}
        self.handles = [a.register_forward_hook(self._hook, with_kwargs=True) for a in layers]
        self.active = False

    @contextmanager
    def recording(self, mode: str, scale: float):
        """mode "dense" (phase 1) or "sparse"; scale: what the KL sum is multiplied by in the objective."""
        self.mode, self.scale = mode, scale
        self.group, self.terms, self.surrogate = None, None, None
        self.active = True
        try:
            yield self
        finally:
            self.active, self.group = False, None

    def _hook(self, module, args, kwargs, output):
        if not self.active:
            return
        rec = layer_input(module, args, kwargs, output)
        # Activation checkpointing's saved-tensor hooks would tie these tensors to the layer's recompute,
        # which runs without this hook: they are kept as they are.
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            q_abs, latent, q_resid = layer_target(module, rec)
            if module.indexer is not None:
                self.group = _Group(rec, module, [(q_abs, latent)],
                                    indexer_outputs(module, rec.x, q_resid, rec.cos, rec.sin))
            elif self.group is not None:
                self.group.targets.append((q_abs, latent))
            if self.group is not None and module.layer == self.last[self.group.rec.layer]:
                self._finish(self.group)
                self.group = None

    def _finish(self, group: _Group) -> None:
        leaves = [t.detach().requires_grad_() for t in group.outputs]
        q_idx, w_idx, k_idx = leaves
        attn = group.attn
        terms = group_terms(group.rec, group.targets, q_idx, w_idx, group.rec.gather(k_idx), self.mode,
                            attn.runtime.query_chunk, attn.config.index_topk, attn.scale, attn.indexer.scale)
        grads = torch.autograd.grad(terms.kl_sum * self.scale, leaves)
        terms.kl_sum = terms.kl_sum.detach()
        self.terms = add_terms(self.terms, terms)
        part = sum((out * g).sum() for out, g in zip(group.outputs, grads))
        self.surrogate = part if self.surrogate is None else self.surrogate + part
        group.targets, group.outputs = [], ()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
