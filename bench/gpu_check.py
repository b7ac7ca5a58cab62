"""The megatron-core backend on a GPU, against orthon's torch backend on the same weights.

1. parity: configs/tiny.yaml's model, random weights (norm scales and router biases too), converted to
   megatron's names and loaded into the megatron-core model orthon builds; in fp32 (TF32 off) the logits
   must agree with the torch model's, and one step of orthon's Muon + Split (fp32 Newton-Schulz) must
   leave the same weights. GLM-5's two latent norms use eps 1e-6 and megatron has one epsilon for every
   norm, so the torch model is compared with those two set to rms_norm_eps (and, for the record, as GLM-5
   has them).
2. step time: a mid-sized GLM-5-shaped model in bf16 (the torch backend: fp32 weights under autocast, its
   ``train.precision: bf16``; megatron-core: bf16 parameters, its own bf16 mode), forward + backward +
   Muon + Split step, megatron-core against the torch backend in the same run.

Run through bench/gpu_check.sh (which skips without CUDA); ends with one JSON line, exit code 1 when a
parity check fails.

    python bench/gpu_check.py [--steps 10] [--batch 4] [--seq 2048]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Mid-sized GLM-5 shape for timing: MLA, a dense first layer, then 32 experts top-4 with a shared one.
MID = dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=8, intermediate_size=4096, num_attention_heads=16,
           q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
           first_k_dense_replace=1, moe_intermediate_size=512, n_routed_experts=32, n_shared_experts=1,
           num_experts_per_tok=4, index_n_heads=8, index_head_dim=64, index_topk=256, max_position_embeddings=8192)


def latent_eps(model, eps: float) -> None:
    for layer in model.model.layers:
        layer.self_attn.q_a_layernorm.eps = layer.self_attn.kv_a_layernorm.eps = eps


def megatron_pair(config, options, device, seed: int = 0):
    """(orthon's torch model, the megatron-core model) holding the same random weights, on ``device``."""
    from orthon.backends.megatron import orthon_to_megatron
    from orthon.backends.megatron.model import _build, load_megatron_state
    from orthon.pretrain import GLMForCausalLM
    from orthon.pretrain.config import RuntimeOptions

    torch.manual_seed(seed)
    ours = GLMForCausalLM(config, runtime=RuntimeOptions(sparse_attention=False))
    with torch.no_grad():
        for name, tensor in ours.state_dict().items():
            if tensor.ndim == 1:
                tensor.normal_(1.0 if "norm" in name else 0.0, 0.05)
    gpt = _build(config, options)[0]
    full = orthon_to_megatron(ours.state_dict(), config, gpt.orthon_layout)
    load_megatron_state(gpt, full, config, options)
    return ours.to(device), gpt.to(device), full


def parity(device) -> dict:
    """Logit and one-step differences between the two backends on the tiny model (fp32)."""
    from orthon.backends.megatron import megatron_to_orthon
    from orthon.backends.megatron.model import MegatronOptions
    from orthon.backends.megatron.optimizer import build_optimizer
    from orthon.optim import OptimConfig, ScheduleConfig, build_for_model
    from orthon.pretrain.recipe import load_recipe

    config = load_recipe(ROOT / "configs/tiny.yaml").model
    options = MegatronOptions(params_dtype="fp32", token_dispatcher="alltoall" if device.type == "cuda" else "allgather")
    ours, gpt, full = megatron_pair(config, options, device)
    ids = torch.randint(0, config.vocab_size, (2, 65), device=device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    position = torch.arange(inputs.shape[1], device=device)[None].expand(inputs.shape[0], -1)
    gpt.eval(), ours.eval()
    with torch.no_grad():
        theirs = gpt(inputs, position, None)
        glm5 = ours(inputs).logits
        latent_eps(ours, config.rms_norm_eps)
        aligned = ours(inputs).logits
    out = {"transformer_engine": gpt.orthon_layout.te,
           "logits_max_abs_diff": float((theirs - aligned).abs().max()),
           "logits_max_abs_diff_glm5_eps": float((theirs - glm5).abs().max()),
           "logits_max_abs": float(aligned.abs().max())}
    cfg = OptimConfig(ns_dtype="fp32")
    schedule = ScheduleConfig(peak_lr=0.01, floor_lr=0.01, warmup_tokens=0, total_tokens=10**6)
    opt_ours, opt_theirs = build_for_model(ours, cfg, schedule), build_optimizer(gpt, config, cfg, schedule)
    gpt.train(), ours.train()
    gpt(inputs, position, None, labels=labels).mean().backward()
    ours(inputs, labels=labels).loss.backward()
    for opt in (opt_ours, opt_theirs):
        opt.set_tokens(1000)
        opt.step()
    muon = {n for group in opt_ours.muon.param_groups for n in group["param_names"]}
    trained = {k: v.cpu() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}  # not TE's _extra_state
    after = megatron_to_orthon({**full, **trained}, config, gpt.orthon_layout)
    out["step_muon_max_abs_diff"] = max(float((after[n].float() - p.detach().cpu()).abs().max())
                                        for n, p in ours.named_parameters() if n in muon)
    return out


def time_steps(device, steps: int, batch: int, seq: int, shape: dict = MID, bf16: bool = True) -> dict:
    """Median step time (forward + backward + Muon + Split) of both backends on the mid-sized model, each in
    its own bf16 training: the torch backend's fp32 weights under bf16 autocast (``train.precision: bf16``),
    megatron-core's bf16 parameters (its ``bf16`` mode; its MoE router does not run under torch.autocast:
    the sigmoid top-k's scatter meets two dtypes). bf16=False: both fp32."""
    import contextlib

    from orthon.backends.megatron.model import MegatronOptions
    from orthon.backends.megatron.optimizer import build_optimizer
    from orthon.optim import OptimConfig, ScheduleConfig, build_for_model
    from orthon.pretrain.config import ModelConfig

    config = ModelConfig(**shape)
    options = MegatronOptions(params_dtype="bf16" if bf16 else "fp32",
                              token_dispatcher="alltoall" if device.type == "cuda" else "allgather")
    ours, gpt, _ = megatron_pair(config, options, device)
    del _
    cfg, schedule = OptimConfig(), ScheduleConfig(peak_lr=1e-3, floor_lr=1e-3, warmup_tokens=0, total_tokens=10**9)
    opt_ours, opt_theirs = build_for_model(ours, cfg, schedule), build_optimizer(gpt, config, cfg, schedule)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    position = torch.arange(seq, device=device)[None].expand(batch, -1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def step_ours():
        with autocast:
            loss = ours(inputs, labels=labels, return_logits=False).loss
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def step_theirs():
        loss = gpt(inputs, position, None, labels=labels).float().mean()
        loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)

    times = {"megatron": [], "torch": []}
    for _ in range(2):  # warm-up (kernels, allocator), then timed; the two alternate so drift hits both
        for name, fn in (("megatron", step_theirs), ("torch", step_ours)):
            fn()
    for _ in range(steps):
        for name, fn in (("megatron", step_theirs), ("torch", step_ours)):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    n_params = sum(p.numel() for p in ours.parameters())
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"params_m": round(n_params / 1e6, 1), "tokens": batch * seq, "megatron_step_s": median["megatron"],
            "torch_step_s": median["torch"]}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check (bench/gpu_check.sh skips before this)")
        return 0
    from orthon.backends.megatron.model import require_megatron

    require_megatron()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"device: {torch.cuda.get_device_name(device)}; host CPU: {cpu_kind()}; torch {torch.__version__}")
    result = parity(device)
    print(f"parity (tiny model, fp32, transformer-engine {'on' if result['transformer_engine'] else 'off'}): "
          f"logits max |diff| {result['logits_max_abs_diff']:.2e} (GLM-5's latent eps: "
          f"{result['logits_max_abs_diff_glm5_eps']:.2e}; logits up to {result['logits_max_abs']:.2f}); "
          f"one Muon + Split step, weights max |diff| {result['step_muon_max_abs_diff']:.2e}")
    ok = result["logits_max_abs_diff"] < 1e-4 and result["logits_max_abs_diff_glm5_eps"] < 1e-3 \
        and result["step_muon_max_abs_diff"] < 1e-5
    figures, ratios = dict(result), {}
    if not args.skip_timing:
        timing = time_steps(device, args.steps, args.batch, args.seq)
        tok = timing["tokens"]
        print(f"step time ({timing['params_m']}M parameters, {args.batch} x {args.seq} tokens, bf16 (torch: autocast; "
              f"megatron: bf16 parameters), "
              f"Muon + Split): megatron-core {timing['megatron_step_s'] * 1e3:.1f} ms ({tok / timing['megatron_step_s']:,.0f} "
              f"tok/s), torch backend {timing['torch_step_s'] * 1e3:.1f} ms ({tok / timing['torch_step_s']:,.0f} tok/s)")
        figures.update(timing)
        ratios["megatron_vs_torch_step_time"] = round(timing["megatron_step_s"] / timing["torch_step_s"], 3)
    figures["parity_ok"] = ok
    report("gpu_check", figures, ratios)
    if not ok:
        print("gpu_check: FAILED: the megatron-core model does not match the torch backend", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
