"""Rank 0's memory when the weights leave an FSDP2 trainer: the state dict gathered whole (what final/
and every RL hand-over used to take) against the ranks' shards gathered a part at a time
(orthon.pretrain.gathered_weights: final/ and the disk hand-over write a safetensors shard, the
distributed hand-over broadcasts a part, before the next is gathered); and a delta sync (a full sync's
copy kept, then every parameter changed and encoded): the whole state gathered and kept on rank 0 against
each rank keeping its own rows (orthon.rl.shard_delta).

Two gloo ranks under FSDP2, one thread each, a model of configs/tiny.yaml's shape made wider
(``--hidden``, ``--experts``); each way in fresh processes. Memory: rank 0's peak resident set above
its level before the hand-over (VmHWM), i.e. what the hand-over itself holds at once. Both the streamed
parts and final/ gather an expert stack larger than a part a few experts at a time (FSDP2 splits it by
expert rows).

With ``--megatron LAYOUT`` (tensor_parallel, pipeline_parallel or expert_parallel: 2 over the two ranks)
the same for the megatron backend's model (orthon.backends.megatron.gathered_weights): "whole" is its
state gathered whole on rank 0 (what RL's hand-over took there before, on every rank), the delta ways keep
that whole copy on rank 0 against each rank keeping the parts it owns (orthon.rl.shard_delta.PartDelta).

    python bench/gathered_weights.py [--hidden 1024] [--experts 32] [--part-mb 16] [--expert-parallel 2]
                                     [--megatron tensor_parallel]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402
from long_context import _rss_peak_reset, _status_kb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("whole", "parts", "final", "delta_whole", "delta_rows")


def _model(hidden: int, experts: int):
    from orthon.pretrain.model import GLMForCausalLM
    from orthon.pretrain.recipe import load_recipe

    cfg = load_recipe(ROOT / "configs" / "tiny.yaml").model.replace(hidden_size=hidden, n_routed_experts=experts,
                                                                     intermediate_size=4 * hidden)
    torch.manual_seed(0)
    return GLMForCausalLM(cfg)


def _megatron_model(hidden: int, experts: int, layout: str):
    from orthon.backends.megatron.causal_lm import MegatronCausalLM
    from orthon.pretrain.recipe import load_recipe

    return MegatronCausalLM(load_recipe(ROOT / "configs" / "tiny.yaml", [
        "backend=megatron", f"megatron.{layout}=2", f"model.hidden_size={hidden}", f"model.n_routed_experts={experts}",
        f"model.intermediate_size={4 * hidden}"]))


def _worker(rank, port, way, hidden, experts, part_bytes, out_dir, expert_parallel=1, megatron=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if megatron is not None:
            _measure_megatron(rank, way, hidden, experts, part_bytes, out_dir, megatron)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from orthon.pretrain import parallel
        from orthon.pretrain.gathered_weights import gathered_parts, save_gathered

        model = _model(hidden, experts)
        params = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters())  # an expert stack
        from orthon.pretrain.expert_parallel import shard_experts

        mesh = shard_experts(model, expert_parallel, torch.device("cpu")) if expert_parallel > 1 else None
        parallel.wrap(model, "fsdp", mesh)
        dist.barrier()
        _rss_peak_reset()
        base = _status_kb("VmRSS")
        start = time.perf_counter()
        if way == "whole":  # what final/ and the RL hand-over took before: the full state dict on rank 0
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            held = sum(t.numel() * t.element_size() for t in state.values())
            del state
        elif way == "parts":  # the distributed hand-over's gathers (the broadcast itself sends from them)
            held = 0
            for load in gathered_parts(model, rank, part_bytes, split_experts=True):
                part = load()
                held = max(held, sum(t.numel() * t.element_size() for t in part.values()) if part else 0)
                del part
        elif way == "final":  # final/ (and the disk hand-over): the weights directory, a safetensors shard at a time
            save_gathered(model, Path(out_dir) / "final", rank, max_shard_bytes=part_bytes)
            held = part_bytes
        else:  # a delta sync after a full one, every parameter changed (as an optimizer step changes them)
            held = _delta_sync(model, rank, way, out_dir)
        seconds = time.perf_counter() - start
        peak_mb = (_status_kb("VmHWM") - base) / 1024
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(
                {"way": way, "params": params, "peak_mb": peak_mb, "s": seconds, "largest_held_mb": held / 2**20,
                 "largest_tensor_mb": largest / 2**20}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The gloo group's threads sometimes abort the interpreter's exit on this 2-core VM ("terminate called
    # without an active exception", in the whole-state way too): the figures are written, leave at once.
    os._exit(0)


def _measure_megatron(rank, way, hidden, experts, part_bytes, out_dir, layout):
    """``_worker``'s ways for the megatron backend's model, cut by ``layout`` over the two ranks."""
    from orthon.engine.delta import DeltaEncoder
    from orthon.rl.shard_delta import PartDelta

    from orthon.pretrain.model_info import parameter_counts

    model = _megatron_model(hidden, experts, layout)
    params = sum(c["total"] for c in parameter_counts(model.config).values())  # the whole model's
    largest = max(p.numel() * p.element_size() for p in model.parameters())

    def gathered():
        state = {}
        for load in model.weight_parts(1 << 62):  # one part: the whole model, on rank 0
            state.update(load() or {})
        return list(state.items()) if rank == 0 else None

    def step():
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0001)

    dist.barrier()
    _rss_peak_reset()
    base = _status_kb("VmRSS")
    start = time.perf_counter()
    held = 0
    if way == "whole":
        state = gathered()
        held = sum(t.numel() * t.element_size() for _, t in state) if state else 0
        del state
    elif way == "parts":
        for load in model.weight_parts(part_bytes):
            part = load()
            held = max(held, sum(t.numel() * t.element_size() for t in part.values()) if part else 0)
            del part
    elif way == "final":
        from orthon.backends.megatron.gathered_weights import save_gathered

        save_gathered(model, Path(out_dir) / "final", write=rank == 0, max_shard_bytes=part_bytes)
        held = part_bytes
    elif way == "delta_whole":
        encoder = DeltaEncoder()
        state = gathered()
        if state is not None:
            encoder.reset(state, 0)
        del state
        step()
        state = gathered()
        held = encoder.encode(state, 1).nbytes if state is not None else 0
    else:
        delta = PartDelta(model, rank, 2, part_bytes)
        delta.reset(0)
        step()
        held = delta.write(Path(out_dir), 1, final=rank == 1).stat().st_size
    seconds = time.perf_counter() - start
    peak_mb = (_status_kb("VmHWM") - base) / 1024
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(
            {"way": way, "params": params, "peak_mb": peak_mb, "s": seconds,
             "largest_held_mb": held / 2**20, "largest_tensor_mb": largest / 2**20}))
    dist.barrier()


def _delta_sync(model, rank: int, way: str, out_dir: str) -> int:
    """Rank 0's side of a full sync's reset and the delta after it: before, the state dict gathered whole
    on rank 0 and its copy kept there (delta_whole); now each rank's copy of its own rows and its
    payload (delta_rows, orthon.rl.shard_delta). Returns the bytes of rank 0's payload."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from orthon.engine.delta import DeltaEncoder
    from orthon.rl.shard_delta import ShardDelta

    def gathered():
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return list(state.items()) if rank == 0 else None

    def step():
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0001)

    if way == "delta_whole":
        encoder = DeltaEncoder()
        state = gathered()
        if state is not None:
            encoder.reset(state, 0)
        del state  # the encoder keeps its own copy
        step()
        state = gathered()
        return encoder.encode(state, 1).nbytes if state is not None else 0
    rows = ShardDelta(model, rank)
    rows.reset(0)
    step()
    return rows.write(Path(out_dir), 1, final=rank == 1).stat().st_size


