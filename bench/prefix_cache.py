"""The engine's prefix cache (orthon.engine.prefix_cache) on an agentic GRPO rollout, against the same
engine without it: the tiny model, one thread.

The workload: --prompts prompts of a shared system prompt (--system tokens) and a task (--task
tokens), --group samples each (GRPO's G), over --turns turns: each turn samples --response tokens
(seeded, no stop token, so every run makes the same number), then a tool's answer of --tool tokens is
appended and the conversation goes on. Every turn is one ``generate`` call of all prompts x G rows.
Without the cache each turn prefills the whole conversation of every row; with it, a group's rows
share one prefill and each later turn runs only the new tokens. Reported: wall time and prompt
tokens computed each way (best of --repeats), the ratio, and how many responses came out the same
(the two ways differ only by float round-off, so a sampled token can flip where two are near-tied).
Two single-turn workloads: one RL iteration's rollouts on an empty cache (as after every weight
update), 2 x --prompts tasks behind the system prompt, G samples each (the system prompt runs once,
each task once); and distinct prompts with nothing to reuse, which shows what the cache costs where
it cannot help.

    python bench/prefix_cache.py [--prompts 4] [--group 8] [--turns 3] [--repeats 2]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

from orthon.engine.in_process import EngineConfig, InProcessEngine  # noqa: E402
from orthon.engine.sampling import SamplingParams  # noqa: E402
from orthon.pretrain.model import GLMForCausalLM  # noqa: E402
from orthon.pretrain.recipe import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def rollout(engine, starts, group, turns, response, tool_answers):
    """Each prompt's G conversations over the turns; returns (wall seconds, responses)."""
    rows = [list(p) for p in starts for _ in range(group)]
    seeds = [1000 + i for i in range(len(rows))]
    out = []
    begin = time.perf_counter()
    for turn in range(turns):
        params = [SamplingParams(max_new_tokens=response, temperature=1.0, seed=s + 7919 * turn, stop_token_ids=())
                  for s in seeds]
        results = engine.generate(rows, params)
        out.append([r.tokens for r in results])
        rows = [row + r.tokens + tool_answers[turn][i // group] for i, (row, r) in enumerate(zip(rows, results))]
    return time.perf_counter() - begin, out


def measure(model, label, workload, repeats):
    best = {}
    for _ in range(repeats):
        for name, tokens in (("without", 0), ("with", EngineConfig.prefix_cache_tokens)):
            engine = InProcessEngine(model, EngineConfig(prefix_cache_tokens=tokens))
            wall, out = rollout(engine, *workload)
            computed = engine.stats.prompt_tokens - engine.stats.cached_tokens
            if name not in best or wall < best[name][0]:
                best[name] = (wall, computed, out)
    (w0, c0, out0), (w1, c1, out1) = best["without"], best["with"]
    pairs = [(a, b) for t0, t1 in zip(out0, out1) for a, b in zip(t0, t1)]
    same = sum(a == b for a, b in pairs)
    print(f"{label}: without the cache {w0:.2f} s ({c0} prompt tokens not from the cache), with it {w1:.2f} s ({c1}): "
          f"{w0 / w1:.2f}x; the same responses {same} of {len(pairs)}")
    figures = {f"{label}_without_s": round(w0, 3), f"{label}_with_s": round(w1, 3),
               f"{label}_prompt_tokens_uncached_without": c0, f"{label}_prompt_tokens_uncached_with": c1,
               f"{label}_same_responses": f"{same}/{len(pairs)}"}
    return figures, {f"{label}_speedup": round(w0 / w1, 3)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system", type=int, default=384)
    parser.add_argument("--task", type=int, default=64)
    parser.add_argument("--response", type=int, default=48)
    parser.add_argument("--tool", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_kind()}; 1 thread; {args.prompts} prompts x G {args.group}, {args.turns} turns of "
          f"{args.response} tokens, system prompt {args.system}, task {args.task}, tool answers {args.tool}")
    config = load_recipe(ROOT / "configs/tiny.yaml").model
    torch.manual_seed(0)
    model = GLMForCausalLM(config).eval()
    rng = random.Random(1)

    def tokens(n):
        return [rng.randrange(2, config.vocab_size) for _ in range(n)]

    system = tokens(args.system)
    agentic = ([system + tokens(args.task) for _ in range(args.prompts)], args.group, args.turns, args.response,
               [[tokens(args.tool) for _ in range(args.prompts)] for _ in range(args.turns)])
    # One RL iteration after a weight update (the cache empty): 2 x prompts tasks behind the system
    # prompt, G samples each, one turn.
    first_turn = ([system + tokens(args.task) for _ in range(2 * args.prompts)], args.group, 1, args.response,
                  [[[]] * (2 * args.prompts)])
    n = args.prompts * args.group  # as many rows, all different, one turn
    distinct = ([tokens(args.system + args.task) for _ in range(n)], 1, 1, args.response, [[[]] * n])
    rollout(InProcessEngine(model), distinct[0][:4], 1, 1, 4, [[[]] * 4])  # warm (allocator, packed decode weights)
    figures, ratios = {}, {}
    for label, workload in (("agentic_grpo", agentic), ("rl_first_turn", first_turn), ("distinct_prompts", distinct)):
        f, r = measure(model, label, workload, args.repeats)
        figures.update(f)
        ratios.update(r)
    report("prefix_cache", figures, ratios)


if __name__ == "__main__":
    main()
