"""Time to loss: the wall time orthon's tiny recipe needs to reach the held-out loss that transformers +
AdamW ends at, both trained on the same data, from the same weights, for the same token budget.

- orthon: configs/tiny.yaml through orthon's own Trainer (Muon + Muon Split on the hidden matrices,
  AdamW on the rest, the warmup-cosine schedule, the batch-size ramp, MoE bias balancing).
- reference: transformers' GlmMoeDsaForCausalLM holding the same initial weights (written by orthon's
  HF exporter), a plain loop: torch AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices, none on
  norms; peak LR --hf-lr, default 3e-3, the tiny recipe's own peak, with its warmup-cosine shape down to
  peak / 5), the same batches (the same sampler and ramp; checked step by step), the same
  gradient-accumulation micro-batches and loss normalisation. transformers always runs its DSA indexer;
  it gets index_topk = seq_len, so its selection is every causal key and both models compute dense
  causal attention (the recipe's pretraining phase).

The two runs alternate step by step in one process, so drift in machine load hits both alike. The
clock counts training steps only (data, forward, backward, optimizer); every --eval-every steps both
models are evaluated on the same held-out samples with the clock stopped. The headline ratio is
orthon's time to the reference's final held-out loss (linear between evaluations) over the reference's
total time: below 1, orthon gets there sooner.

    OMP_NUM_THREADS=2 python bench/time_to_loss.py [--size full|smoke] [--tokens N] [--hf-lr 3e-3]
        [--threads N] [--out runs/time_to_loss] [--builtin-dir runs/builtin] [--set key=value ...]

Writes OUT/time_to_loss.png (held-out loss against wall seconds, both) and OUT/time_to_loss.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# token budget, evaluation interval (steps), held-out samples per source
SIZES = {"full": (600_000, 3, 32), "smoke": (24_576, 2, 4)}


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """First wall time at which a (seconds, loss) curve reaches ``target``, linear between points;
    None when it never does."""
    for (t0, l0), (t1, l1) in zip([(0.0, math.inf)] + curve[:-1], curve):
        if l1 <= target:
            if not math.isfinite(l0) or l0 == l1:
                return t1
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def scaled_recipe(tokens: int, eval_samples: int, builtin_dir: str, extra: list[str]):
    """configs/tiny.yaml at ``tokens`` tokens: warmup and batch ramp keep their shares of the budget."""
    from orthon.launch.cmd_pretrain import with_builtin_data
    from orthon.pretrain.recipe import load_recipe

    base = load_recipe(ROOT / "configs/tiny.yaml")
    share = tokens / base.schedule.total_tokens
    overrides = [f"schedule.total_tokens={tokens}",
                 f"schedule.warmup_tokens={int(base.schedule.warmup_tokens * share)}",
                 f"batch.ramp_tokens={int(base.batch.ramp_tokens * share)}",
                 f"train.eval_samples={eval_samples}", f"train.builtin_dir={builtin_dir}",
                 "train.checkpoint_interval=0", "train.progress=false", *extra]
    return with_builtin_data(load_recipe(ROOT / "configs/tiny.yaml", overrides), log=lambda *a: None)


class Reference:
    """transformers' model and a plain AdamW loop over the recipe's batches."""

    def __init__(self, recipe, weights_dir: str, peak_lr: float):
        from transformers import GlmMoeDsaForCausalLM

        from orthon.data.loader import TrainData

        self.recipe = recipe
        self.model = GlmMoeDsaForCausalLM.from_pretrained(
            weights_dir, dtype=torch.float32, index_topk=recipe.data.seq_len).train()
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        o = recipe.optim
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.adamw_weight_decay},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=peak_lr, betas=o.adamw_betas, eps=o.adamw_eps)
        s = recipe.schedule
        self.schedule = dataclasses.replace(s, peak_lr=peak_lr, floor_lr=peak_lr * s.floor_lr / s.peak_lr)
        self.data = TrainData(recipe.data)
        self.tokens = 0

    def loss_sum(self, batch) -> torch.Tensor:
        logits = self.model(batch.input_ids).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(),
                                                 ignore_index=-100, reduction="sum")

    def train_step(self, n_seqs: int, micro: int):
        from orthon.data.loader import IGNORE_INDEX
        from orthon.optim import lr_at

        batch = self.data.next_batch(n_seqs)
        count = float((batch.labels != IGNORE_INDEX).sum())
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.schedule, self.tokens)
        for start in range(0, n_seqs, micro):
            (self.loss_sum(batch.slice(start, start + micro)) / count).backward()
        if self.recipe.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.train.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.tokens += n_seqs * self.recipe.data.seq_len
        return batch.sample_ids

    @torch.no_grad()
    def evaluate(self, valid, micro: int) -> float:
        from orthon.data.loader import IGNORE_INDEX

        self.model.eval()
        total = count = 0.0
        for batch in valid.batches(micro):
            total += float(self.loss_sum(batch))
            count += float((batch.labels != IGNORE_INDEX).sum())
        self.model.train()
        return total / count


def run(recipe, hf_lr: float, eval_every: int, log=print) -> dict:
    """Both trainings, alternating step by step. Returns {name: [(wall_s, tokens, held_out_loss)]}."""
    from orthon.pretrain.trainer import Trainer
    from orthon.pretrain.weights import save_weights

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(recipe, Path(tmp) / "run", log=lambda *a: None)
        save_weights(trainer.model, Path(tmp) / "init")
        reference = Reference(recipe, str(Path(tmp) / "init"), hf_lr)
        return _alternate(trainer, reference, recipe, eval_every, log)


def _alternate(trainer, reference, recipe, eval_every, log):
    micro = recipe.train.micro_batch_size
    clock = {"orthon": 0.0, "transformers": 0.0}

    def evaluate(step):
        losses = {"orthon": trainer.evaluate(), "transformers": reference.evaluate(trainer.valid, micro)}
        for name, loss in losses.items():
            curves[name].append((round(clock[name], 3), trainer.tokens, loss))
        log(f"step {step:>4}  tokens {trainer.tokens:>9,}  " + "  ".join(
            f"{n} {curves[n][-1][2]:.4f} @ {clock[n]:6.1f}s" for n in curves))

    curves = {name: [] for name in clock}
    evaluate(0)
    trainer.wrapped.train()
    step = 0
    while not trainer.done():
        n_seqs = trainer.batch_sequences()
        start = time.perf_counter()
        trainer.train_step()
        clock["orthon"] += time.perf_counter() - start
        start = time.perf_counter()
        ids = reference.train_step(n_seqs, micro)
        clock["transformers"] += time.perf_counter() - start
        if not torch.equal(ids, trainer.sample_ids):
            raise RuntimeError(f"step {step}: the two runs read different batches")
        step += 1
        if step % eval_every == 0 or trainer.done():
            evaluate(step)
    return curves


def plot(curves: dict, target: float, out_png: Path, title: str) -> None:
    from orthon.core.metrics import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    for (name, points), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        label = {"orthon": "orthon, tiny recipe (Muon + Split)", "transformers": "transformers + AdamW"}[name]
        ax.plot([p[0] for p in points], [p[2] for p in points], color=color, marker="o", markersize=3, label=label)
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label="transformers + AdamW final")
    ax.set_xlabel("wall seconds (training steps only)")
    ax.set_ylabel("held-out loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out_png)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--tokens", type=int, default=0, help="token budget (0: the size's)")
    parser.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: the size's)")
    parser.add_argument("--hf-lr", type=float, default=3e-3, help="peak LR of the transformers + AdamW run")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="runs/time_to_loss")
    parser.add_argument("--builtin-dir", default="runs/builtin", help="the built-in corpus (prepared if absent)")
    parser.add_argument("--set", nargs="*", default=[], help="recipe overrides (both runs)")
    args = parser.parse_args()
    from orthon.core.files import atomic_write_json

    torch.set_num_threads(args.threads)
    tokens, eval_every, samples = SIZES[args.size]
    tokens, eval_every = args.tokens or tokens, args.eval_every or eval_every
    builtin = Path(args.builtin_dir) if Path(args.builtin_dir).is_absolute() else ROOT / args.builtin_dir
    recipe = scaled_recipe(tokens, samples, str(builtin), args.set)
    cpu = cpu_kind()
    print(f"CPU: {cpu}; {args.threads} threads")
    print(f"{tokens:,} tokens, batch {recipe.batch.start_batch_tokens:,} -> {recipe.batch.end_batch_tokens:,} tokens, "
          f"orthon {recipe.optim.algorithm} (peak {recipe.schedule.peak_lr}), transformers AdamW (peak {args.hf_lr})")
    curves = run(recipe, args.hf_lr, eval_every)
    target = curves["transformers"][-1][2]
    hf_total = curves["transformers"][-1][0]
    reach = time_to_reach([(t, loss) for t, _, loss in curves["orthon"]], target)
    ratio = None if reach is None else reach / hf_total
    out = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"tiny recipe, {tokens:,} tokens: held-out loss against wall time ({args.threads} threads)"
    plot(curves, target, out / "time_to_loss.png", title)
    figures = {"transformers_final_eval_loss": round(target, 4), "transformers_wall_s": round(hf_total, 1),
               "orthon_final_eval_loss": round(curves["orthon"][-1][2], 4),
               "orthon_wall_s": round(curves["orthon"][-1][0], 1),
               "orthon_s_to_transformers_final": None if reach is None else round(reach, 1),
               "tokens": tokens, "hf_peak_lr": args.hf_lr, "threads": args.threads, "cpu": cpu}
    ratios = {"time_to_transformers_final_loss": None if ratio is None else round(ratio, 3)}
    atomic_write_json(out / "time_to_loss.json", {"figures": figures, "ratios": ratios,
                                                 "curves": {n: [list(p) for p in c] for n, c in curves.items()}})
    print(f"transformers + AdamW: held-out {target:.4f} after {hf_total:.1f} s")
    print(f"orthon: held-out {figures['orthon_final_eval_loss']:.4f} after {figures['orthon_wall_s']:.1f} s; "
          + (f"reached {target:.4f} at {reach:.1f} s: {ratio:.2f}x transformers' time" if reach is not None
             else f"never reached {target:.4f}"))
    print(f"wrote {out / 'time_to_loss.png'} and {out / 'time_to_loss.json'}")
    report("time_to_loss", figures, ratios)


if __name__ == "__main__":
    main()
