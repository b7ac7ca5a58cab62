"""Training throughput and peak memory: orthon's training step (hybrid Muon/AdamW, chunk-free loss with
no logits kept) against a plain reference loop (transformers' GlmMoeDsaForCausalLM + torch AdamW),
same config, same weights, same batch. Each variant runs in its own process so its peak RSS is its own.

    python bench/train_throughput.py [--steps 4] [--batch 8] [--seq 256] [--optim KEY=VALUE ...]

``--optim`` adds recipe overrides to orthon's optimizer, e.g. ``optim.bf16_matmul=emulated`` (Muon as a CPU
whose bf16 GEMM is emulated runs it: Newton-Schulz in fp32) or ``optim.ns_method=gram``.

Variants: orthon with Muon + Split (unfused, and with optim.fused), orthon with AdamW only, and the
reference. The fused variant's peak RSS includes torch.compile's own memory (its first step compiles).

The config is configs/tiny.yaml's model with index_topk = seq (transformers always runs its indexer;
with top-k >= T its selection is every causal key, so both compute dense causal attention).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("orthon_muon", "orthon_muon_fused", "orthon_adamw", "hf_adamw")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(variant: str, steps: int, batch: int, seq: int, weights: str, optim: list[str]) -> dict:
    import torch

    from orthon.pretrain.recipe import load_recipe
    from orthon.optim import build_for_model
    from orthon.pretrain.weights import load_weights

    torch.manual_seed(0)
    recipe = load_recipe(ROOT / "configs/tiny.yaml", [f"model.index_topk={seq}", "runtime.sparse_attention=true"])
    ids = torch.randint(0, recipe.model.vocab_size, (batch, seq + 1))
    if variant == "hf_adamw":
        from transformers import GlmMoeDsaForCausalLM

        model = GlmMoeDsaForCausalLM.from_pretrained(weights, dtype=torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def loss_fn():
            logits = model(ids[:, :-1]).logits
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    else:
        model = load_weights(weights, sparse_attention=True).train()
        algorithm = "adamw" if variant == "orthon_adamw" else "muon"
        # orthon_muon_fused: optim.fused, its first (compiling) step among the two untimed ones.
        recipe = load_recipe(ROOT / "configs/tiny.yaml", [f"optim.algorithm={algorithm}",
                                                         f"optim.fused={variant == 'orthon_muon_fused'}", *optim])
        opt = build_for_model(model, recipe.optim, recipe.schedule)
        opt.set_tokens(recipe.schedule.warmup_tokens)

        def loss_fn():
            return model(ids[:, :-1], labels=ids[:, 1:], return_logits=False).loss
    rss_before = _rss_mb()
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    times.sort()
    return {"tokens_per_s": batch * seq / times[len(times) // 2], "peak_rss_mb": _rss_mb(),
            "step_peak_mb": _rss_mb() - rss_before}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--weights")
    parser.add_argument("--optim", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides for orthon's optimizer (optim.*)")
    args = parser.parse_args()
    if any(not o.startswith("optim.") for o in args.optim):
        parser.error(f"--optim takes optim.* overrides, got {args.optim}")
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.batch, args.seq, args.weights, args.optim)))
        return
    import torch

    from orthon.pretrain.weights import save_weights
    from orthon.pretrain.model import GLMForCausalLM
    from orthon.pretrain.recipe import load_recipe

    config = load_recipe(ROOT / "configs/tiny.yaml", [f"model.index_topk={args.seq}"]).model
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as weights:
        save_weights(GLMForCausalLM(config), weights)
        results = {}
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--worker", variant, "--weights", weights,
                                  "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
                                  "--optim", *args.optim],
                                 capture_output=True, text=True, check=True)
            results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"CPU: {cpu_kind()}")
    print(f"orthon's optimizer overrides: {' '.join(args.optim) or 'none'}")
    print(f"batch {args.batch} x {args.seq}, tiny config ({sum(p.numel() for p in GLMForCausalLM(config).parameters()) / 1e6:.2f}M)")
    print(f"{'variant':<14}{'tokens/s':>10}{'peak RSS MB':>13}{'step MB':>9}")
    for name, r in results.items():
        print(f"{name:<14}{r['tokens_per_s']:>10,.0f}{r['peak_rss_mb']:>13,.0f}{r['step_peak_mb']:>9,.0f}")
    ref = results["hf_adamw"]
    figures = {f"{k}_{name}": round(v, 1) for name, r in results.items() for k, v in r.items()}
    ratios = {
        "tokens_per_s_vs_hf_adamw": round(results["orthon_muon"]["tokens_per_s"] / ref["tokens_per_s"], 3),
        "tokens_per_s_fused_vs_hf_adamw": round(results["orthon_muon_fused"]["tokens_per_s"] / ref["tokens_per_s"], 3),
        "tokens_per_s_adamw_vs_hf_adamw": round(results["orthon_adamw"]["tokens_per_s"] / ref["tokens_per_s"], 3),
        "peak_rss_vs_hf_adamw": round(results["orthon_muon"]["peak_rss_mb"] / ref["peak_rss_mb"], 3),
        "step_memory_vs_hf_adamw": round(results["orthon_muon"]["step_peak_mb"] / max(ref["step_peak_mb"], 1e-9), 3),
    }
    report("train_throughput", figures, ratios)


if __name__ == "__main__":
    main()
