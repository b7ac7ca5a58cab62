"""The step loop every trainer runs (orthon's Trainer and the MindSpore backend's): a step, held-out
evaluation every ``eval_interval`` steps, metrics every ``log_interval``, a checkpoint every
``checkpoint_interval``, a progress bar over tokens; at the end a final evaluation and a checkpoint of
the last step.

The trainer is duck-typed: ``cfg`` (those intervals), ``step``, ``tokens``, ``total_tokens``, ``done()``,
``train_step()`` (the step's figures: ``loss``, ``batch_tokens``, ...), ``evaluate()`` (a loss or None),
``save_checkpoint()`` and ``checkpointer.has(step)``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
            bar.set_postfix(loss=f"{last['loss']:.3f}", step=trainer.step)
        if cfg.checkpoint_interval and trainer.step % cfg.checkpoint_interval == 0:
            trainer.save_checkpoint()
    if bar is not None:
        bar.close()
    final_eval = trainer.evaluate()
    if final_eval is not None:
        metrics_log.log(trainer.step, final_eval_loss=final_eval)
    if not trainer.checkpointer.has(trainer.step):
        trainer.save_checkpoint()
    return last, final_eval
