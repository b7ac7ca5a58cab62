"""Delta weight sync: per training update, the bytes on the wire and the encode+decode speed of every
orthon delta encoding, of orthon's per-tensor choice, of a full copy and of slime's XOR + zstd scheme,
side by side in one run.

The trainer is configs/tiny.yaml's model in fp32 (a master copy), updated by ``--updates`` steps on
random tokens: the first half with orthon's Muon (matrices) + AdamW (the rest), the second half with
torch's AdamW, at RL-like learning rates. After each step every scheme syncs two receivers: one holding
the fp32 weights, one holding their bf16 cast (what a bf16 engine holds). Every scheme must leave its
receiver byte-identical to the trainer (checked after every update).

Schemes (each with its own sender state and receiver):
  full_copy        every tensor, flattened into one buffer and copied out (no delta).
  slime_xor_zstd   slime's disk-delta format (slime/backends/megatron_utils/update_weight/
                   update_weight_from_disk_delta.py, "xor" encoding, its default): per changed tensor
                   zstd level 1 of the XOR of old and new bytes, an xxh3-128 checksum of the new bytes,
                   unchanged tensors skipped, all in one safetensors blob (its wire size is that blob's
                   length); the receiver XORs in place and checks the checksums.
  chosen           orthon's DeltaPayload with the smallest encoding per tensor.
  only:<encoding>  orthon's DeltaPayload with one encoding forced on every changed tensor.
Encode = the sender's work up to the bytes (hashes included); decode = parsing the bytes, every check
and the in-place write. GB/s = the receiver's weight bytes / (encode + decode seconds).

Exit code 1 if orthon's choice is larger than slime's on any update (or a receiver ends up with other
bytes than the trainer).

    python bench/weight_sync.py [--updates 50] [--out weight_sync.json] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import safetensors.numpy
import torch
import xxhash
import zstandard

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

from orthon.core.files import atomic_write_json  # noqa: E402
from orthon.engine.delta import DeltaEncoder, DeltaPayload  # noqa: E402
from orthon.engine.delta_codec import ENCODINGS  # noqa: E402
from orthon.engine.tensor_bytes import byte_view, cpu_contiguous  # noqa: E402
from orthon.engine.weight_transfer import TensorMeta, flatten_bucket, unflatten_bucket  # noqa: E402
from orthon.optim import OptimConfig, ScheduleConfig, build_for_model  # noqa: E402
from orthon.pretrain.model import GLMForCausalLM  # noqa: E402
from orthon.pretrain.recipe import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def clone_state(state):
    return {k: cpu_contiguous(v).clone() for k, v in state.items()}


class OrthonDelta:
    def __init__(self, state, encodings=ENCODINGS):
        self.encoder = DeltaEncoder(encodings=encodings)
        self.encoder.reset(state, 0)
        self.receiver = clone_state(state)

    def sync(self, state, version):
        start = time.perf_counter()
        payload = self.encoder.encode(state, version)
        data = payload.to_bytes()
        encoded = time.perf_counter()
        self.changed = sum(e.changed for e in payload.entries)  # elements whose bytes changed
        DeltaPayload.from_bytes(data).apply_in_place(self.receiver)
        return len(data), encoded - start, time.perf_counter() - encoded


class FullCopy:
    def __init__(self, state):
        self.receiver = clone_state(state)
        self.metas = [TensorMeta.of(k, v) for k, v in state.items()]

    def sync(self, state, version):
        start = time.perf_counter()
        flat = flatten_bucket(state)
        encoded = time.perf_counter()
        with torch.no_grad():
            for name, view in unflatten_bucket(flat, self.metas):
                self.receiver[name].copy_(view)
        return flat.numel(), encoded - start, time.perf_counter() - encoded


class SlimeXorZstd:
    """slime's "xor" disk delta, reproduced: diff = new ^ old (bytes), zstd level 1, xxh3-128 of the new
    bytes as safetensors metadata; unchanged tensors are left out."""

    def __init__(self, state):
        self.snapshot = {k: byte_view(cpu_contiguous(v)).copy() for k, v in state.items()}
        self.receiver = clone_state(state)

    def sync(self, state, version):
        start = time.perf_counter()
        delta, checksums = {}, {}
        for name, tensor in state.items():
            new = byte_view(cpu_contiguous(tensor)).copy()  # slime copies each tensor out of its pinned buffer
            diff = new ^ self.snapshot[name]
            if np.count_nonzero(diff):
                delta[name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(diff), dtype=np.uint8)
                checksums[name] = xxhash.xxh3_128(new).hexdigest()
            self.snapshot[name] = new
        blob = safetensors.numpy.save(delta, metadata=checksums) if delta else b""
        encoded = time.perf_counter()
        if blob:
            loaded = safetensors.numpy.load(blob)
            for name, compressed in loaded.items():
                target = byte_view(self.receiver[name])
                target ^= np.frombuffer(zstandard.ZstdDecompressor().decompress(compressed.tobytes()), np.uint8)
                if xxhash.xxh3_128(target).hexdigest() != checksums[name]:
                    raise RuntimeError(f"slime scheme: checksum mismatch on {name}")
        return len(blob), encoded - start, time.perf_counter() - encoded


def schemes_for(state):
    out = {"full_copy": FullCopy(state), "slime_xor_zstd": SlimeXorZstd(state), "chosen": OrthonDelta(state)}
    out.update({f"only:{e}": OrthonDelta(state, (e,)) for e in ENCODINGS})
    return out


def as_bf16(state):
    return {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach() for k, v in state.items()}


def state_bytes(state):
    return sum(v.numel() * v.element_size() for v in state.values())


def receiver_matches(receiver, state):
    return all(np.array_equal(byte_view(receiver[k]), byte_view(cpu_contiguous(v))) for k, v in state.items())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=50)
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    parser.add_argument("--muon-lr", type=float, default=1e-4, help="configs/rl_tiny.yaml's peak LR")
    parser.add_argument("--adamw-lr", type=float, default=1e-5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the per-update results here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    config = load_recipe(args.config).model
    model = GLMForCausalLM(config)
    muon = build_for_model(model, OptimConfig(), ScheduleConfig(peak_lr=args.muon_lr, floor_lr=args.muon_lr,
                                                                  warmup_tokens=0, total_tokens=10**15))
    adamw = torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, weight_decay=0.01)
    kinds = {"fp32": lambda: model.state_dict(), "bf16": lambda: as_bf16(model.state_dict())}
    schemes = {kind: schemes_for(get()) for kind, get in kinds.items()}
    weight_bytes = {kind: state_bytes(get()) for kind, get in kinds.items()}
    names = list(schemes["fp32"])
    print(f"cpu: {cpu_kind()}, {torch.get_num_threads()} thread(s)")
    print(f"model: {args.config} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
          f"fp32 {weight_bytes['fp32'] / 1e6:.1f} MB, bf16 {weight_bytes['bf16'] / 1e6:.1f} MB), {args.updates} updates: "
          f"Muon lr {args.muon_lr} then AdamW lr {args.adamw_lr}")

    rows, failures = [], []
    short = {n: n.replace("only:", "").replace("_positions", "").replace("_gaps", "_gap").replace("slime_xor_zstd", "slime")
             for n in names}
    header = f"{'upd':>3} {'kind':<4} {'opt':<5} {'changed':>7} | " + " ".join(f"{short[n]:>10}" for n in names)
    print("\nwire KB per update (and, below each, encode+decode GB/s)\n" + header)
    for update in range(1, args.updates + 1):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq))
        model.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        optimizer = "muon" if update <= (args.updates + 1) // 2 else "adamw"
        if optimizer == "muon":
            muon.set_tokens(update * tokens.numel())
            muon.step()
        else:
            adamw.step()
        for kind, get in kinds.items():
            state = {k: v.detach() for k, v in get().items()}
            row = {"update": update, "kind": kind, "optimizer": optimizer, "weight_bytes": weight_bytes[kind]}
            for name, scheme in schemes[kind].items():
                nbytes, enc_s, dec_s = scheme.sync(state, update)
                if not receiver_matches(scheme.receiver, state):
                    failures.append(f"update {update} {kind}: {name}'s receiver differs from the trainer")
                row[name] = {"bytes": nbytes, "encode_s": enc_s, "decode_s": dec_s,
                             "gb_per_s": weight_bytes[kind] / (enc_s + dec_s) / 1e9}
            row["changed_fraction"] = schemes[kind]["chosen"].changed / sum(v.numel() for v in state.values())
            if row["chosen"]["bytes"] > row["slime_xor_zstd"]["bytes"]:
                failures.append(f"update {update} {kind}: chosen {row['chosen']['bytes']} B > slime "
                                f"{row['slime_xor_zstd']['bytes']} B")
            rows.append(row)
            lead = f"{update:>3} {kind:<4} {optimizer:<5} {row['changed_fraction']:>7.1%} | "
            print(lead + " ".join(f"{row[n]['bytes'] / 1e3:>10.1f}" for n in names))
            print(" " * (len(lead) - 2) + "| " + " ".join(f"{row[n]['gb_per_s']:>10.3f}" for n in names), flush=True)

    summary, figures, ratios = {}, {}, {}
    print(f"\ntotals over {args.updates} updates: wire MB (share of the full copy), aggregate GB/s, median GB/s")
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        summary[kind] = {}
        for name in names:
            total = sum(r[name]["bytes"] for r in mine)
            seconds = sum(r[name]["encode_s"] + r[name]["decode_s"] for r in mine)
            summary[kind][name] = {"bytes": total, "gb_per_s": weight_bytes[kind] * len(mine) / seconds / 1e9,
                                   "median_gb_per_s": statistics.median(r[name]["gb_per_s"] for r in mine)}
        full = summary[kind]["full_copy"]["bytes"]
        for name in names:
            s = summary[kind][name]
            print(f"  {kind:<4} {name:<22} {s['bytes'] / 1e6:>9.2f} MB ({s['bytes'] / full:>6.1%})  "
                  f"{s['gb_per_s']:>7.3f} GB/s  {s['median_gb_per_s']:>7.3f}")
        chosen, slime = summary[kind]["chosen"], summary[kind]["slime_xor_zstd"]
        worst = max(r["chosen"]["bytes"] / max(r["slime_xor_zstd"]["bytes"], 1) for r in mine)
        figures[f"{kind}_chosen_mb"] = chosen["bytes"] / 1e6
        figures[f"{kind}_slime_mb"] = slime["bytes"] / 1e6
        figures[f"{kind}_chosen_gb_per_s"] = chosen["gb_per_s"]
        figures[f"{kind}_slime_gb_per_s"] = slime["gb_per_s"]
        ratios[f"{kind}_chosen_vs_slime_bytes"] = chosen["bytes"] / slime["bytes"]
        ratios[f"{kind}_chosen_vs_slime_bytes_worst_update"] = worst
        ratios[f"{kind}_chosen_vs_full_copy_bytes"] = chosen["bytes"] / full
        ratios[f"{kind}_chosen_vs_slime_speed"] = chosen["gb_per_s"] / slime["gb_per_s"]
        print(f"  {kind}: chosen / slime bytes {ratios[f'{kind}_chosen_vs_slime_bytes']:.3f} (worst update "
              f"{worst:.3f}), speed {ratios[f'{kind}_chosen_vs_slime_speed']:.2f}x")
    ok = not failures
    print("\nchosen encoding never larger than slime's, every receiver byte-identical: " + ("yes" if ok else "NO"))
    for line in failures:
        print("  " + line)
    if args.out:
        atomic_write_json(args.out, {"cpu": cpu_kind(), "threads": torch.get_num_threads(), "args": vars(args),
                                     "rows": rows, "summary": summary, "ok": ok, "failures": failures})
    report("weight_sync", figures, ratios)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
