"""Optimizer step time: orthon's Muon (ns_method standard and gram) against torch.optim.Muon, and
Newton-Schulz against bare matmul.

Three parameter sets, each run through the optimizers in this process (standard, gram and torch
side by side on tiny and large, with each one's time over torch's):

  tiny   every Muon parameter of configs/tiny.yaml's model (Muon Split on
         W_QB/W_KVB, expert stacks). torch.optim.Muon only takes 2-D
         parameters, so it gets each Newton-Schulz block as its own 2-D
         parameter: the same arithmetic, one call per block.
  large  24 x (1024 x 1024) + 24 x (1024 x 4096) matrices.
  mla    Muon Split against plain Muon on MLA matrices (W_QB, W_KVB of 4
         layers, the tiny model's and GLM-5 head dims with 8 heads).

Newton-Schulz throughput (FLOPs / step time, so it includes the momentum
and update passes) is compared with the bare matmul rate of the kernel
Newton-Schulz runs on, measured here on the same shapes: bf16 GEMM where it
is native, the fp32 GEMM where bf16 is emulated (CPUs without AVX512-BF16/AMX,
see orthon.optim.newton_schulz). The bare bf16 GEMM rate is printed too.

On such CPUs torch.optim.Muon's bf16 GEMM runs at ~0.3-5 GFLOP/s, so its
large-set step would take about 1.5 hours. There the bench by default times
orthon on ``--large-count`` 2+2 of the matrices and estimates torch's full
set as its Newton-Schulz FLOPs over the bare bf16 GEMM rate measured here
(a lower bound on torch's time: its step is those GEMMs and more), and says
so in the keys (``_estimated``). ``--torch-large-count N`` times torch on
N+N matrices instead; both optimizers handle the large matrices one shape
batch or one matrix at a time, so times scale linearly to 24+24. Timings:
warm-up steps, then the median of ``--repeats``.

gram: Gram Newton-Schulz (orthon.optim.gram_newton_schulz) on the blocks where it pays (gram_pays), in the
device's compute dtype (bf16 where the CPU's bf16 GEMM is native, fp32 where it is emulated, fp16 on
GPUs); its FLOPs column counts what it computes. On the large set the three optimizers' steps are
interleaved (one of each per round; on tiny too where torch's bf16 GEMM is native), so load on a shared
machine hits them alike.

fused: the same with Muon(fused=True) (optim.fused: true), its momentum and update passes compiled by
torch.compile into one sweep each (orthon.optim.fused); their first step compiles, inside the warm-up.

``--emulated-bf16`` runs orthon's optimizers as a CPU whose bf16 GEMM is emulated has them run (standard in
fp32 with bf16's rounding, gram in fp32 with its fp32 symmetric-product kernel) on a CPU where it is native,
against torch.optim.Muon on this CPU's native bf16 GEMM: the emulated kind's orthon figures on the other
kind, not its ratios to torch (there torch's step takes seconds to minutes).

    python bench/muon_step.py [--sets tiny,large,mla] [--device cuda] [--threads 1] [--emulated-bf16]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from common import cpu_kind
from orthon.optim import Muon, OptimConfig, plan_for_model
from orthon.optim.gram_newton_schulz import block_flops, gram_compute_dtype
from orthon.optim.symmetric_products import KERNEL_TILES, symmetric_kernel_applies, symmetric_panels
from orthon.optim.newton_schulz import bf16_gemm_is_native, emulates_bf16, newton_schulz_flops

ROOT = Path(__file__).resolve().parents[1]
HYPER = dict(lr=2e-4, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
# How orthon's optimizers run: as this CPU has them choose, or (--emulated-bf16) as on a CPU whose bf16 GEMM
# is emulated: standard Newton-Schulz in fp32 with bf16's rounding, Gram in fp32.
MODE = {"bf16_matmul": "auto", "gram_dtype": "auto"}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_it(fn, device, warmup, repeats):
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------ parameter sets
# A set is a list of (shape, split_rows): orthon takes the parameters as they are,
# torch each Newton-Schulz block as a separate 2-D matrix.


def tiny_set():
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.model_info import meta_model

    plan = plan_for_model(meta_model(load_recipe(ROOT / "configs" / "tiny.yaml").model), OptimConfig())
    return [(r.shape, r.split_rows) for r in plan.select("muon")]


def large_set(count):
    return [((1024, 1024), 1)] * count + [((1024, 4096), 1)] * count


def mla_set(heads, qk_head, v_head, qk_nope, q_lora, kv_lora, layers=4, split=True):
    q_b = ((heads * qk_head, q_lora), heads if split else 1)
    kv_b = ((heads * (qk_nope + v_head), kv_lora), heads if split else 1)
    return [q_b, kv_b] * layers


def blocks_of(shape, split):
    rows, cols = shape[-2] // split, shape[-1]
    return math.prod(shape[:-2]) * split, (rows, cols)


def set_flops(entries, ns_method="standard", device="cpu"):
    """Newton-Schulz FLOPs of one step; gram: Gram Newton-Schulz's count on the blocks where Muon runs it."""
    total = 0
    for shape, split in entries:
        count, (rows, cols) = blocks_of(shape, split)
        total += count * block_flops(rows, cols, HYPER["ns_steps"], ns_method, MODE["gram_dtype"], device)
    return total


