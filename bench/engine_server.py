"""The engine server's cost over the in-process engine, and how HTTPEngine should send a batch.

configs/tiny.yaml's model saved as a weights directory, served by `orthon serve` (one thread) and
loaded in this process (one thread); the two run in turn, never at once. N requests of a P-token
prompt and exactly T new tokens each (greedy, no stop token), generated four ways:

  in_process     InProcessEngine.generate(all N) in this process: the reference
  http_batched   HTTPEngine, one /generate with the N prompts (shared sampling_params)
  http_parallel  HTTPEngine, N concurrent single-prompt /generate calls (what requests with their own
                 seeds or routing keys become); the server's continuous batching merges them into waves
  http_serial    N single-prompt calls one after another (what a server without batching would cost)

Generated tokens per second of each, the best of --repeats, with the ratio to in_process, and the
engine calls the server made for the parallel requests.

    python bench/engine_server.py [--requests 32] [--prompt-len 32] [--new-tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

from orthon.core.net import get_json  # noqa: E402
from orthon.engine.client import HTTPEngine  # noqa: E402
from orthon.engine.in_process import EngineConfig, InProcessEngine  # noqa: E402
from orthon.engine.sampling import SamplingParams  # noqa: E402
from orthon.pretrain.model import GLMForCausalLM  # noqa: E402
from orthon.pretrain.recipe import load_recipe  # noqa: E402
from orthon.pretrain.weights import load_weights, save_weights  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def start_server(weights: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orthon.launch.cli", "serve", str(weights), "--port", "0", "--prefix-cache-tokens", "0",
                                 "--threads", "1"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"serving .* on (http://\S+)", log.read_text())
        if found:
            return proc, found.group(1)
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"orthon serve did not start:\n{log.read_text()[-2000:]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_kind()}; 1 thread each side; {args.requests} requests x {args.new_tokens} new tokens")
    config = load_recipe(ROOT / "configs/tiny.yaml").model
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        weights = save_weights(GLMForCausalLM(config), Path(tmp) / "weights")
        # No prefix cache: the rounds repeat their prompts, which would measure the cache (bench/prefix_cache.py).
        engine = InProcessEngine(load_weights(weights).eval(), EngineConfig(prefix_cache_tokens=0))
        proc, url = start_server(weights, Path(tmp) / "server.log")
        try:
            client = HTTPEngine(url, timeout_s=600)
            g = torch.Generator().manual_seed(1)
            prompts = torch.randint(2, config.vocab_size, (args.requests, args.prompt_len), generator=g).tolist()
            params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, stop_token_ids=())
            keys = [f"r{i}" for i in range(args.requests)]  # one key each: one request each
            ways = {
                "in_process": lambda: engine.generate(prompts, params),
                "http_batched": lambda: client.generate(prompts, params),
                "http_parallel": lambda: client.generate(prompts, params, routing_keys=keys),
                "http_serial": lambda: [client.generate([p], params)[0] for p in prompts],
            }
            ways["in_process"](), ways["http_batched"]()  # warm both (allocator, packed decode weights)
            best, outputs, calls = {k: float("inf") for k in ways}, {}, 0
            for _ in range(args.repeats):
                for name, fn in ways.items():
                    before = get_json(url + "/get_server_info")["batching"]["generate_calls"]
                    start = time.perf_counter()
                    outputs[name] = fn()
                    elapsed = time.perf_counter() - start
                    if name == "http_parallel":
                        calls = get_json(url + "/get_server_info")["batching"]["generate_calls"] - before
                    best[name] = min(best[name], elapsed)
            reference = [r.tokens for r in outputs["in_process"]]
            for name, results in outputs.items():
                assert [r.tokens for r in results] == reference, f"{name}: other tokens than the in-process engine"
        finally:
            proc.terminate()
            proc.wait(30)
    tokens = args.requests * args.new_tokens
    figures = {f"{name}_tokens_per_s": round(tokens / t, 1) for name, t in best.items()}
    figures["http_parallel_engine_calls"] = calls
    ratios = {f"{name}_vs_in_process": round(best["in_process"] / t, 3) for name, t in best.items() if name != "in_process"}
    for name, t in best.items():
        print(f"{name:>14}: {tokens / t:9.1f} tokens/s  ({best['in_process'] / t:.3f} x in-process)")
    print(f"the {args.requests} parallel requests ran as {calls} engine calls")
    report("engine_server", figures, ratios)


if __name__ == "__main__":
    main()
