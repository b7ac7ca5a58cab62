"""The step loop every trainer runs (orthon's Trainer and the MindSpore backend's): a step, held-out
evaluation every ``eval_interval`` steps, metrics every ``log_interval``, a checkpoint every
``checkpoint_interval``, a progress bar over tokens; at the end a final evaluation and a checkpoint of
the last step. A stop signal (``stop_signals``, SIGTERM by default: preemption, a job's time limit) ends
the loop after the step it arrived in, with a checkpoint of that step, on every rank at the same step
(the ranks agree after each step, one all-reduce of a scalar), and raises ``StopRequested``.

The trainer is duck-typed: ``cfg`` (those intervals), ``step``, ``tokens``, ``total_tokens``, ``done()``,
``train_step()`` (the step's figures: ``loss``, ``batch_tokens``, ...), ``evaluate()`` (a loss or None),
``save_checkpoint()`` and ``checkpointer.has(step)``; optionally ``reduce_max(int) -> int``, the ranks'
agreement when they are not torch.distributed's (the MindSpore backend's workers).
"""
from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import torch

from orthon.core import distributed
from orthon.core.interrupts import StopRequested, stop_signals_recorded


def run_steps(trainer: Any, metrics_log: Any, progress_label: str | None,
              after_step: Callable[[], None] | None = None) -> tuple[dict, float | None]:
    """Train until ``trainer.done()``; return the last step's figures ({} when no step ran) and the
    final held-out loss. ``progress_label``: the bar's label, None for no bar; ``after_step``: called
    after each step, before its evaluation."""
    cfg = trainer.cfg
    bar = None
    if progress_label is not None:
        from tqdm import tqdm

        bar = tqdm(total=trainer.total_tokens, initial=trainer.tokens, unit="tok", unit_scale=True,
                   desc=progress_label)
    last: dict = {}
    try:
        with stop_signals_recorded(getattr(cfg, "stop_signals", ())) as received:
            while not trainer.done():
                last = trainer.train_step()
                if after_step is not None:
                    after_step()
                if cfg.eval_interval and trainer.step % cfg.eval_interval == 0:
                    last["eval_loss"] = trainer.evaluate()
                if trainer.step % cfg.log_interval == 0 or trainer.done():
                    metrics_log.log(trainer.step, **{k: v for k, v in last.items() if v is not None})
                if bar is not None:
                    bar.update(last["batch_tokens"])
                    mfu = {"mfu": f"{last['mfu_pct']:.1f}%"} if "mfu_pct" in last else {}
                    bar.set_postfix(loss=f"{last['loss']:.3f}", step=trainer.step, **mfu)
                if cfg.checkpoint_interval and trainer.step % cfg.checkpoint_interval == 0:
                    trainer.save_checkpoint()
                stop_if_signalled(received, getattr(trainer, "device", None), trainer.step,
                                  lambda: trainer.checkpointer.has(trainer.step), trainer.save_checkpoint,
                                  reduce_max=getattr(trainer, "reduce_max", None))
    finally:
        if bar is not None:
            bar.close()
    final_eval = trainer.evaluate()
    if final_eval is not None:
        metrics_log.log(trainer.step, final_eval_loss=final_eval)
    if not trainer.checkpointer.has(trainer.step):
        trainer.save_checkpoint()
    return last, final_eval


def stop_if_signalled(received: Callable[[], int] | None, device, count: int, saved: Callable[[], bool],
                      save: Callable[[], None], unit: str = "step",
                      reduce_max: Callable[[int], int] | None = None) -> None:
    """After step (or iteration) ``count``: if any rank received a stop signal, save a checkpoint unless
    ``saved()`` says this one has one, and raise StopRequested on every rank. The ranks agree on it (the
    highest signal number any received, one all-reduce), so all stop after the same step and save one
    checkpoint together. ``received``: from ``stop_signals_recorded`` (None: no stop signals, nothing to
    agree on); ``device``: where the collective runs (CUDA for NCCL); ``reduce_max``: the all-reduce
    itself, where the ranks are not torch.distributed's."""
    if received is None:
        return
    number = received()
    if reduce_max is not None:
        number = reduce_max(number)
    elif distributed.is_distributed():
        number = int(distributed.all_reduce_max(torch.tensor([number], dtype=torch.int64, device=device)).item())
    if number:
        if not saved():
            save()
        raise StopRequested(signal.Signals(number).name, count, unit)