def orthon_flops(entries, ns_method, device):
    """What orthon's optimizer computes: ``set_flops``, except that standard's emulated-bf16 form computes its
    X X^T and b R + c R^2 by halves (orthon.optim.symmetric_products)."""
    if ns_method != "standard" or not emulates_bf16(MODE["bf16_matmul"], device):
        return set_flops(entries, ns_method, device)
    total = 0
    for shape, split in entries:
        count, (rows, cols) = blocks_of(shape, split)
        panels = symmetric_panels(min(rows, cols), device, torch.float32)
        total += count * newton_schulz_flops(rows, cols, HYPER["ns_steps"], panels)
    return total


def make_params(entries, device, as_blocks):
    """Parameters and fixed gradients; as_blocks: one 2-D tensor per Newton-Schulz block (for torch)."""
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape, split in entries:
        count, (rows, cols) = blocks_of(shape, split)
        weight = torch.randn(shape, generator=gen) * 0.02
        grad = torch.randn(shape, generator=gen)
        pieces = [(weight, grad)]
        if as_blocks:
            pieces = list(zip(weight.reshape(count, rows, cols).unbind(0), grad.reshape(count, rows, cols).unbind(0)))
        for w, g in pieces:
            p = nn.Parameter(w.contiguous().to(device))
            p.grad = g.contiguous().to(device)
            params.append((p, split if not as_blocks else 1))
    return params


def orthon_optimizer(entries, device, bf16_matmul=None, ns_method="standard", fused=False):
    params = make_params(entries, device, as_blocks=False)
    by_split = {}
    for p, split in params:
        by_split.setdefault(split, []).append(p)
    groups = [{"params": ps, "split_rows": s} for s, ps in by_split.items()]
    return Muon(groups, bf16_matmul=bf16_matmul or MODE["bf16_matmul"], ns_method=ns_method,
                gram_dtype=MODE["gram_dtype"], fused=fused, **HYPER)


def torch_optimizer(entries, device):
    params = make_params(entries, device, as_blocks=True)
    return torch.optim.Muon([p for p, _ in params], adjust_lr_fn="match_rms_adamw", **HYPER)


def orthon_step_time(entries, device, args, bf16_matmul=None, ns_method="standard"):
    opt = orthon_optimizer(entries, device, bf16_matmul, ns_method)
    return time_it(opt.step, device, args.warmup, args.repeats), opt


def torch_step_time(entries, device, args, repeats=None):
    opt = torch_optimizer(entries, device)
    return time_it(opt.step, device, args.warmup if repeats is None else 1, repeats or args.repeats), opt


def interleaved_step_times(optimizers, device, warmup, repeats, extra=None):
    """Median step time of each optimizer (name -> optimizer), one step of each per round; ``extra``:
    a name -> function run in each round too (its median time comes back under its name)."""
    jobs = {name: opt.step for name, opt in optimizers.items()} | (extra or {})
    times = {name: [] for name in jobs}
    for i in range(warmup + repeats):
        for name, fn in jobs.items():
            t = time_it(fn, device, 0, 1)
            if i >= warmup:
                times[name].append(t)
    return {name: statistics.median(v) for name, v in times.items()}, {name: min(v) for name, v in times.items()}


def bare_gemms(entries, device, dtype, iterations=1):
    """A function running the three bare GEMMs of ``iterations`` Newton-Schulz iterations on every block,
    batched by shape, and its FLOPs."""
    stacks = {}
    for shape, split in entries:
        count, (rows, cols) = blocks_of(shape, split)
        key = (min(rows, cols), max(rows, cols))
        stacks[key] = stacks.get(key, 0) + count
    tensors = [torch.randn(n, small, large, device=device, dtype=dtype) for (small, large), n in stacks.items()]
    grams = [torch.randn(n, small, small, device=device, dtype=dtype) for (small, _), n in stacks.items()]
    flops = iterations * sum(n * newton_schulz_flops(s, l, steps=1) for (s, l), n in stacks.items())

    def run():
        for _ in range(iterations):
            for x, a in zip(tensors, grams):
                torch.bmm(x, x.mT)
                torch.bmm(a, a)
                torch.bmm(a, x)

    return run, flops


