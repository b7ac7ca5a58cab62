"""Continuous batching against wave batching: the engine server's batcher on the tiny model.

K closed-loop clients (each sends its next request when the last one is answered) put N requests through
one ContinuousBatcher on an InProcessEngine (one thread; greedy, no stop token, so each request makes
exactly its tokens). With waves only, a request that arrives while a wave decodes waits for the wave's
longest response, and the rows that finish early sit empty; with continuous batching it joins the
running wave once a quarter of its rows are free (the engine's ``join_free_share``; its own prefill,
then the wave's decode steps; ``--join-free-share 0`` joins at every free row). Two mixes of response
lengths: "uniform" (each drawn from --min-tokens..--max-tokens) and "long tail" (--long-share of them
--long-tokens long, the rest --short-tokens). Both ways run the same requests, in turn (--repeats
rounds); reported per mix: generated tokens a second and each request's latency (submitted to
answered) mean and 90th percentile, and the short requests' mean latency in the long-tail mix, best
round of each, with ratios (continuous / waves).

    python bench/continuous_batching.py [--clients 16] [--requests 96] [--repeats 2]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

from orthon.engine.batcher import ContinuousBatcher, Pending  # noqa: E402
from orthon.engine.in_process import EngineConfig, InProcessEngine  # noqa: E402
from orthon.engine.sampling import SamplingParams  # noqa: E402
from orthon.pretrain.model import GLMForCausalLM  # noqa: E402
from orthon.pretrain.recipe import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(engine, requests, clients: int, continuous: bool) -> tuple[float, list[float], list]:
    """Wall time, each request's latency and the results of putting ``requests`` through K clients."""
    batcher = ContinuousBatcher(engine, continuous=continuous)
    todo, lock = list(enumerate(requests)), threading.Lock()
    latencies, results = [0.0] * len(requests), [None] * len(requests)

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i, (prompt, params) = todo.pop(0)
            start = time.perf_counter()
            pending = Pending(prompt, params, f"r{i}")
            batcher.submit([pending])
            results[i] = pending.future.result()
            latencies[i] = time.perf_counter() - start

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    batcher.close()
    return wall, latencies, results


def compare(engine, requests, clients: int, repeats: int, mix: str) -> tuple[dict, dict]:
    tokens = sum(p.max_new_tokens for _, p in requests)
    shortest = min(p.max_new_tokens for _, p in requests)
    best, outputs = {}, {}
    for _ in range(repeats):
        for name, continuous in (("waves", False), ("continuous", True)):
            wall, latencies, results = run(engine, requests, clients, continuous)
            if name not in best or wall < best[name][0]:
                best[name] = (wall, latencies)
            outputs[name] = [r.tokens for r in results]
    assert outputs["waves"] == outputs["continuous"], f"{mix}: continuous batching changed some request's tokens"
    figures, ratios = {}, {}
    for name, (wall, latencies) in best.items():
        ordered = sorted(latencies)
        short = [t for t, (_, p) in zip(latencies, requests) if p.max_new_tokens == shortest]
        figures.update({f"{mix}_{name}_tokens_per_s": round(tokens / wall, 1),
                        f"{mix}_{name}_latency_mean_s": round(statistics.mean(latencies), 3),
                        f"{mix}_{name}_latency_p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
                        f"{mix}_{name}_shortest_latency_mean_s": round(statistics.mean(short), 3)})
        print(f"{mix:>9} {name:>10}: {tokens / wall:8.1f} tokens/s, latency mean "
              f"{figures[f'{mix}_{name}_latency_mean_s']:.3f} s, p90 {figures[f'{mix}_{name}_latency_p90_s']:.3f} s, "
              f"the shortest requests' mean {figures[f'{mix}_{name}_shortest_latency_mean_s']:.3f} s")
    ratios[f"{mix}_tokens_per_s_continuous_vs_waves"] = round(best["waves"][0] / best["continuous"][0], 3)
    for stat in ("latency_mean_s", "latency_p90_s", "shortest_latency_mean_s"):
        ratios[f"{mix}_{stat}_continuous_vs_waves"] = round(figures[f"{mix}_continuous_{stat}"]
                                                            / figures[f"{mix}_waves_{stat}"], 3)
    print(f"{mix:>9} continuous / waves: throughput {ratios[f'{mix}_tokens_per_s_continuous_vs_waves']:.2f}x, "
          f"latency mean {ratios[f'{mix}_latency_mean_s_continuous_vs_waves']:.2f}, p90 "
          f"{ratios[f'{mix}_latency_p90_s_continuous_vs_waves']:.2f}, the shortest requests' "
          f"{ratios[f'{mix}_shortest_latency_mean_s_continuous_vs_waves']:.2f}; the same tokens for every request")
    return figures, ratios


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=512)
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--join-free-share", type=float, default=EngineConfig.join_free_share)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_kind()}; 1 thread; {args.clients} clients, {args.requests} requests a mix; "
          f"newcomers join at {args.join_free_share:g} of the rows free")
    config = load_recipe(ROOT / "configs/tiny.yaml").model
    torch.manual_seed(0)
    # No prefix cache: both ways run the same requests in turn (bench/prefix_cache.py measures it).
    engine = InProcessEngine(GLMForCausalLM(config).eval(), EngineConfig(max_batch_size=args.clients, prefix_cache_tokens=0,
                                                                        join_free_share=args.join_free_share))
    rng = random.Random(1)

    def requests(length):
        return [([rng.randrange(2, config.vocab_size) for _ in range(args.prompt_len)],
                 SamplingParams(max_new_tokens=length(), temperature=0.0, stop_token_ids=()))
                for _ in range(args.requests)]

    mixes = {"uniform": requests(lambda: rng.randint(args.min_tokens, args.max_tokens)),
             "long_tail": requests(lambda: args.long_tokens if rng.random() < args.long_share else args.short_tokens)}
    run(engine, mixes["uniform"][: args.clients], args.clients, True)  # warm (allocator, packed decode weights)
    figures, ratios = {}, {}
    for mix, reqs in mixes.items():
        f, r = compare(engine, reqs, args.clients, args.repeats, mix)
        figures.update(f)
        ratios.update(r)
    report("continuous_batching", figures, ratios)


if __name__ == "__main__":
    main()
