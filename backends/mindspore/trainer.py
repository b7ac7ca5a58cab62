"""The MindSpore training loop: the torch Trainer's pretraining step on the same data pipeline.

Same batch-size ramp, LR schedule, micro-batching, optimizer routing (Muon + Split / AdamW), MoE
balancing step, metrics (metrics.jsonl, TensorBoard, loss.png), final weights (HF layout) and
checkpoints as ``orthon pretrain``; what differs is the framework: gradients come from
``mindspore.value_and_grad`` of the summed next-token loss, and in graph mode
(``mindspore.mode: graph``) that gradient function is compiled with ``mindspore.jit``, the routed
experts then running in their static-shape dense form. The model starts from the torch model's
initialisation under ``train.seed`` (or ``train.init_from``), so both backends begin a run from the
same weights. Under msrun the workers train data parallel (``orthon.backends.mindspore.distributed``):
each takes its share of every global batch, the gradients are summed across them, rank 0 writes.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np

from orthon.backends.mindspore.checkpoint import MindSporeCheckpointer
from orthon.backends.mindspore.distributed import DataParallel, local_device_id
from orthon.backends.mindspore.optim import HybridOptimizer
from orthon.backends.mindspore.runtime import ms, place
from orthon.backends.mindspore.weights import build, save_hf
from orthon.core.device_stats import step_memory, throughput_metrics
from orthon.core.metrics import MetricsLogger, plot_training, read_metrics
from orthon.core.step_guard import StepGuard
from orthon.core.step_loop import run_steps
from orthon.data.loader import IGNORE_INDEX, open_training_data
from orthon.optim import batch_size_at, lr_at
from orthon.pretrain.flops import ModelFlops

ops = ms.ops


def _int32(t) -> ms.Tensor:
    return ms.Tensor(t.numpy().astype(np.int32))


def global_norm(grads) -> float:
    return math.sqrt(sum(float((g * g).sum()) for g in grads))


def device_memory() -> dict[str, float]:
    """The step's memory metric: the device's peak reserved bytes since the last call (Ascend, GPU), or the
    process's peak resident set (CPU, where MindSpore's memory statistics stay 0)."""
    if ms.get_context("device_target") == "CPU":
        import torch

        return step_memory(torch.device("cpu"))
    peak = ms.runtime.max_memory_reserved()
    ms.runtime.reset_peak_memory_stats()
    return {"memory_peak_gib": peak / 2**30}


class MindSporeTrainer:
    """``fit`` trains the recipe's model on the recipe's data on one MindSpore device, or data parallel on
    the devices of the workers msrun started."""

    def __init__(self, recipe, run_dir, log=print, with_data: bool = True):
        self.recipe, self.cfg, self.run_dir = recipe, recipe.train, Path(run_dir)
        place(dataclasses.replace(recipe.mindspore, device_id=local_device_id(recipe.mindspore.device_id)))
        ms.set_seed(self.cfg.seed)
        state = None
        if self.cfg.init_from:
            from orthon.pretrain.trainer import initial_weights

            state = initial_weights(self.cfg.init_from, recipe.model)
        self.model = build(recipe.model, dataclasses.replace(recipe.runtime), state, seed=self.cfg.seed)
        self.model.set_indexers_trainable(False)  # as the torch Trainer: only mid-training trains them
        graph = recipe.mindspore.mode == "graph"
        self.model.set_grouped_experts(not graph)
        self.optimizer = HybridOptimizer(self.model, recipe.optim, recipe.schedule)
        self.params = self.model.trainable_params()
        self.parallel = DataParallel(self.params)
        self.rank, self.world = self.parallel.rank, self.parallel.world
        self.log = log if self.rank == 0 else (lambda *_: None)
        grad_fn = ms.value_and_grad(self._loss, None, self.params, has_aux=True)
        self.grad_fn = ms.jit(grad_fn) if graph else grad_fn
        self.data, self.valid = (open_training_data(recipe.data, recipe.model.vocab_size, self.cfg.eval_samples, self.rank, self.world)
                                 if with_data else (None, None))
        self.checkpointer = MindSporeCheckpointer(self.run_dir, self.cfg.keep_last, log=self.log)
        self.reduce_max = self.parallel.max  # the ranks agree on a stop signal (core.step_loop)
        self.seq_len = recipe.data.seq_len
        self.step, self.tokens = 0, 0
        self.guard = StepGuard(self.cfg.max_nonfinite_skips, self.cfg.spike_sigma, self.cfg.spike_window, self.log)
        self.total_tokens = self.cfg.total_tokens or recipe.schedule.total_tokens
        self.model_flops = ModelFlops.of(recipe.model)

    def _loss(self, input_ids, labels, doc_ids, cos, sin):
        return self.model.loss_and_loads(input_ids, labels, cos, sin, doc_ids)

    def _inputs(self, batch):
        """A batch's tensors: int32 ids, labels and documents (one document per row when the recipe
        does not mask documents: plain causal attention), and the RoPE table."""
        docs = batch.doc_ids if self.recipe.data.document_mask else batch.doc_ids * 0
        cos, sin = self.model.rope(batch.input_ids.shape[1])
        return _int32(batch.input_ids), _int32(batch.labels), _int32(docs), cos, sin

    # ------------------------------------------------------------ state
    def resume(self) -> dict | None:
        path = self.checkpointer.latest()
        if path is None:
            return None
        state = self.checkpointer.load(path, self.model, self.optimizer)
        self.step, self.tokens = state["step"], state["tokens"]
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        if self.data is not None:
            self.data.load_state_dict(state["data"])
        self.log(f"resumed from {path} at step {self.step} ({self.tokens:,} tokens)")
        return state

    def save_checkpoint(self) -> None:
        if self.rank != 0:  # the state is the same on every rank
            return
        state = {"step": self.step, "tokens": self.tokens, "backend": "mindspore",
                 "guard": self.guard.state_dict()}
        if self.data is not None:
            state["data"] = self.data.state_dict()
        self.checkpointer.save(self.step, self.model, self.optimizer, state)

    # ------------------------------------------------------------ one step
    def batch_sequences(self) -> int:
        micro_tokens = self.cfg.micro_batch_size * self.seq_len
        return batch_size_at(self.recipe.batch, self.tokens, micro_tokens, self.world) // self.seq_len

    def train_step(self, batch=None, tokens: int | None = None) -> dict:
        start = time.perf_counter()
        if batch is None:
            n_seqs = self.batch_sequences()
            batch, tokens = self.data.next_batch(n_seqs), n_seqs * self.seq_len
        self.optimizer.set_tokens(self.tokens, self.step)
        lr = lr_at(self.recipe.schedule, self.tokens, self.step)
        local_count = int((batch.labels != IGNORE_INDEX).sum())
        size = self.cfg.micro_batch_size
        grads, loss_sum, loads = None, 0.0, None
        micros = range(0, batch.input_ids.shape[0], size)
        for i in micros:
            (loss, micro_loads), micro_grads = self.grad_fn(*self._inputs(batch.slice(i, i + size)))
            loss_sum += float(loss)
            grads = list(micro_grads) if grads is None else [a + b for a, b in zip(grads, micro_grads)]
            if micro_loads is not None:
                loads = micro_loads if loads is None else loads + micro_loads
        grads = self.parallel.grads(grads)
        loss_sum, count = self.parallel.sum([loss_sum, local_count])
        count = max(round(count), 1)
        grads = [g / count for g in grads]  # the gradient of the global batch's mean loss
        grad_norm = global_norm(grads)
        skipped = self.guard.skip(self.step + 1, grad_norm, loss_sum / count)  # the same on every rank
        if not skipped:
            if self.cfg.grad_clip > 0 and grad_norm > self.cfg.grad_clip:
                grads = [g * (self.cfg.grad_clip / (grad_norm + 1e-6)) for g in grads]
            self.optimizer.step({p.name: g for p, g in zip(self.params, grads)})
        imbalance = self._update_moe_bias(loads) if loads is not None and not skipped else None
        self.step += 1
        self.tokens += int(tokens or 0)
        elapsed = time.perf_counter() - start
        metrics = {"loss": loss_sum / count, "lr": lr, "grad_norm": grad_norm, "step_time_s": elapsed,
                   "micro_batches": len(micros)}
        if tokens:
            metrics.update(batch_tokens=tokens, tokens=self.tokens, tokens_per_s=tokens / elapsed)
            # Model FLOPs as the torch Trainer's (dense attention: this backend's); MFU against
            # train.peak_tflops, the one source of an Ascend NPU's peak here.
            flops_per_s = self.model_flops.per_token(self.seq_len) * tokens / self.world / elapsed
            metrics.update(throughput_metrics(flops_per_s, self.cfg.peak_tflops * 1e12))
        metrics.update(device_memory())
        if imbalance is not None:
            metrics["moe_load_max_over_mean"] = imbalance
        if self.guard.total:
            metrics["skipped_steps"] = self.guard.total
        return metrics

    def _update_moe_bias(self, loads) -> float | None:
        """The torch Trainer's balancing step (orthon.pretrain.moe.update_expert_bias) on every router."""
        import torch

        from orthon.pretrain.moe import update_expert_bias

        ratios = []
        for router, load in zip(self.model.moe_routers(), self.parallel.sum(loads.asnumpy())):
            if load.sum() > 0:
                ratios.append(float(load.max() / load.mean()))
                bias = torch.from_numpy(router.e_score_correction_bias.asnumpy())
                new = update_expert_bias(bias, torch.from_numpy(load), self.cfg.moe_bias_rate)
                # In place: a compiled step reads the parameter's storage (set_data would swap it).
                ops.assign(router.e_score_correction_bias, ms.Tensor(new.numpy().astype(np.float32)))
        return sum(ratios) / len(ratios) if ratios else None

    def evaluate(self) -> float | None:
        if self.valid is None:
            return None
        total, count = 0.0, 0
        for batch in self.valid.batches(self.cfg.micro_batch_size, self.rank, self.world):
            ids, labels, docs, cos, sin = self._inputs(batch)
            total += float(self.model.loss_and_loads(ids, labels, cos, sin, docs)[0])
            count += int((batch.labels != IGNORE_INDEX).sum())
        total, count = self.parallel.sum([total, count])
        return float(total / count) if count else None

    # ------------------------------------------------------------ the loop
    def done(self) -> bool:
        return self.tokens >= self.total_tokens or bool(self.cfg.max_steps and self.step >= self.cfg.max_steps)

    def fit(self) -> dict:
        metrics_log = MetricsLogger(self.run_dir, enabled=self.rank == 0, resume_step=self.step or None)
        label = f"{self.cfg.progress_label} (mindspore)" if self.cfg.progress and self.rank == 0 else None
        last, final_eval = run_steps(self, metrics_log, label)
        metrics_log.close()
        if self.rank == 0:
            self._finish()
        return {"step": self.step, "tokens": self.tokens, "final_eval_loss": final_eval, **last}

    def _finish(self) -> None:
        save_hf(self.model, self.run_dir / "final")
        plot_training(read_metrics(self.run_dir / "metrics.jsonl"), self.run_dir / "loss.png",
                      title=f"{self.cfg.progress_label} loss, MindSpore ({self.recipe.model.hidden_size}-wide, "
                            f"{self.recipe.model.num_hidden_layers} layers)",
                      reference=math.log(self.recipe.model.vocab_size), reference_label="ln(vocab)")
