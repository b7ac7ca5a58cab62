"""Supervised fine-tuning on conversations: the first post-training stage, on the one Trainer.

A conversation (orthon.rl.chat messages) becomes token ids message by message, so every boundary is
exact, with the loss only on what the assistant writes: its turns' bodies (thinking included: the
recipe's interleaved thinking is trained as it will be generated) and the role token that ends each
assistant turn (``<|observation|>`` before a tool's output, ``<|user|>`` after an answer), because
generation must learn to stop there. System, user and observation turns are context only.
``SFTStep`` is the Trainer's step plug-in: the mean next-token NLL over trained tokens, normalised
over the whole batch and split into micro-batches and over ranks as RL's step is (orthon.rl.steps).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from orthon.core.errors import DataError
from orthon.rl.steps import SampleStep
from orthon.rl.chat import ROLE_TOKENS, Message, render_message
from orthon.rl.logprobs import sample_log_probs


@dataclass
class SFTExample:
    tokens: list[int]
    prompt_length: int  # ids before the first trained one
    loss_mask: list[int]  # one per id after the prompt

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length


def conversation_example(messages: list[Message], tokenizer, clear_thinking: bool = False) -> SFTExample:
    """Token ids of a conversation and its loss mask (see the module docstring)."""
    missing = [t for t in ROLE_TOKENS.values() if tokenizer.token_to_id(t) is None]
    if missing:
        raise DataError(f"SFT: the tokenizer has no single token for {missing} (train it with the chat tokens, "
                        "orthon.data.tokenizer.CHAT_TOKENS, as the built-in one is)")
    last_assistant = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
    if last_assistant < 0:
        raise DataError("SFT conversation: no assistant turn to learn from")
    ids, mask = [], []
    for i, message in enumerate(messages):
        text = render_message(message, keep_thinking=not clear_thinking or i == last_assistant)
        header = ROLE_TOKENS[message.role] + "\n"
        head_ids, body_ids = tokenizer.encode(header), tokenizer.encode(text[len(header):])
        trained = message.role == "assistant"
        if i > 0 and messages[i - 1].role == "assistant":  # this role token ends the assistant's turn
            ids += head_ids[:1]
            mask.append(1)
            head_ids = head_ids[1:]
        ids += head_ids + body_ids
        mask += [0] * len(head_ids) + [int(trained)] * len(body_ids)
    if messages[-1].role == "assistant":  # the final answer hands the turn back to the user
        ids += tokenizer.encode(ROLE_TOKENS["user"])
        mask.append(1)
    first = mask.index(1)
    return SFTExample(ids, first, mask[first:])


def read_conversations(path: str | Path) -> list[list[Message]]:
    """A JSONL file of {"messages": [{"role", "content", "thinking"?}, ...]}; a bad line is an error
    naming the file and line."""
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append([Message(**m) for m in json.loads(line)["messages"]])
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}:{number}: not a conversation ({exc})") from None
    return out


class SFTStep(SampleStep):
    def micro_loss(self, model, micro):
        out = sample_log_probs(model, micro)
        mask = torch.zeros_like(out.log_probs)
        for b, example in enumerate(micro):
            mask[b, : example.response_length] = torch.as_tensor(example.loss_mask, dtype=mask.dtype)
        nll = -(out.log_probs * mask).sum()
        n = float(mask.sum())
        # DDP averages gradients over the data-parallel ranks: multiply back by their number (the normaliser is global).
        return nll / self.denominator * self.world, {"nll_sum": float(nll.detach()), "trained_tokens": n}

    def end(self, trainer, sums):
        sums = self.distinct(sums)
        n = max(sums.get("trained_tokens", 0.0), 1.0)
        return {"sft_loss": sums.get("nll_sum", 0.0) / n, "trained_tokens": sums.get("trained_tokens", 0.0),
                **self.schedule_metrics}


def fit_sft(recipe, tokenizer, conversations: list[list[Message]], log=print) -> dict:
    """``recipe.sft.steps`` optimizer steps of ``recipe.sft.batch_size`` conversations (shuffled per
    epoch by the run's seed) on the one Trainer; resumes from the run's last checkpoint; writes
    ``final/`` weights and metrics. Returns the first and last logged losses."""
    import random

    from orthon.core.interrupts import stop_signals_recorded
    from orthon.core.metrics import MetricsLogger, plot_curves, read_metrics
    from orthon.core.step_loop import stop_if_signalled
    from orthon.pretrain.trainer import Trainer

    cfg = recipe.sft
    run_dir = Path(recipe.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    examples = [conversation_example(m, tokenizer, cfg.clear_thinking) for m in conversations]
    if not examples:
        raise DataError("SFT: no conversations")
    rl = getattr(recipe, "rl", None)
    trainer = Trainer(recipe, run_dir, log, step=SFTStep(rl.dp_schedule if rl else None), with_data=False)
    resumed = trainer.resume() is not None
    metrics = MetricsLogger(run_dir, enabled=trainer.rank == 0, resume_step=trainer.step if resumed else None)

    def order(epoch: int) -> list[int]:
        idx = list(range(len(examples)))
        random.Random(recipe.train.seed * 7_919 + epoch).shuffle(idx)
        return idx

    bar = None
    if recipe.train.progress and trainer.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=trainer.step, desc="sft", unit="step")
    try:
        with stop_signals_recorded(recipe.train.stop_signals) as received:
            while trainer.step < cfg.steps:
                first = trainer.step * cfg.batch_size
                picks = [order(i // len(examples))[i % len(examples)] for i in range(first, first + cfg.batch_size)]
                batch = [examples[i] for i in picks]
                out = trainer.train_step(batch, tokens=sum(len(e.tokens) for e in batch))
                metrics.log(trainer.step, **out)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{out['sft_loss']:.3f}")
                if recipe.train.checkpoint_interval and trainer.step % recipe.train.checkpoint_interval == 0:
                    trainer.save_checkpoint()
                stop_if_signalled(received, trainer.device, trainer.step,
                                  lambda: trainer.checkpointer.has(trainer.step), trainer.save_checkpoint)
    finally:
        if bar is not None:
            bar.close()
        metrics.close()
    trainer.write_weights(run_dir / "final")  # FSDP2, expert parallelism: a collective
    if trainer.rank != 0:
        return {"steps": trainer.step}
    records = read_metrics(run_dir / "metrics.jsonl")
    plot_curves(records, ["sft_loss"], run_dir / "loss.png", title="SFT: NLL of the assistant's tokens")
    losses = [r["sft_loss"] for r in records if "sft_loss" in r]
    return {"steps": trainer.step, "loss_start": losses[0] if losses else float("nan"),
            "loss_end": losses[-1] if losses else float("nan")}
