"""Where the arithmetic RL task's held-out reward can go: each model's reward broken down by problem kind.

    python bench/rl_headroom.py runs/tiny_arith/final runs/rl_tiny/final [--eval-size 400] [--samples 4]

The held-out set of configs/rl_tiny.yaml's task (orthon.rl.tasks.ArithmeticTask, difficulty 1-2, the
same seed), split by operation and operand digits ("+ 2x1": a two-digit plus a one-digit number). For each
weights directory: the greedy reward and the mean reward of ``--samples`` answers at temperature 1 (what
RL maximises) per kind and overall. GRPO learns only where some of a group's samples are right, so the
kinds a model never gets right bound what RL can add from that start: the last column prints the reward
with every such kind left at its sampled value and every other kind solved.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def kind(text: str) -> str:
    """'+ 2x1' for 'Q: 47+3=? A:'."""
    expression = text.split("Q: ", 1)[1].split("=", 1)[0]
    op = next(c for c in expression[1:] if c in "+-*")
    left, right = expression.split(op, 1)
    return f"{op} {len(left)}x{len(right)}"


def main():
    from orthon.data.tokenizer import load_tokenizer
    from orthon.engine.in_process import InProcessEngine
    from orthon.engine.sampling import SamplingParams
    from orthon.pretrain.weights import load_weights
    from orthon.rl.tasks import ArithmeticTask, arithmetic_reward

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("weights", nargs="+", help="weights directories (a run's final/)")
    parser.add_argument("--tokenizer", default=str(ROOT / "runs/builtin/tokenizer_4096.model"))
    parser.add_argument("--eval-size", type=int, default=400)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.tokenizer)
    task = ArithmeticTask(tokenizer, difficulty=2, min_difficulty=1, eval_size=args.eval_size)
    prompts = task.eval_set()
    kinds = [kind(p.text) for p in prompts]
    names = sorted(set(kinds))
    print(f"{len(prompts)} held-out problems: " + ", ".join(f"{k} {kinds.count(k)}" for k in names))
    for path in args.weights:
        engine = InProcessEngine(load_weights(path).eval())
        scores = {}
        for mode, temperature, n in (("greedy", 0.0, 1), ("sampled", 1.0, args.samples)):
            params = SamplingParams(max_new_tokens=8, temperature=temperature, stop_token_ids=task.stop_token_ids, seed=0)
            results = engine.generate([p.ids for p in prompts for _ in range(n)], params)
            per_kind = collections.defaultdict(list)
            for i, result in enumerate(results):
                prompt = prompts[i // n]
                per_kind[kind(prompt.text)].append(arithmetic_reward(tokenizer.decode(result.tokens), prompt.label))
            scores[mode] = {k: sum(v) / len(v) for k, v in per_kind.items()}
        weight = {k: kinds.count(k) / len(kinds) for k in names}
        overall = {m: sum(weight[k] * scores[m][k] for k in names) for m in scores}
        # Kinds that no greedy answer and almost no sample gets right give GRPO no signal.
        cap = sum(weight[k] * (scores["sampled"][k] if scores["greedy"][k] < 0.2 else 1.0) for k in names)
        print(f"\n{path}: greedy {overall['greedy']:.3f}, sampled {overall['sampled']:.3f}, "
              f"reachable by RL about {cap:.3f}")
        for k in names:
            print(f"  {k:>6}: greedy {scores['greedy'][k]:.2f}  sampled {scores['sampled'][k]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
