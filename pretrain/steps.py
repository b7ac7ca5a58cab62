"""Step plug-ins: what one optimizer step of the Trainer computes.

The Trainer owns everything around the loss (micro-batching under the data-parallel wrapper's
no_sync, autocast, gradient clipping, the optimizer step, the MoE bias update, metrics); a step
plug-in owns the loss:

- ``begin(trainer, batch)``: once per optimizer step, before any micro-batch: phase switches, and the
  step's global normalisers (collectives are allowed here: every rank calls it).
- ``micro_batches(batch, size, device)``: the step's batch cut into micro-batches on the device.
- ``sequence_lengths(micro)``: the lengths of the sequences a micro-batch trains on (the step's model
  FLOPs, orthon.pretrain.flops).
- ``loss(model, micro)``: (objective to backward, already divided by the step's global normaliser;
  metric sums of this micro-batch). ``model`` is the data-parallel wrapper, so the forward goes
  through it and DDP / FSDP2 reduce the gradients.
- ``end(trainer, sums)``: the step's metrics from the sums (already added over micro-batches and ranks).
- ``finish(trainer, records)``: at the end of ``fit``, on rank 0: plots of the plug-in's own metrics.
- ``update_moe_bias``: False for a step that must leave the routers' balancing biases alone.
- ``runs_context_parallel``: True for a step whose forwards pass the Trainer's ``context`` to the model
  (each rank of a context-parallel group then computes its part of the same sequences).
- ``runs_expert_parallel``: True for a step whose every forward runs on every rank of the expert
  exchange (each MoE layer's all-to-all waits for all of them).
- ``input_shape(micro)``: (rows, positions) of the model input the loss's forward of ``micro`` takes.
- ``takes_empty_micro_batches``: True for a step whose ``loss`` takes an empty micro-batch (a weight-0
  forward).

A pipeline schedule (megatron's) runs ``loss`` on every stage: it must call the model once a micro-batch,
before anything the earlier stages must not do (their call ends the loss there). Its interleaved form
exchanges one shape: every micro-batch is padded to the step's largest ``input_shape``, and a step with
fewer micro-batches than stages gets empty ones where it ``takes_empty_micro_batches``.

NextTokenStep is pretraining's; mid-training adds the indexer KL (orthon.midtrain.steps) and RL the
policy loss (orthon.rl.steps).
"""
from __future__ import annotations

import math

import torch

from orthon.core import distributed
from orthon.pretrain.loss import IGNORE_INDEX
from orthon.pretrain.parallel import unwrap


class TrainStep:
    """The plug-in interface, with the defaults a token-batch step uses."""

    def begin(self, trainer, batch) -> None:
        pass

    update_moe_bias = True
    runs_context_parallel = False
    runs_expert_parallel = False
    takes_empty_micro_batches = False

    def micro_batches(self, batch, size: int, device) -> list:
        n = batch.input_ids.shape[0]
        return [batch.slice(i, i + size).to(device) for i in range(0, n, size)]

    def sequence_lengths(self, micro) -> list[int]:
        rows, length = micro.input_ids.shape
        return [length] * rows

    def input_shape(self, micro) -> tuple[int, int]:
        rows, length = micro.input_ids.shape
        return rows, length

    def loss(self, model, micro) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def end(self, trainer, sums: dict[str, float]) -> dict[str, float]:
        return dict(sums)

    def finish(self, trainer, records: list[dict]) -> None:
        pass


class NextTokenStep(TrainStep):
    """The mean next-token cross-entropy over every counted target of the global batch.

    Each rank divides its summed loss by the global count and multiplies by the world size, because
    DDP / FSDP2 average gradients over ranks: the result is the gradient of the global mean.
    ``loss_chunk`` > 0 runs the chunked cross-entropy (no full logits)."""

    runs_context_parallel = True
    runs_expert_parallel = True

    def __init__(self, loss_chunk: int = 0, document_mask: bool = True, track_max_logit: bool = False):
        self.loss_chunk, self.document_mask, self.track_max_logit = loss_chunk, document_mask, track_max_logit
        self.count = 1.0
        self.world = 1
        self.context = None
        self.max_logit: torch.Tensor | None = None  # on the device: no wait for it until the step's end

    def begin(self, trainer, batch) -> None:
        self.context = trainer.context
        labels = batch.labels if self.context is None else self.context.local(batch.labels)  # this rank's targets
        self.count = float(distributed.all_reduce_sum((labels != IGNORE_INDEX).sum().to(trainer.device).float()))
        self.world = trainer.world
        self.max_logit = None

    def lm_loss(self, model, micro) -> torch.Tensor:
        """Summed LM loss of a micro-batch (of this rank's positions, under context parallelism) through
        ``model`` (the wrapper)."""
        docs = micro.doc_ids if self.document_mask else None
        out = model(micro.input_ids, labels=micro.labels, doc_ids=docs, return_logits=False,
                    loss_reduction="sum", loss_chunk=self.loss_chunk, context=self.context)
        return out.loss

    def loss(self, model, micro):
        # Metrics stay tensors until the step's end (one transfer then): a float() here would make the host
        # wait for each micro-batch's forward before queuing its backward.
        lm = self.lm_loss(model, micro)
        if self.track_max_logit:
            latest = unwrap(model).attention_logit_max()
            if latest is not None:
                self.max_logit = latest if self.max_logit is None else torch.maximum(self.max_logit, latest)
        return lm * (self.world / self.count), {"loss": lm.detach()}

    def end(self, trainer, sums):
        metrics = {"loss": sums["loss"] / self.count}
        if self.track_max_logit:  # over every rank's sequences (a rank sees its own, or its positions' part)
            # the model's own after the step: a pipelined model's covers the stages whose loss ended early
            latest = unwrap(trainer.wrapped).attention_logit_max()
            if latest is not None:
                self.max_logit = latest if self.max_logit is None else torch.maximum(self.max_logit, latest)
            mine = (torch.full((1,), -math.inf, device=trainer.device) if self.max_logit is None
                    else self.max_logit.float().reshape(1))
            largest = distributed.all_reduce_max(mine).item()
            if math.isfinite(largest):
                metrics["max_attn_logit"] = largest
        return metrics