def matmul_rate(entries, device, dtype, warmup, repeats, iterations=1):
    """GFLOP/s of ``bare_gemms``."""
    run, flops = bare_gemms(entries, device, dtype, iterations)
    return flops / time_it(run, device, warmup, repeats) / 1e9


# ------------------------------------------------------------------ the bench


def symmetric_products(device):
    """How Gram's symmetric n x n products run here (orthon.optim.gram_newton_schulz): the figures differ by it."""
    compute = gram_compute_dtype(MODE["gram_dtype"], device)
    if symmetric_kernel_applies(256, device, compute):
        tile = KERNEL_TILES[compute]
        kind = "bf16 kernel (AVX512-BF16)" if compute == torch.bfloat16 else "fp32 kernel (AVX2)"
        return f"upper tiles by the {kind}, n a multiple of {tile}"
    if symmetric_panels(1024, device, compute) > 1:
        return "upper panels by torch's GEMMs from n = 1,024"
    return "full products"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="tiny,large,mla")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: stable on a shared machine)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--large-count", type=int, default=None,
                        help="matrices of each large shape for orthon (default 24; 2 where bf16 is emulated)")
    parser.add_argument("--torch-large-count", type=int, default=None,
                        help="matrices of each large shape for torch (default: as orthon; where bf16 GEMM "
                             "is not native, 0: estimated from the bf16 GEMM rate)")
    parser.add_argument("--native", action="store_true",
                        help="where bf16 is emulated, also time orthon on the native bf16 GEMM (torch's kernel) "
                             "on the tiny set: the batching gain alone (~20 s a step on such CPUs)")
    parser.add_argument("--emulated-bf16", action="store_true",
                        help="run orthon's optimizers as on a CPU whose bf16 GEMM is emulated (standard in fp32 "
                             "with bf16's rounding, gram in fp32); torch.optim.Muon keeps this CPU's bf16 GEMM")
    args = parser.parse_args()
    if args.emulated_bf16:
        MODE.update(bf16_matmul="emulated", gram_dtype="fp32")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    native = bf16_gemm_is_native(device)
    kernel = torch.bfloat16 if native and not args.emulated_bf16 else torch.float32  # what orthon's NS runs on
    large_count = args.large_count or (24 if native else 2)
    torch_large = args.torch_large_count if args.torch_large_count is not None else (large_count if native else 0)
    sets = args.sets.split(",")
    bf16 = "native" if native else "emulated on fp32"
    bf16 += "; orthon runs as where it is emulated (--emulated-bf16)" if args.emulated_bf16 else ""
    print(f"device {device} ({torch.get_num_threads()} threads), bf16 GEMM {bf16}, "
          f"gram computes in {str(gram_compute_dtype(MODE['gram_dtype'], device)).removeprefix('torch.')}; "
          f"its symmetric products: {symmetric_products(device)}")
    if device.type == "cpu":
        print(f"CPU: {cpu_kind()}")

    figures, ratios, rows = {}, {}, []
    # The bare bf16 GEMM rate on one 1024^3 product (seconds where bf16 is emulated, so no repeats there).
    cube = [((1024, 1024), 1)]
    figures["bf16_matmul_gflops"] = matmul_rate(cube, device, torch.bfloat16, 1 if native else 0, 3 if native else 1)

    if "tiny" in sets:
        entries = tiny_set()
        # Interleaved rounds; where bf16 GEMM is emulated torch's step takes ~20 s: one warm-up and one
        # timed step of it after the others. The fused ones compile in their first (warm-up) step.
        optimizers = {f"{method}{suffix}": orthon_optimizer(entries, device, ns_method=method, fused=fused)
                      for fused, suffix in ((False, ""), (True, "_fused")) for method in ("standard", "gram")}
        if native:
            optimizers["torch"] = torch_optimizer(entries, device)
        median, _ = interleaved_step_times(optimizers, device, args.warmup, args.repeats)
        del optimizers
        t_ref = median.pop("torch") if native else torch_step_time(entries, device, args, repeats=1)[0]
        for name, seconds in median.items():
            method = name.removesuffix("_fused")
            label = method + (", fused passes" if name.endswith("_fused") else "")
            rows.append((f"tiny: orthon Muon, {label}", seconds, orthon_flops(entries, method, device)))
            figures[f"tiny_{name}_ms"] = 1e3 * seconds
            ratios[f"tiny_{name}_time_vs_torch"] = seconds / t_ref
        rows.append(("tiny: torch.optim.Muon", t_ref, set_flops(entries)))
        figures["tiny_blocks"] = sum(blocks_of(s, k)[0] for s, k in entries)
        figures["tiny_torch_ms"] = 1e3 * t_ref
        ratios["tiny_gram_flops_vs_standard"] = set_flops(entries, "gram", device) / set_flops(entries)
        if args.native and not native:
            t_native, _ = orthon_step_time(entries, device, argparse.Namespace(warmup=1, repeats=1), "native")
            rows.append(("tiny: orthon Muon, native bf16 GEMM", t_native, set_flops(entries)))
            ratios["tiny_native_bf16_time_vs_torch"] = t_native / t_ref

    if "large" in sets:
        entries = large_set(large_count)
        flops, gram_flops = set_flops(entries), set_flops(entries, "gram", device)
        ours = orthon_flops(entries, "standard", device)  # flops, or fewer where the emulated form halves some
        optimizers = {"standard": orthon_optimizer(entries, device),
                      "gram": orthon_optimizer(entries, device, ns_method="gram"),
                      "gram_fused": orthon_optimizer(entries, device, ns_method="gram", fused=True)}
        # torch in the same rounds where it runs at the same size (native bf16 GEMM); otherwise after.
        if torch_large == large_count:
            optimizers["torch"] = torch_optimizer(entries, device)
        gemm_run, gemm_flops = bare_gemms(entries, device, kernel, iterations=HYPER["ns_steps"])
        median, best = interleaved_step_times(optimizers, device, args.warmup, args.repeats, {"matmul": gemm_run})
        del optimizers
        t_ours, t_gram, t_fused = median["standard"], median["gram"], median["gram_fused"]
        bare = gemm_flops / median["matmul"] / 1e9
        scale = 24 / large_count
        rows.append((f"large ({large_count}+{large_count}): orthon Muon, standard", t_ours, ours))
        rows.append((f"large ({large_count}+{large_count}): orthon Muon, gram", t_gram, gram_flops))
        rows.append((f"large ({large_count}+{large_count}): orthon Muon, gram, fused passes", t_fused, gram_flops))
        figures.update(large_orthon_s_full_set=t_ours * scale, large_gram_s_full_set=t_gram * scale,
                       large_gram_fused_s_full_set=t_fused * scale,
                       large_ns_gflops=ours / t_ours / 1e9, large_matmul_gflops=bare,
                       large_ns_gflops_best=ours / best["standard"] / 1e9)
        ratios["large_ns_rate_vs_matmul"] = ours / t_ours / 1e9 / bare
        ratios["large_gram_flops_vs_standard"] = gram_flops / flops
        suffix = ""  # "_estimated" where torch's full-set time is estimated, not timed
        if "torch" in median:
            t_ref = median["torch"]
            rows.append((f"large ({large_count}+{large_count}): torch.optim.Muon", t_ref, flops))
            ref = figures["large_torch_s_full_set"] = t_ref * scale
        elif torch_large:
            ref_entries = large_set(torch_large)
            t_ref, _ = torch_step_time(ref_entries, device, args, repeats=1 if not native else None)
            rows.append((f"large ({torch_large}+{torch_large}): torch.optim.Muon", t_ref, set_flops(ref_entries)))
            ref = figures["large_torch_s_full_set"] = t_ref * 24 / torch_large
            figures["large_torch_measured_on"] = f"{torch_large}+{torch_large} matrices, scaled to 24+24"
        else:
            ref = figures["large_torch_s_full_set_estimated"] = (
                set_flops(large_set(24)) / (figures["bf16_matmul_gflops"] * 1e9))
            suffix = "_estimated"
        for name, seconds in (("", t_ours), ("_gram", t_gram), ("_gram_fused", t_fused)):
            ratios[f"large{name}_time_vs_torch{suffix}"] = seconds * scale / ref

    if "mla" in sets:
        shapes = {
            "tiny": dict(heads=4, qk_head=48, v_head=32, qk_nope=32, q_lora=128, kv_lora=64),
            "glm5_dims_8_heads": dict(heads=8, qk_head=256, v_head=256, qk_nope=192, q_lora=512, kv_lora=512, layers=1),
        }
        for label, dims in shapes.items():
            split, unsplit = mla_set(**dims), mla_set(**dims, split=False)
            t_split, _ = orthon_step_time(split, device, args)
            t_unsplit, _ = orthon_step_time(unsplit, device, args)
            rows.append((f"mla {label}: orthon Muon Split", t_split, set_flops(split)))
            rows.append((f"mla {label}: orthon Muon unsplit", t_unsplit, set_flops(unsplit)))
            ratios[f"mla_{label}_split_time_vs_unsplit"] = t_split / t_unsplit

    print(f"\n{'case':<44}{'step ms':>12}{'NS GFLOP':>10}{'GFLOP/s':>10}")
    for name, seconds, flops in rows:
        print(f"{name:<44}{1e3 * seconds:>12.1f}{flops / 1e9:>10.1f}{flops / seconds / 1e9:>10.1f}")
    print("\nbare matmul GFLOP/s: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items() if "matmul" in k))
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}")
    figures = {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}
    print(json.dumps({"bench": "muon_step", "figures": figures,
                      "ratios": {k: round(v, 4) for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()
