"""Delta weight sync where the trainer ranks hold shards: each rank encodes the rows it holds.

With ``rl.cluster.delta`` and shards (FSDP2, expert parallelism) no process holds the whole model, so no
process can hold the copy of what the engines hold that a delta is taken against. Here every rank keeps
that copy of its own rows (about 1/N of the model) and each sync writes the delta of those rows as one
payload file (rows a..b-1 of tensor NAME as an entry named ``NAME[a:b]``, orthon.engine.delta). Rank 0
hands the files to the engines in rank order, all but the last not ``final``, so an engine reports the
new version only once every rank's rows are in (orthon.rl.weight_sync). A tensor's rows are encoded by the
lowest rank holding them (replicas send nothing twice); a tensor that is not split by rows (a buffer, a
replicated parameter) by rank 0, gathered whole where it is sharded otherwise.

Where the ranks' parts are not rows of orthon's tensors (megatron's tensor parallelism cuts some by
columns), ``PartDelta``: the model in parts each gathered to one rank, which keeps the copy of its parts
and encodes their delta; the payloads go the same way.

After a full copy (the first sync, a restarted engine, a failed sync) the ranks ``reset`` to the bytes
they handed over; a delta is taken only from a version every engine holds.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import orthon.pretrain.hf_io as hf_io
from orthon.core.files import atomic_write_bytes
from orthon.engine.delta import DeltaEncoder
from orthon.pretrain.gathered_weights import row_holders, split_by_rows


def _runs(rows: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(local start, local stop, first global row) of the runs of (local index, global row) pairs that are
    consecutive in both."""
    runs = []
    for i, row in rows:
        if runs and runs[-1][1] == i and runs[-1][2] + i - runs[-1][0] == row:
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
        else:
            runs.append((i, i + 1, row))
    return runs


class _RankDelta:
    """One rank's delta encoder over its ``pieces()``: [(name, tensor)] of what it encodes."""

    def __init__(self, rank: int):
        self.rank = rank
        self.encoder = DeltaEncoder()

    def pieces(self) -> list[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def reset(self, version: int) -> None:
        """The engines now hold the model's current bytes as ``version``."""
        self.encoder.reset(self.pieces(), version)

    def write(self, directory: Path, version: int, final: bool) -> Path:
        """This rank's delta to ``version`` as ``directory/rank_R.bin`` (atomic); the copy moves to it."""
        payload = self.encoder.encode(self.pieces(), version, final=final)
        path = Path(directory) / f"rank_{self.rank:05d}.bin"
        atomic_write_bytes(path, payload.to_bytes())
        return path


class ShardDelta(_RankDelta):
    """One rank's side. Built on every rank together (planning which rows each encodes is a collective)."""

    def __init__(self, model, rank: int):
        super().__init__(rank)
        self.model = model
        self.plan = []  # (name, [(local start, local stop, first global row)] or None: whole, gathered)
        live = model.state_dict()
        for name in hf_io.persistent_names(model):
            tensor = live[name]
            if split_by_rows(tensor):
                holders = row_holders(tensor)
                lower = {row for rows in holders[:rank] for row in rows}  # a lower rank encodes those
                self.plan.append((name, _runs([(i, row) for i, row in enumerate(holders[rank]) if row not in lower])))
            else:
                self.plan.append((name, None))

    def pieces(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's rows of every tensor, by piece name (a collective where a tensor is gathered whole)."""
        live = self.model.state_dict()
        out = []
        for name, runs in self.plan:
            tensor = live[name].detach()
            if runs is None:
                whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                if self.rank == 0:
                    out.append((name, whole))
                continue
            local, rows = tensor.to_local(), tensor.shape[0]
            for a, b, first in runs:
                piece = first, first + b - a
                out.append((name if piece == (0, rows) else hf_io.row_piece_name(name, *piece), local[a:b]))
        return out


class PartDelta(_RankDelta):
    """One rank's side where the ranks' parts of the model are not rows of orthon's tensors (another
    backend's tensor and pipeline parallelism: megatron cuts a fused projection by columns, or a gated
    one half by half): the model in parts of about ``part_bytes`` (the model's ``weight_parts``), part i
    gathered to rank i mod N, which keeps the copy of it the engines hold and encodes its delta. Each rank
    keeps about 1/N of the model, as with ``ShardDelta``; gathering the parts is a collective."""

    def __init__(self, model, rank: int, world: int, part_bytes: int):
        super().__init__(rank)
        self.model, self.world, self.part_bytes = model, world, part_bytes

    def pieces(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for load in self.model.weight_parts(self.part_bytes, owner=lambda i: i % self.world):
            out.extend((load() or {}).items())
        return out
