"""Packed documents (``data.document_mask``): a training step's time and memory with each document's
queries over its own keys (orthon.pretrain.run_attention, the CPU path) against the (T, S) document
mask through SDPA (the path before it, still taken where documents are not contiguous).

configs/tiny.yaml's model, dense attention (pretraining's), activation checkpointing, one sequence of T
tokens packed with documents of random lengths (mean ``--doc-len``), forward + backward. Each (way, T)
runs in a fresh process, a warm-up step at 256 tokens then the measured steps; memory is the peak
resident set above the level before the measured steps (VmHWM).

    python bench/document_attention.py [--lengths 2048,8192] [--doc-len 512] [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402
from long_context import Meter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _docs(T: int, mean: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids, doc = [], 0
    while len(ids) < T:
        ids += [doc] * int(torch.randint(mean // 4, 2 * mean - mean // 4, (1,), generator=g))
        doc += 1
    return torch.tensor([ids[:T]])


def measure(way: str, T: int, doc_len: int, steps: int) -> dict:
    import orthon.pretrain.attention as attention
    from orthon.pretrain.config import RuntimeOptions
    from orthon.pretrain.loss import chunked_cross_entropy
    from orthon.pretrain.model import GLMForCausalLM
    from orthon.pretrain.recipe import load_recipe

    if way == "mask":
        attention.document_pieces = lambda runs, k_docs: None  # the fallback: the document mask
    torch.manual_seed(0)
    cfg = load_recipe(ROOT / "configs" / "tiny.yaml").model.replace(max_position_embeddings=1 << 20)
    model = GLMForCausalLM(cfg, runtime=RuntimeOptions(sparse_attention=False, activation_checkpointing=True)).train()

    def step(n):
        ids = torch.randint(0, cfg.vocab_size, (1, n + 1))
        hidden, _ = model.hidden_states(ids[:, :-1], doc_ids=_docs(n, min(doc_len, n), 1))
        (chunked_cross_entropy(hidden, model.lm_head.weight, ids[:, 1:], 1024) / n).backward()
        model.zero_grad(set_to_none=True)

    step(256)
    meter, times = Meter(torch.device("cpu")), []
    meter.start()
    for _ in range(steps):
        t0 = time.perf_counter()
        step(T)
        times.append(time.perf_counter() - t0)
    _, peak_mb = meter.stop()
    return {"way": way, "T": T, "step_s": statistics.median(times), "peak_mb": peak_mb}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("WAY", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.doc_len, args.steps)))
        return
    print(cpu_kind())
    figures, ratios = {}, {}
    for T in (int(t) for t in args.lengths.split(",")):
        rows = {}
        for way in ("pieces", "mask"):
            out = subprocess.run([sys.executable, __file__, "--child", way, str(T), "--doc-len", str(args.doc_len),
                                  "--steps", str(args.steps)], capture_output=True, text=True, check=True)
            rows[way] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"T={T:>6} {way:>6}: step {rows[way]['step_s']:.3f} s, peak +{rows[way]['peak_mb']:,.0f} MB")
        figures[f"T{T}"] = rows
        ratios[f"T{T}_time"] = rows["pieces"]["step_s"] / rows["mask"]["step_s"]
        ratios[f"T{T}_memory"] = rows["pieces"]["peak_mb"] / max(rows["mask"]["peak_mb"], 1e-9)
    report("document_attention", figures, ratios)


if __name__ == "__main__":
    main()
