"""Mid-training's step plug-in: the next-token loss plus the DSA indexer's KL, by phase.

A stage step is one of three phases (StageConfig.step_phase):
- dense: the LM loss, indexers frozen (plain pretraining at the stage's length and RoPE base);
- indexer_only: the main model frozen, the indexers fit the dense attention (KL over all visible keys);
- sparse: the LM loss through top-k sparse attention, and the indexers' KL over the selected keys
  (their input detached, so the KL never reaches the main model).
The phase sets what requires grad (the Trainer re-wraps DDP when that set changes), whether the model
attends sparsely, and which optimizer part steps (StageOptimizer). The KL is computed inside the LM
forward (which runs through the data-parallel wrapper: DDP or FSDP2), layer by layer
(orthon.midtrain.indexer_objective); one backward reduces every gradient over the ranks.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from orthon.core import distributed
from orthon.core.metrics import plot_curves
from orthon.midtrain.indexer_objective import IndexerObjective
from orthon.midtrain.optimizer import is_indexer_param
from orthon.pretrain.steps import NextTokenStep

_TRAINABLE = {"dense": lambda n: not is_indexer_param(n), "indexer_only": is_indexer_param, "sparse": lambda n: True}


class StageStep(NextTokenStep):
    def __init__(self, stage, loss_chunk: int, document_mask: bool):
        super().__init__(loss_chunk, document_mask)
        self.stage = stage
        self.objective: IndexerObjective | None = None  # hooks on the trainer's model, at the first step
        self.phase = "dense"

    @property
    def update_moe_bias(self) -> bool:
        return self.phase != "indexer_only"  # a frozen model's routers keep their biases

    def begin(self, trainer, batch) -> None:
        if self.objective is None:
            self.objective = IndexerObjective(trainer.model)
            self.n_full = len(self.objective.last)  # one group per layer with its own indexer
        self.phase = self.stage.step_phase(trainer.step)
        trainer.set_trainable(_TRAINABLE[self.phase])
        trainer.model.runtime.sparse_attention = self.phase == "sparse"
        trainer.optimizer.phase = self.phase
        if self.phase == "indexer_only" and self.stage.indexer_lr is not None:
            trainer.optimizer.set_indexer_lr(self.stage.indexer_lr)
        super().begin(trainer, batch)
        ids = batch.input_ids if self.context is None else self.context.local(batch.input_ids)  # this rank's queries
        queries = torch.tensor(float(ids.numel() * self.n_full), device=trainer.device)
        self.query_total = float(distributed.all_reduce_sum(queries))

    def loss(self, model, micro):
        record = self.phase != "dense"
        mode = "dense" if self.phase == "indexer_only" else "sparse"
        # Summed over ranks by the wrapper's average: the KL is scaled by the world size as the LM term.
        fit = self.objective.recording(mode, self.world / self.query_total) if record else nullcontext()
        with fit:
            lm = self.lm_loss(model, micro)  # phase 1's frozen main model builds no graph
        sums = {"loss": float(lm.detach())}
        objective = lm * (self.world / self.count) if lm.requires_grad else None
        if record:
            terms, surrogate = self.objective.terms, self.objective.surrogate
            if surrogate is not None:
                objective = surrogate if objective is None else objective + surrogate
            sums.update(indexer_kl=float(terms.kl_sum), recall=terms.recall_sum,
                        oracle=terms.oracle_sum, recall_count=float(terms.recall_count))
        return objective, sums

    def end(self, trainer, sums):
        metrics = {"loss": sums["loss"] / self.count, "phase": self.phase}
        if self.phase != "dense":
            metrics["indexer_kl"] = sums["indexer_kl"] / self.query_total
            metrics["indexer_lr"] = trainer.optimizer.indexer_lr
        if sums.get("recall_count"):
            metrics["indexer_recall"] = sums["recall"] / sums["recall_count"]
            metrics["oracle_recall"] = sums["oracle"] / sums["recall_count"]  # the best any k keys can do
        return metrics

    def close(self) -> None:
        if self.objective is not None:
            self.objective.remove()

    def finish(self, trainer, records) -> None:
        if any("indexer_recall" in r for r in records):
            plot_curves(records, ["indexer_recall", "oracle_recall"], trainer.run_dir / "indexer_recall.png",
                        title=f"indexer recall, stage {self.stage.name} "
                              f"(T={trainer.seq_len}, k={trainer.recipe.model.index_topk})")
