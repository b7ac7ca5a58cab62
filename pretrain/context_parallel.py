"""Context parallelism (``train.context_parallel``): one sequence split over a group of ranks.

For contexts one device cannot hold (GLM-5's mid-training runs to 200K tokens), the ``cp`` ranks of a
group take the same sequences and each runs a part of every sequence's positions through the model;
groups are consecutive ranks, and data parallelism runs over the world / cp groups. Causal attention
gives a later position more keys, so the sequence is cut into 2 cp chunks and rank r holds chunks r and
2 cp - 1 - r (the "zigzag" split): every rank gets the same attention work.

What crosses ranks is what MLA makes small: each attention layer all-gathers its per-token latent
[c_kv; k_rope] (kv_lora_rank + rope numbers a token: 576 for GLM-5, against 64 heads x 256 expanded) and
the DSA indexer's keys (index_head_dim a token), in sequence order; a rank's queries then attend to the
whole sequence's keys, densely or through their top-k, with the same functions as one process. The
gather's backward is a reduce-scatter: each rank's latent gets the gradients of every rank's queries.
Everything else (the MLPs, the MoE, the loss) is per token and runs on the rank's own tokens.

Gradients: every rank's loss is its own tokens' share of the global mean, and DDP / FSDP2 average over
the whole world, as without context parallelism: a rank of a group is to them one more data rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh

from orthon.core.errors import ConfigError

# The differentiable gather along dim 0: all_gather_single_autograd in newer torch (2.13), only the general
# all_gather_tensor_autograd in older ones (2.11): the same collective, the same backward (a reduce-scatter).
_all_gather_rows = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)

CONTEXT_MESH_DIMS = ("context_replicas", "context")


def check_degree(cp: int, world: int, seq_len: int, key: str = "train.context_parallel") -> None:
    """ConfigError unless ``cp`` ranks can share sequences of ``seq_len``: it divides the world, and the
    sequence splits into 2 cp equal chunks."""
    if cp < 1:
        raise ConfigError(f"{key}: must be at least 1, got {cp}")
    if world % cp:
        raise ConfigError(f"{key} = {cp} does not divide the {world} ranks of this run")
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(f"{key} = {cp}: the sequence length {seq_len} must be a multiple of 2 x {cp} "
                          f"(each rank holds two of {2 * cp} equal chunks)")


def zigzag_runs(seq_len: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The position ranges [a, b) rank ``rank`` of ``cp`` holds: chunks rank and 2 cp - 1 - rank of the
    2 cp equal chunks of the sequence, in order."""
    chunk = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return [(first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk)]


def gathered_order(seq_len: int, cp: int) -> torch.Tensor:
    """(seq_len,) rows of the ranks' parts concatenated in rank order, in sequence order: position p's
    row in the all-gather's output is order[p]."""
    where = torch.empty(seq_len, dtype=torch.long)
    row = 0
    for rank in range(cp):
        for a, b in zigzag_runs(seq_len, cp, rank):
            where[a:b] = torch.arange(row, row + b - a)
            row += b - a
    return where


@dataclass
class ContextShard:
    """This rank's part of one batch's sequences: its positions, and the gather of every rank's rows.

    runs: the position ranges held, in order; positions: (T_local,) the same positions; key_docs: (B, T)
    the document of every position of the sequence (packed documents), or None."""

    runs: list[tuple[int, int]]
    positions: torch.Tensor
    order: torch.Tensor
    group: object
    key_docs: torch.Tensor | None = None

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of t (B, T, ...) -> (B, T_local, ...)."""
        return torch.cat([t[:, a:b] for a, b in self.runs], dim=1)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of t (B, T_local, D), in sequence order: (B, T, D); differentiable (the
        gradient of each rank's rows is summed over the ranks that used them)."""
        # Gathered along dim 0 (positions first): one contiguous block per rank, no chunk-and-concatenate.
        rows = _all_gather_rows(t.transpose(0, 1).contiguous(), gather_dim=0, group=self.group)
        return rows.index_select(0, self.order).transpose(0, 1)


class ContextParallel:
    """The context-parallel group this rank belongs to (consecutive ranks of a (world / cp, cp) mesh)."""

    def __init__(self, cp: int, device: torch.device):
        self.size = cp
        self.mesh = init_device_mesh(device.type, (dist.get_world_size() // cp, cp), mesh_dim_names=CONTEXT_MESH_DIMS)
        self.group = self.mesh.get_group(CONTEXT_MESH_DIMS[1])
        self.rank = self.mesh.get_local_rank(CONTEXT_MESH_DIMS[1])
        self._orders: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def shard(self, seq_len: int, device: torch.device, key_docs: torch.Tensor | None = None) -> ContextShard:
        if seq_len % (2 * self.size):
            raise ValueError(f"context parallelism over {self.size} ranks: a sequence of {seq_len} tokens does not "
                             f"split into {2 * self.size} equal chunks")
        runs = zigzag_runs(seq_len, self.size, self.rank)
        key = (seq_len, str(device))
        if key not in self._orders:
            positions = torch.cat([torch.arange(a, b) for a, b in runs])
            self._orders[key] = (positions.to(device), gathered_order(seq_len, self.size).to(device))
        positions, order = self._orders[key]
        return ContextShard(runs, positions, order, self.group, key_docs)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a (B, T, ...) batch tensor."""
        return self.shard(t.shape[1], t.device).local(t)
