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
With ``pipeline_parallel`` also "stage_parts": each pipeline stage's parts gathered within the stage to its
leader, side by side (what RL's distributed sync does there, orthon.rl.stage_sync), against every part
gathered to rank 0 ("parts"): the bytes rank 0 receives and the time until every rank is done.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402
from long_context import _rss_peak_reset, _status_kb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("whole", "parts", "final", "delta_whole", "delta_rows")
STAGE_WAY = "stage_parts"  # megatron's pipeline stages only


@dataclass
class _Handover:
    """How one backend's ranks hand the weights over: ``whole()`` the state gathered on rank 0 ([(name, tensor)],
    None elsewhere), ``parts()`` the streamed parts' loaders, ``final(directory)`` the weights directory a
    shard at a time, ``rank_delta()`` each rank's delta of what it keeps (``reset`` / ``write``)."""

    whole: Callable
    parts: Callable
    final: Callable
    rank_delta: Callable
    stage_parts: Callable | None = None  # pipeline stages: this rank's stage's loaders (gathered to its leader)


def _fsdp(rank: int, hidden: int, experts: int, part_bytes: int, expert_parallel: int):
    """The torch backend's model under FSDP2 (over expert parallelism with ``expert_parallel`` 2): (model,
    hand-over, its parameters, its largest tensor's bytes)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from orthon.pretrain import parallel
    from orthon.pretrain.expert_parallel import shard_experts
    from orthon.pretrain.gathered_weights import gathered_parts, save_gathered
    from orthon.pretrain.model import GLMForCausalLM
    from orthon.pretrain.recipe import load_recipe
    from orthon.rl.shard_delta import ShardDelta

    cfg = load_recipe(ROOT / "configs" / "tiny.yaml").model.replace(hidden_size=hidden, n_routed_experts=experts,
                                                                     intermediate_size=4 * hidden)
    torch.manual_seed(0)
    model = GLMForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())  # an expert stack
    mesh = shard_experts(model, expert_parallel, torch.device("cpu")) if expert_parallel > 1 else None
    parallel.wrap(model, "fsdp", mesh)

    def whole():  # what final/ and the RL hand-over took before: the full state dict on rank 0
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return list(state.items()) if rank == 0 else None

    return model, _Handover(
        whole, lambda: gathered_parts(model, rank, part_bytes, split_experts=True),
        lambda directory: save_gathered(model, directory, rank, max_shard_bytes=part_bytes),
        lambda: ShardDelta(model, rank)), params, largest


def _megatron(rank: int, hidden: int, experts: int, part_bytes: int, layout: str):
    """The megatron backend's model cut by ``layout`` over the two ranks: as ``_fsdp``."""
    from orthon.backends.megatron.causal_lm import MegatronCausalLM
    from orthon.backends.megatron.gathered_weights import save_gathered
    from orthon.pretrain.model_info import parameter_counts
    from orthon.pretrain.recipe import load_recipe
    from orthon.rl.shard_delta import PartDelta

    model = MegatronCausalLM(load_recipe(ROOT / "configs" / "tiny.yaml", [
        "backend=megatron", f"megatron.{layout}=2", f"model.hidden_size={hidden}", f"model.n_routed_experts={experts}",
        f"model.intermediate_size={4 * hidden}"]))
    params = sum(c["total"] for c in parameter_counts(model.config).values())  # the whole model's
    largest = max(p.numel() * p.element_size() for p in model.parameters())

    def whole():  # the whole model as one part, on rank 0
        state = model.whole_state()
        return list(state.items()) if rank == 0 else None

    return model, _Handover(
        whole, lambda: model.weight_parts(part_bytes),
        lambda directory: save_gathered(model, directory, write=rank == 0, max_shard_bytes=part_bytes),
        lambda: PartDelta(model, rank, 2, part_bytes), lambda: model.stage_parts(part_bytes).loaders), params, largest


def _worker(rank, port, way, hidden, experts, part_bytes, out_dir, expert_parallel=1, megatron=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model, handover, params, largest = (_fsdp(rank, hidden, experts, part_bytes, expert_parallel) if megatron is None
                                            else _megatron(rank, hidden, experts, part_bytes, megatron))
        dist.barrier()
        _rss_peak_reset()
        base = _status_kb("VmRSS")
        start = time.perf_counter()
        if way == "whole":
            state = handover.whole()
            held = sum(t.numel() * t.element_size() for _, t in state) if state else 0
            del state
        elif way in ("parts", STAGE_WAY):  # the distributed hand-over's gathers (its broadcasts send from them)
            held = received = 0
            for load in handover.parts() if way == "parts" else handover.stage_parts():
                part = load()
                size = sum(t.numel() * t.element_size() for t in part.values()) if part else 0
                held, received = max(held, size), received + size
                del part
        elif way == "final":  # final/ (and the disk hand-over): the weights directory, a safetensors shard at a time
            handover.final(Path(out_dir) / "final")
            held = part_bytes
        else:  # a delta sync after a full one, every parameter changed (as an optimizer step changes them)
            held = _delta_sync(model, handover, rank, way, out_dir)
        peak_mb = (_status_kb("VmHWM") - base) / 1024
        dist.barrier()  # the time until every rank is done (the stages gather side by side)
        seconds = time.perf_counter() - start
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(
                {"way": way, "params": params, "peak_mb": peak_mb, "s": seconds, "largest_held_mb": held / 2**20,
                 "largest_tensor_mb": largest / 2**20} | ({"received_mb": received / 2**20} if "parts" in way else {})))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The gloo group's threads sometimes abort the interpreter's exit on this 2-core VM ("terminate called
    # without an active exception", in the whole-state way too): the figures are written, leave at once.
    os._exit(0)


def _delta_sync(model, handover: _Handover, rank: int, way: str, out_dir: str) -> int:
    """Rank 0's side of a full sync's reset and the delta after it: before, the state gathered whole on rank
    0 and its copy kept there (delta_whole); now each rank's copy of what it keeps and its payload
    (delta_rows: orthon.rl.shard_delta's ShardDelta, or PartDelta on megatron). Returns the bytes of rank 0's
    payload."""
    from orthon.engine.delta import DeltaEncoder

    def step():
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0001)

    if way == "delta_whole":
        encoder = DeltaEncoder()
        state = handover.whole()
        if state is not None:
            encoder.reset(state, 0)
        del state  # the encoder keeps its own copy
        step()
        state = handover.whole()
        return encoder.encode(state, 1).nbytes if state is not None else 0
    delta = handover.rank_delta()
    delta.reset(0)
    step()
    return delta.write(Path(out_dir), 1, final=rank == 1).stat().st_size


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
    for way in WAYS + ((STAGE_WAY,) if args.megatron == "pipeline_parallel" else ()):
        figures[way] = measure(way, args.hidden, args.experts, args.part_mb << 20, args.expert_parallel, args.megatron)
        f = figures[way]
        print(f"{way}: rank 0 peak +{f['peak_mb']:7.1f} MB in {f['s']:.2f} s "
              f"({f['params'] / 1e6:.1f}M parameters, {f['params'] * 4 / 2**20:.0f} MB in fp32; the largest "
              f"tensor {f['largest_tensor_mb']:.0f} MB; parts of {args.part_mb} MB)")
    whole = figures["whole"]["peak_mb"]
    ratios = {f"{way}_memory": figures[way]["peak_mb"] / whole for way in ("parts", "final")}
    ratios["delta_rows_memory"] = figures["delta_rows"]["peak_mb"] / figures["delta_whole"]["peak_mb"]
    if STAGE_WAY in figures:
        stage, parts = figures[STAGE_WAY], figures["parts"]
        print(f"{STAGE_WAY}: rank 0 received {stage['received_mb']:.0f} MB against {parts['received_mb']:.0f} MB, "
              f"every rank done in {stage['s']:.2f} s against {parts['s']:.2f} s")
        ratios |= {"stage_parts_received": stage["received_mb"] / parts["received_mb"],
                   "stage_parts_time": stage["s"] / parts["s"]}
    report("gathered_weights", figures, ratios)


if __name__ == "__main__":
    main()
