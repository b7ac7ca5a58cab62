"""Memory and time of a long-context training step against sequence length: dense vs DSA attention.

The model is configs/tiny.yaml's (hidden 256, 4 layers, index_topk 64), trained as mid-training trains
it: activation checkpointing per layer, the chunked cross-entropy, forward + backward. Three ways to
run attention, in one run:
  dense   plain causal MLA (SDPA), what pretraining runs: the reference
  mask    DSA through SDPA with a dense T x T top-k mask
  gather  DSA gathering each query's top-k latents (absorbed MQA form, query chunks): orthon's default
Two measurements per (way, T), each in a fresh process:
  step    the whole training step of the model
  attn    the main attention alone (one layer, given q, latents and top-k; forward + backward), the
          part DSA makes linear in T
Memory: peak above the pre-step level (CUDA: max_memory_allocated; CPU: the process's peak resident
set, VmHWM, reset before the step). Time: wall clock of the one measured step (after a warm-up at 128).

    python bench/long_context.py [--lengths 1024,2048,4096,8192,16384] [--mask-max 8192] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("dense", "mask", "gather")


# ---------------------------------------------------------------- one measurement (child process)
def _rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class Meter:
    def __init__(self, device):
        self.device = device

    def start(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            _rss_peak_reset()
            self.base = _status_kb("VmRSS") * 1024
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _status_kb("VmHWM") * 1024
        return time.perf_counter() - self.t0, (peak - self.base) / 2**20


def _model(way: str, device):
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.config import RuntimeOptions
    from orthon.pretrain.model import GLMForCausalLM

    cfg = load_recipe(ROOT / "configs" / "tiny.yaml").model.replace(max_position_embeddings=1 << 20)
    runtime = RuntimeOptions(sparse_attention=way != "dense", sparse_impl="gather" if way == "gather" else "mask",
                             query_chunk=1024, activation_checkpointing=True)
    model = GLMForCausalLM(cfg, runtime=runtime).to(device)
    model.train()
    return model


def _train_step(model, T, device):
    from orthon.pretrain.loss import chunked_cross_entropy

    ids = torch.randint(0, model.config.vocab_size, (1, T + 1), device=device)
    hidden, _ = model.hidden_states(ids[:, :-1])
    loss = chunked_cross_entropy(hidden, model.lm_head.weight, ids[:, 1:], 1024) / T
    loss.backward()
    model.zero_grad(set_to_none=True)


def _attention_inputs(attn, T, device, k):
    from orthon.pretrain.topk import deterministic_topk

    g = torch.Generator(device="cpu").manual_seed(0)
    H, D = attn.n_heads, attn.rank + attn.rope
    q_nope = torch.randn(1, T, H, attn.nope, generator=g).to(device).requires_grad_()
    q_rope = torch.randn(1, T, H, attn.rope, generator=g).to(device).requires_grad_()
    latent = torch.randn(1, T, D, generator=g).to(device).requires_grad_()
    # Causal random top-k: the selection itself is not what is measured here.
    topk = torch.cat([deterministic_topk(torch.rand(1, c1 - c0, T, generator=g).masked_fill(
        torch.arange(T) > torch.arange(c0, c1)[:, None], -1.0), k) for c0, c1 in _chunks(T, 1024)], dim=1)
    return q_nope, q_rope, latent, topk.to(device)


def _chunks(T, c):
    return [(s, min(T, s + c)) for s in range(0, T, c)]


def _attention_step(attn, inputs, way):
    from orthon.pretrain.attention import attention_mask

    q_nope, q_rope, latent, topk = inputs
    T = latent.shape[1]
    slots = torch.arange(T, device=latent.device)
    if way == "dense":
        out = attn._expanded(q_nope, q_rope, latent, None)
    elif way == "mask":
        out = attn._expanded(q_nope, q_rope, latent, attention_mask(topk, slots, T))
    else:
        out = attn._absorbed(q_nope, q_rope, latent, slots, topk)
    out.float().square().mean().backward()


def measure(way: str, kind: str, T: int, device: str) -> dict:
    torch.manual_seed(0)
    dev = torch.device(device)
    model = _model(way, dev)
    meter = Meter(dev)
    if kind == "step":
        _train_step(model, 128, dev)  # warm-up
        meter.start()
        _train_step(model, T, dev)
    else:
        attn = model.model.layers[0].self_attn
        _attention_step(attn, _attention_inputs(attn, 128, dev, model.config.index_topk), way)
        inputs = _attention_inputs(attn, T, dev, model.config.index_topk)
        meter.start()
        _attention_step(attn, inputs, way)
    seconds, mib = meter.stop()
    return {"way": way, "kind": kind, "T": T, "seconds": seconds, "peak_mib": mib}


# ---------------------------------------------------------------- the driver
def run_child(way, kind, T, device, threads, timeout):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--child", way, kind, str(T), "--device", device]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"way": way, "kind": kind, "T": T, "error": f"over {timeout}s"}
    if proc.returncode != 0:
        return {"way": way, "kind": kind, "T": T, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--mask-max", type=int, default=8192, help="longest T for the T x T mask way (its memory is quadratic)")
    parser.add_argument("--kinds", default="attn,step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per measurement")
    parser.add_argument("--child", nargs=3, metavar=("WAY", "KIND", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        way, kind, T = args.child
        print(json.dumps(measure(way, kind, int(T), args.device)))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for kind in args.kinds.split(","):
        for T in lengths:
            for way in WAYS:
                if way == "mask" and T > args.mask_max:
                    continue
                row = run_child(way, kind, T, args.device, args.threads, args.timeout)
                rows.append(row)
                print(_line(row), flush=True)
    print(f"\nlong-context training step on {args.device} (tiny model, batch 1, activation checkpointing, chunked CE)")
    print(f"{'kind':<5} {'T':>6} | " + " | ".join(f"{w:>8} MiB {w:>8} s" for w in WAYS))
    for kind in args.kinds.split(","):
        for T in lengths:
            cells = []
            for way in WAYS:
                r = _find(rows, way, kind, T)
                cells.append(f"{'-':>12} {'-':>10}" if r is None or "error" in r else f"{r['peak_mib']:>12.1f} {r['seconds']:>10.3f}")
            print(f"{kind:<5} {T:>6} | " + " | ".join(cells))
    figures, ratios = {}, {}
    for r in rows:
        if "error" not in r:
            figures[f"{r['kind']}_{r['way']}_{r['T']}_mib"] = round(r["peak_mib"], 2)
            figures[f"{r['kind']}_{r['way']}_{r['T']}_s"] = round(r["seconds"], 4)
    for kind in args.kinds.split(","):
        for T in lengths:
            dense = _find(rows, "dense", kind, T)
            for way in ("gather", "mask"):
                r = _find(rows, way, kind, T)
                if dense and r and "error" not in dense and "error" not in r and dense["peak_mib"] > 0:
                    ratios[f"{kind}_mem_{way}_vs_dense_{T}"] = round(r["peak_mib"] / dense["peak_mib"], 3)
                    ratios[f"{kind}_time_{way}_vs_dense_{T}"] = round(r["seconds"] / dense["seconds"], 3)
    gather = [(_find(rows, "gather", "attn", T) or {}).get("peak_mib") for T in lengths]
    if all(isinstance(m, float) for m in gather) and len(lengths) > 1:
        # Linear in T: memory per token stays flat from the shortest to the longest length.
        figures["attn_gather_mib_per_1k_tokens"] = [round(m / T * 1024, 3) for m, T in zip(gather, lengths)]
    report("long_context", figures, ratios)


def _find(rows, way, kind, T):
    return next((r for r in rows if r["way"] == way and r["kind"] == kind and r["T"] == T), None)


def _line(r):
    if "error" in r:
        return f"  {r['kind']:<5} {r['way']:<7} T={r['T']:<6} failed: {r['error']}"
    return f"  {r['kind']:<5} {r['way']:<7} T={r['T']:<6} {r['peak_mib']:9.1f} MiB {r['seconds']:8.3f} s"


if __name__ == "__main__":
    main()
