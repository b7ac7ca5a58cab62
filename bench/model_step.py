"""Training-step throughput: orthon's model against transformers' GlmMoeDsaForCausalLM.

Same config (configs/tiny.yaml's model with DSA on: hidden 256, 4 layers, 8 experts top-2,
index_topk 64), same weights, same batch, AdamW on both; forward + backward + optimizer step.
transformers runs its default attention (SDPA with a dense T x T top-k mask). ``--precision bf16`` runs
both forwards under bf16 autocast (fp32 weights and optimizer, as ``train.precision: bf16``): the
precision to train in where the CPU's bf16 GEMM is native (the first line says which kind this is);
where it is emulated, bf16 is far slower than fp32 for both.

The two steps alternate one at a time (2 x repeats rounds); tokens/s are from each side's median step,
the ratio is the median of the rounds' own ratios (each round's two steps ran seconds apart, under the
same load).

    python bench/model_step.py [--repeats 5] [--shapes 8x256,2x1024] [--precision fp32|bf16] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, paired_ratio, paired_times, report, tiny_pair  # noqa: E402

from orthon.pretrain.flops import ModelFlops  # noqa: E402




def step_fn(model, ids, forward, precision="fp32"):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = ids.is_cuda

    def step():
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = forward(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:  # the step's kernels finished inside its timing
            torch.cuda.synchronize()

    return step


def orthon_forward(model, ids):
    return model(ids[:, :-1], labels=ids[:, 1:], return_logits=False).loss


def hf_forward(model, ids):
    # transformers shifts labels itself; give it the same T input tokens and targets.
    logits = model(ids[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="8x256,2x1024")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: both forwards under bf16 autocast (train.precision: bf16), fp32 weights")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (both models on the GPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"CPU: {cpu_kind()}" + (f"; GPU: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""))
    ours, theirs = tiny_pair()
    ours.to(device).train(), theirs.to(device).train()
    config = ours.config
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"config: {n_params / 1e6:.2f}M parameters, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
          f"{config.n_routed_experts} experts top-{config.num_experts_per_tok}, index_topk {config.index_topk}; "
          f"{args.threads} threads, {args.precision}")
    figures, ratios = {}, {}
    model_flops = ModelFlops.of(config)
    # orthon's model FLOPs a second (orthon.pretrain.flops; the same model's count serves both sides).
    print(f"{'batch x seq':<12}{'orthon tok/s':>14}{'hf tok/s':>12}{'ratio':>8}{'orthon TFLOP/s':>16}")
    for shape in args.shapes.split(","):
        b, t = (int(v) for v in shape.split("x"))
        ids = torch.randint(0, config.vocab_size, (b, t + 1), device=device)
        tokens = b * t
        times = paired_times({"orthon": step_fn(ours, ids, orthon_forward, args.precision),
                              "hf": step_fn(theirs, ids, hf_forward, args.precision)}, 2 * args.repeats)
        o, h = (tokens / statistics.median(times[name]) for name in ("orthon", "hf"))
        ratio = paired_ratio(times["hf"], times["orthon"])
        tflops = o * model_flops.per_token(t, sparse=True) / 1e12
        print(f"{shape:<12}{o:>14,.0f}{h:>12,.0f}{ratio:>8.2f}{tflops:>16.3f}")
        suffix = "_".join([shape] + [args.precision] * (args.precision != "fp32") + ["cuda"] * (device.type == "cuda"))
        figures[f"orthon_tokens_per_s_{suffix}"] = round(o, 1)
        figures[f"hf_tokens_per_s_{suffix}"] = round(h, 1)
        figures[f"orthon_model_tflops_{suffix}"] = round(tflops, 4)
        ratios[f"tokens_per_s_vs_hf_{suffix}"] = round(ratio, 3)
    report("model_step", figures, ratios)


if __name__ == "__main__":
    main()
