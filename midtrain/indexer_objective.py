"""The DSA indexers' KL inside the model's forward, as mid-training's step trains them.

Everything that reads a layer's parameters runs in that layer's forward (a forward hook on its
attention): the no-gradient target (the layer's absorbed queries and latent) and the indexer's
differentiable queries, head weights and keys. When the last layer reading a full layer's top-k has
run (IndexShare's sharers follow their full layer), the group's KL is computed from those pieces and
differentiated at once with respect to the indexer's outputs (``torch.autograd.grad``); only the
outputs' gradients wait for the step's backward. They reach the indexer's parameters in one of two ways:

- ``through_layers`` (FSDP2): each full layer's attention output passes through ``_Port``, whose backward
  hands the stored gradients to the indexer's outputs, so they flow into its parameters inside the
  layer's own backward, while FSDP2 has gathered the layer's parameters again (it frees them after the
  forward: a KL computed after the whole forward would read freed storage);
- otherwise (one process, DDP: the parameters stay whole) a surrogate sum(output * gradient), added to
  the step's objective, whose backward gives the same gradients without any backward through layers
  the LM loss does not train (phase 1's frozen model).

The indexer reads the layer's input through ``_NoGradient``: no gradient reaches the main model (its KL
trains the indexer alone), but the edge keeps the layer's backward, and FSDP2's reduce-scatter after
it, waiting for the indexer's.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from orthon.midtrain.indexer_fit import (IndexerTerms, LayerInput, add_terms, group_terms, indexer_outputs,
                                         layer_input, layer_target)


def _keep(t):
    return t


class _Port(torch.autograd.Function):
    """The identity on a full layer's attention output; backward: the gradient it gets, and the group's
    stored KL gradients for the indexer's outputs."""

    @staticmethod
    def forward(ctx, out, group, *indexer_outputs):
        ctx.group = group
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        grads, ctx.group.grads = ctx.group.grads, None  # a group's gradients are delivered once
        return (grad, None, *grads)


class _NoGradient(torch.autograd.Function):
    """The identity, whose backward passes no gradient but keeps the graph's edge (see the module note)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None


@dataclass
class _Group:
    """A full-indexer layer, the targets of the layers that use its top-k, and its indexer's outputs."""
    rec: LayerInput
    attn: torch.nn.Module
    targets: list = field(default_factory=list)
    outputs: tuple = ()  # (q_idx, w_idx, k_idx) of this rank's positions, in the indexer's graph
    grads: tuple | None = None


class IndexerObjective:
    """Hooks on every attention layer of ``model``; active inside ``recording``. After the forward,
    ``terms`` holds the step's indexer terms (kl_sum detached) and ``surrogate`` the objective to add
    when not ``through_layers`` (None otherwise)."""

    def __init__(self, model: torch.nn.Module):
        layers = [layer.self_attn for layer in model.model.layers]
        full = [a.layer for a in layers if a.indexer is not None]
        # The last layer of each full layer's group: the layer before the next full one, or the last.
        self.last = {i: (full[n + 1] if n + 1 < len(full) else len(layers)) - 1 for n, i in enumerate(full)}
        self.handles = [a.register_forward_hook(self._hook, with_kwargs=True) for a in layers]
        self.handles.append(model.model.embed_tokens.register_forward_hook(self._embedding_hook))
        self.active = False

    @contextmanager
    def recording(self, mode: str, scale: float, through_layers: bool):
        """mode "dense" (phase 1) or "sparse"; scale: what the KL sum is multiplied by in the objective."""
        self.mode, self.scale, self.through_layers = mode, scale, through_layers
        self.group, self.terms, self.surrogate = None, None, None
        self.active = True
        try:
            yield self
        finally:
            self.active, self.group = False, None

    def _embedding_hook(self, module, args, output):
        # Through the layers with a frozen main model (phase 1), the ports make the layers' activations
        # require grad from the first full layer on, but activation checkpointing's recompute runs without
        # them: it would save other tensors than the forward did. Every layer's input requires grad instead.
        if self.active and self.through_layers and not output.requires_grad:
            return output.detach().requires_grad_()
        return None

    def _hook(self, module, args, kwargs, output):
        if not self.active:
            return None
        rec, x = layer_input(module, args, kwargs, output)
        # Activation checkpointing's saved-tensor hooks would tie these tensors to the layer's recompute,
        # which runs without this hook: they are kept as they are.
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            q_abs, latent, q_resid = layer_target(module, rec)
            if module.indexer is not None:
                x = _NoGradient.apply(x) if x.requires_grad else x.detach()
                self.group = _Group(rec, module, [(q_abs, latent)],
                                    indexer_outputs(module, x, q_resid, rec.cos, rec.sin))
                if self.through_layers:
                    output = (_Port.apply(output[0], self.group, *self.group.outputs), *output[1:])
            elif self.group is not None:
                self.group.targets.append((q_abs, latent))
            if self.group is not None and module.layer == self.last[self.group.rec.layer]:
                self._finish(self.group)
                self.group = None
        return output

    def _finish(self, group: _Group) -> None:
        leaves = [t.detach().requires_grad_() for t in group.outputs]
        q_idx, w_idx, k_idx = leaves
        attn = group.attn
        terms = group_terms(group.rec, group.targets, q_idx, w_idx, group.rec.gather(k_idx), self.mode,
                            attn.runtime.query_chunk, attn.config.index_topk, attn.scale, attn.indexer.scale)
        grads = torch.autograd.grad(terms.kl_sum * self.scale, leaves)
        terms.kl_sum = terms.kl_sum.detach()
        self.terms = add_terms(self.terms, terms)
        if self.through_layers:
            group.grads = grads
        else:
            part = sum((out * g).sum() for out, g in zip(group.outputs, grads))
            self.surrogate = part if self.surrogate is None else self.surrogate + part
        group.targets, group.outputs = [], ()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
