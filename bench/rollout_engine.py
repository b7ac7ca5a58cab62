"""Rollout throughput: orthon's in-process engine against transformers' generate() on the same weights.

configs/tiny.yaml's model with DSA on (transformers' glm_moe_dsa always runs its indexer), saved
with save_weights and loaded by transformers' GlmMoeDsaForCausalLM. Every row gets a 32-token prompt and
exactly 128 new tokens (no stop token), greedy on both by default or the same temperature / top-k
with --sample. Generated tokens per second at batch 1, 8 and 64, in one run; the two run in turn
and each keeps its fastest repeat (the machine is shared). orthon's time includes what the engine
does beyond generate(): the fp32 log-prob of every token. The engine decodes through its fused,
pre-packed decode weights (orthon.engine.fused_decode; built in the warm-up, as after every weight update,
about 20 ms for this model).

One thread by default: on this shared 2-core machine, two OpenMP threads make both sides' times
erratic (a busy second core stalls every parallel region).

greedy_agreement_dense_span: share of new tokens equal on both sides while the sequence still fits
in index_topk (every key is selected, so both compute the same function). Past it the two pick
different keys among exactly tied index scores (orthon breaks ties by position, transformers by
whatever torch.topk returns; see tests/test_model_parity.py), so greedy paths part.

    python bench/rollout_engine.py [--batches 1,8,64] [--repeats 2] [--sample] [--threads 1]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report, tiny_pair  # noqa: E402

from orthon.engine.in_process import EngineConfig, InProcessEngine  # noqa: E402
from orthon.engine.sampling import SamplingParams  # noqa: E402



def best_times(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Run the functions in turn ``repeats`` times; the fastest time of each (the least disturbed on a
    shared machine) and its last output."""
    best, outs = {k: float("inf") for k in fns}, {}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            outs[key] = fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return best, outs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sample", action="store_true", help="temperature 1, top-k 50 on both (default greedy)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ours, hf = tiny_pair()
    ours.eval(), hf.eval()
    config = ours.config
    # No prefix cache: the repeats rerun the same prompts, which transformers would have to prefill again.
    engine = InProcessEngine(ours, EngineConfig(max_batch_size=max(int(b) for b in args.batches.split(",")),
                                                prefix_cache_tokens=0))
    n_new, temp, top_k = args.new_tokens, (1.0 if args.sample else 0.0), (50 if args.sample else 0)
    params = SamplingParams(max_new_tokens=n_new, temperature=temp, top_k=top_k, stop_token_ids=(), seed=0)

    def hf_generate(ids):
        with torch.inference_mode():
            kw = dict(do_sample=True, temperature=temp, top_k=top_k, top_p=1.0) if args.sample else dict(do_sample=False)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                              eos_token_id=None, pad_token_id=0, **kw)
        return out[:, ids.shape[1]:]

    # Warm both paths once (allocator, lazy inits) on a small batch.
    warm = torch.randint(2, config.vocab_size, (2, args.prompt_len))
    hf_generate(warm[:, :8])
    engine.generate(warm[:, :8].tolist(), SamplingParams(max_new_tokens=8, temperature=temp, top_k=top_k, stop_token_ids=()))

    dense_span = max(0, config.index_topk - args.prompt_len)
    figures, ratios = {"threads": args.threads}, {}
    print(f"CPU: {cpu_kind()}")
    print(f"{'batch':>5} {'orthon tok/s':>13} {'hf tok/s':>10} {'ratio':>7} {'greedy agree':>13}")
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(2, config.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
        times, outs = best_times({"hf": lambda: hf_generate(ids), "orthon": lambda: engine.generate(ids.tolist(), params)},
                                 args.repeats)
        results = outs["orthon"]
        assert all(len(r.tokens) == n_new for r in results), "every row must generate exactly new-tokens tokens"
        ours_out = torch.tensor([r.tokens for r in results])
        agree = float((ours_out[:, :dense_span] == outs["hf"][:, :dense_span]).float().mean()) if dense_span else float("nan")
        tps_ours, tps_hf = batch * n_new / times["orthon"], batch * n_new / times["hf"]
        figures[f"orthon_tokens_per_s_b{batch}"] = round(tps_ours, 1)
        figures[f"hf_tokens_per_s_b{batch}"] = round(tps_hf, 1)
        if not args.sample:
            figures[f"greedy_agreement_dense_span_b{batch}"] = round(agree, 4)
        ratios[f"tokens_per_s_vs_hf_b{batch}"] = round(tps_ours / tps_hf, 2)
        print(f"{batch:>5} {tps_ours:>13.1f} {tps_hf:>10.1f} {tps_ours / tps_hf:>7.2f} "
              f"{agree if not args.sample else float('nan'):>13.4f}")
    report("rollout_engine", figures, ratios)


if __name__ == "__main__":
    main()
