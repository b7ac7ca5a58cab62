"""Training-step time of the MindSpore backend against the torch backend, in one run.

The tiny recipe (configs/tiny.yaml: 8.6M parameters, Muon + Split, dense MLA as pretraining runs it),
one optimizer step of 16 x 256 tokens (the recipe's micro-batch) on the same random batch: forward,
backward, Muon + AdamW, the MoE balancing step, through each backend's trainer (torch: the Trainer;
MindSpore: MindSporeTrainer, PyNative and graph mode). The backends alternate so drift in machine load
hits both alike; the first steps (graph compilation, jit of the optimizer's update functions) are
warm-up and not counted.

    OMP_NUM_THREADS=1 python bench/mindspore_step.py [--repeats 5] [--modes pynative,graph] [--micro 16]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, median_time, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def random_batch(vocab: int, rows: int, seq_len: int, seed: int = 0):
    from orthon.data.loader import Batch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=g)
    return Batch(input_ids=tokens[:, :-1], labels=tokens[:, 1:], doc_ids=torch.zeros(rows, seq_len, dtype=torch.long),
                 sample_ids=torch.arange(rows), source_ids=torch.zeros(rows, dtype=torch.long))


def trainer(backend: str, mode: str, overrides: list[str], run_dir: Path):
    from orthon.pretrain.recipe import load_recipe

    recipe = load_recipe(ROOT / "configs/tiny.yaml", [f"backend={backend}", f"mindspore.mode={mode}",
                                                       "train.track_max_logit=false", *overrides])
    if backend == "mindspore":
        from orthon.backends.mindspore.trainer import MindSporeTrainer

        return MindSporeTrainer(recipe, run_dir, with_data=False)
    from orthon.pretrain.trainer import Trainer

    return Trainer(recipe, run_dir, with_data=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default="pynative,graph", help="MindSpore modes to time (one process each "
                                                                  "would be cleaner; MindSpore sets the mode per process)")
    parser.add_argument("--micro", type=int, default=16, help="sequences in the step (the recipe's micro-batch)")
    parser.add_argument("--set", nargs="*", default=[], help="recipe overrides for both backends")
    args = parser.parse_args()
    print(f"CPU: {cpu_kind()}; torch threads {torch.get_num_threads()}")
    tmp = Path(tempfile.mkdtemp(prefix="ms_step_"))
    overrides = [f"train.micro_batch_size={args.micro}", *args.set]
    runners = {"torch": trainer("torch", "pynative", overrides, tmp / "torch")}
    import mindspore

    for mode in args.modes.split(","):
        runners[f"mindspore_{mode}"] = trainer("mindspore", mode, overrides, tmp / mode)
    seq = runners["torch"].seq_len
    batch = random_batch(runners["torch"].recipe.model.vocab_size, args.micro, seq)
    tokens = args.micro * seq
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(2):
        for name, runner in runners.items():
            if name.startswith("mindspore"):
                mindspore.set_context(mode=mindspore.GRAPH_MODE if name.endswith("graph") else mindspore.PYNATIVE_MODE)
            times[name].append(median_time(lambda: runner.train_step(batch, tokens), max(1, args.repeats // 2 + 1),
                                           warmup=2))
    best = {name: min(t) for name, t in times.items()}
    print(f"{'backend':<22}{'step s':>9}{'tokens/s':>11}{'vs torch':>10}")
    for name, seconds in best.items():
        print(f"{name:<22}{seconds:>9.3f}{tokens / seconds:>11,.0f}{best['torch'] / seconds:>10.2f}")
    report("mindspore_step",
           {f"{name}_step_s": round(s, 4) for name, s in best.items()} | {"tokens_per_step": tokens, "cpu": cpu_kind()},
           {f"{name}_speed_vs_torch": round(best["torch"] / s, 3) for name, s in best.items() if name != "torch"})


if __name__ == "__main__":
    main()