def measure(way: str, hidden: int, experts: int, part_bytes: int, expert_parallel: int = 1, megatron=None) -> dict:
    from orthon.core.net import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(free_port(), way, hidden, experts, part_bytes, out, expert_parallel, megatron),
                 nprocs=2, join=True)
        return json.loads(Path(out, "result.json").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--expert-parallel", type=int, default=1, choices=(1, 2),
                        help="2: the experts spread over the two ranks too (FSDP2 over expert parallelism)")
    parser.add_argument("--part-mb", type=int, default=16)
    parser.add_argument("--megatron", choices=("tensor_parallel", "pipeline_parallel", "expert_parallel"),
                        help="the megatron backend's model, cut by this over the two ranks")
    args = parser.parse_args()
    print(cpu_kind() + (f"; megatron backend, {args.megatron}=2" if args.megatron else ""))
    figures = {}
    for way in WAYS:
        figures[way] = measure(way, args.hidden, args.experts, args.part_mb << 20, args.expert_parallel, args.megatron)
        f = figures[way]
        print(f"{way}: rank 0 peak +{f['peak_mb']:7.1f} MB in {f['s']:.2f} s "
              f"({f['params'] / 1e6:.1f}M parameters, {f['params'] * 4 / 2**20:.0f} MB in fp32; the largest "
              f"tensor {f['largest_tensor_mb']:.0f} MB; parts of {args.part_mb} MB)")
    whole = figures["whole"]["peak_mb"]
    ratios = {f"{way}_memory": figures[way]["peak_mb"] / whole for way in ("parts", "final")}
    ratios["delta_rows_memory"] = figures["delta_rows"]["peak_mb"] / figures["delta_whole"]["peak_mb"]
    report("gathered_weights", figures, ratios)


if __name__ == "__main__":
    main()
