"""Muon and Muon Split as a ``torch.optim.Optimizer``.

Per parameter W (a matrix, a stack of matrices, or a matrix cut into row
blocks) with gradient g, momentum buffer B and the torch.optim.Muon
conventions (B is an exponential average; Nesterov looks one step ahead):

    B <- mu B + (1 - mu) g
    U <- (1 - mu) g + mu B            (Nesterov; plain momentum uses U = B)
    O <- NewtonSchulz(U) per matrix block
    W <- W (1 - lr wd)                (decoupled weight decay)
    W <- W - lr * 0.2 * sqrt(max(rows, cols)) * O   (rows, cols of the block)

Each parameter group may carry ``split_rows`` (Muon Split: cut the rows into
that many equal blocks, each orthogonalised and scaled on its own; for MLA's
W_QB / W_KVB one block per head). A 3-D parameter is a stack of matrices
(e.g. MoE experts), each orthogonalised on its own. All blocks of the same
shape, across parameters and groups, go through one batched Newton-Schulz
call; momentum and the parameter updates use foreach ops.

With ``split_rows=1`` on 2-D parameters this computes what
``torch.optim.Muon(..., nesterov=True, adjust_lr_fn="match_rms_adamw")`` does.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from orthon.optim.newton_schulz import (
    DEFAULT_COEFFICIENTS,
    DEFAULT_EPS,
    DEFAULT_STEPS,
    ns_batch_elements,
    emulates_bf16,
    newton_schulz,
    ns_dtype,
)
from orthon.optim.fused import EagerPasses, FusedPasses
from orthon.optim.gram_newton_schulz import GRAM_DTYPE_NAMES, NS_METHODS, orthogonalise_gram_or_standard

ADJUST_LR_FNS = ("match_rms_adamw", "original", "none")
BF16_MATMUL_MODES = ("auto", "native", "emulated")


def update_scale(block_rows: int, cols: int, adjust_lr_fn: str = "match_rms_adamw", rms_scale: float = 0.2) -> float:
    """The factor on lr for a rows x cols block's orthogonalised update.

    ``match_rms_adamw``: rms_scale * sqrt(max(rows, cols)), so the update's
    RMS matches AdamW's (Moonlight); ``original``: sqrt(max(1, rows/cols))
    (Keller Jordan's Muon); ``none``: 1.
    """
    if adjust_lr_fn == "match_rms_adamw":
        return rms_scale * math.sqrt(max(block_rows, cols))
    if adjust_lr_fn == "original":
        return math.sqrt(max(1.0, block_rows / cols))
    if adjust_lr_fn == "none":
        return 1.0
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


@dataclass
class MatrixWork:
    """One parameter's Newton-Schulz job.

    update: the Nesterov update on this rank (the local shard for a sharded
    DTensor parameter); global_shape: the parameter's full shape; the blocks
    are ``global_shape[-2] // split_rows`` x ``global_shape[-1]`` matrices,
    ``prod(global_shape[:-2]) * split_rows`` of them. ns_key: (steps,
    coefficients, eps, dtype, method, gram dtype name); dtype (index 3) is the
    one updates travel in between ranks. param: the parameter (DTensor placements are
    read from it). sharded: this rank's piece cuts through its matrices (FSDP2's row shards): it
    must be gathered to be orthogonalised. local: this rank's piece is whole matrices of its own (a
    stack split along its stack dimension: expert parallelism, FSDP2's shards of an expert stack):
    each rank orthogonalises its piece where it lies.
    """

    update: Tensor
    global_shape: tuple[int, ...]
    split_rows: int
    ns_key: tuple
    sharded: bool
    param: Tensor
    local: bool = False

    @property
    def block_shape(self) -> tuple[int, int]:
        return self.global_shape[-2] // self.split_rows, self.global_shape[-1]

    @property
    def num_blocks(self) -> int:
        return math.prod(self.global_shape[:-2]) * self.split_rows


def shard_placements(t: Tensor) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) of each placement that splits the DTensor ``t`` (none for a plain tensor).
    Read by their dim: FSDP2's shards of an already sharded tensor (expert parallelism) are
    _StridedShard, for which is_shard() is False."""
    if not isinstance(t, DTensor):
        return []
    return [(mesh_dim, pl.dim % t.ndim) for mesh_dim, pl in enumerate(t.placements) if hasattr(pl, "dim")]


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor sharded through its matrices (FSDP2 parameters' row shards)."""
    return any(dim >= t.ndim - 2 for _, dim in shard_placements(t))


def holds_whole_matrices(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor sharded only along its stack dimensions: each rank's piece is whole
    matrices (an expert stack split by expert)."""
    dims = [dim for _, dim in shard_placements(t)]
    return bool(dims) and all(dim < t.ndim - 2 for dim in dims)


def local_tensor(t: Tensor) -> Tensor:
    """The tensor this rank holds (a DTensor's local shard; in no-grad mode it aliases the storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """Muon with per-block (split) and per-expert (stack) orthogonalisation.

    Group options: lr, weight_decay, momentum, nesterov, ns_steps,
    ns_coefficients, eps, ns_dtype ("bf16" or "fp32"), ns_method
    ("standard", or "gram": Gram Newton-Schulz on the blocks where it pays,
    see orthon.optim.gram_newton_schulz), gram_dtype ("auto", "fp16",
    "bf16", "fp32": gram's compute dtype; auto picks per device), adjust_lr_fn,
    rms_scale, split_rows, and optionally param_names (used in errors).

    Optimizer-wide: ``bf16_matmul`` ("auto", "native" or "emulated", see
    orthon.optim.newton_schulz), ``fused`` (the elementwise passes around
    Newton-Schulz compiled into one sweep each, see orthon.optim.fused; then
    no longer bit-identical to torch.optim.Muon) and ``orthogonaliser``: a callable that takes
    the list of MatrixWork items and an ``ns(stack, item)`` function and
    returns one orthogonalised tensor per item; the default runs everything
    here, ``orthon.optim.distributed.DistributedOrthogonaliser`` shares the
    work among data-parallel ranks.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = DEFAULT_STEPS,
        ns_coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_dtype: str = "bf16",
        ns_method: str = "standard",
        gram_dtype: str = "auto",
        adjust_lr_fn: str = "match_rms_adamw",
        rms_scale: float = 0.2,
        split_rows: int = 1,
        bf16_matmul: str = "auto",
        fused: bool = False,
        orthogonaliser: Callable[..., list[Tensor]] | None = None,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon lr must be >= 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"Muon weight_decay must be >= 0, got {weight_decay}")
        if bf16_matmul not in BF16_MATMUL_MODES:
            raise ValueError(f"Muon bf16_matmul must be one of {BF16_MATMUL_MODES}, got {bf16_matmul!r}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_dtype=ns_dtype,
            ns_method=ns_method,
            gram_dtype=gram_dtype,
            adjust_lr_fn=adjust_lr_fn,
            rms_scale=rms_scale,
            split_rows=split_rows,
        )
        super().__init__(params, defaults)
        self.bf16_matmul = bf16_matmul
        self.passes = FusedPasses() if fused else EagerPasses()
        self.orthogonaliser = orthogonaliser or orthogonalise_local

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    def _check_group(self, group: dict) -> None:
        update_scale(1, 1, group["adjust_lr_fn"], group["rms_scale"])  # validates the name
        ns_dtype(group["ns_dtype"])
        if group["ns_method"] not in NS_METHODS:
            raise ValueError(f"Muon ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")
        if group["gram_dtype"] not in GRAM_DTYPE_NAMES:
            raise ValueError(f"Muon gram_dtype must be one of {GRAM_DTYPE_NAMES}, got {group['gram_dtype']!r}")
        names = group.get("param_names") or [None] * len(group["params"])
        split = group["split_rows"]
        if not isinstance(split, int) or split < 1:
            raise ValueError(f"Muon split_rows must be a positive integer, got {split!r}")
        for index, (p, name) in enumerate(zip(group["params"], names)):
            label = name or f"parameter {index} of shape {tuple(p.shape)}"
            if p.ndim < 2:
                raise ValueError(f"Muon: {label} has shape {tuple(p.shape)}; Muon needs a matrix or a stack of matrices")
            if torch.is_complex(p):
                raise ValueError(f"Muon: {label} is complex; not supported")
            if p.shape[-2] % split:
                raise ValueError(
                    f"Muon Split: {label} has {p.shape[-2]} rows, which {split} blocks do not divide"
                )

    def _newton_schulz(self, stack: Tensor, item: MatrixWork) -> Tensor:
        """Either method on a stack of blocks, in pieces of about ``ns_batch_elements`` (a large expert stack
        too: on a CPU its GEMMs stay in cache; batching is per block, so pieces change no result)."""
        steps, coefficients, eps, dtype, method, gram_dtype = item.ns_key
        emulate = emulates_bf16(self.bf16_matmul, stack.device)

        def run(piece: Tensor) -> Tensor:
            if method == "gram":
                return orthogonalise_gram_or_standard(piece, steps, coefficients, eps, dtype, gram_dtype)
            return newton_schulz(piece, steps, coefficients, dtype, eps, emulate_bf16=emulate)

        per_piece = max(1, ns_batch_elements(stack.device) // (stack.shape[-2] * stack.shape[-1]))
        if stack.shape[0] <= per_piece:
            return run(stack)
        return torch.cat([run(piece) for piece in stack.split(per_piece)])

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        work: list[MatrixWork] = []
        applies: list[tuple[dict, list[Tensor], int, int]] = []  # group, local params, first item, count
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            local_params = [local_tensor(p) for p in params]
            grads = [local_tensor(p.grad) for p in params]
            bufs = [local_tensor(self.state[p]["momentum_buffer"]) for p in params]
            # ns_method / gram_dtype: absent from groups loaded from older checkpoints.
            key = (group["ns_steps"], tuple(group["ns_coefficients"]), group["eps"], ns_dtype(group["ns_dtype"]),
                   group.get("ns_method", "standard"), group.get("gram_dtype", "auto"))
            # The updates come in the Newton-Schulz input dtype (both methods round to it first).
            updates = self.passes.momentum_updates(bufs, grads, group["momentum"], group["nesterov"], key[3])
            applies.append((group, local_params, len(work), len(params)))
            for p, update in zip(params, updates):
                work.append(MatrixWork(update, tuple(p.shape), group["split_rows"], key, is_sharded(p), p,
                                       holds_whole_matrices(p)))

        if not work:
            return loss
        results = self.orthogonaliser(work, self._newton_schulz)

        for group, local_params, first, count in applies:
            lr = group["lr"]
            alphas = [-lr * update_scale(*work[i].block_shape, group["adjust_lr_fn"], group["rms_scale"])
                      for i in range(first, first + count)]
            self.passes.apply_updates(local_params, results[first: first + count], 1 - lr * group["weight_decay"],
                                      alphas)
        return loss


def orthogonalise_local(work: list[MatrixWork], ns: Callable[[Tensor, MatrixWork], Tensor]) -> list[Tensor]:
    """Orthogonalise every item here: batched Newton-Schulz calls per block shape and setting, each on
    about ``ns_batch_elements`` (whole items; large ones alone, unstacked)."""
    for item in work:
        if item.sharded:
            raise RuntimeError(
                "Muon: a sharded (FSDP2) parameter needs the distributed orthogonaliser "
                "(orthon.optim.distributed.DistributedOrthogonaliser) to gather its full matrix"
            )
    results: list[Tensor | None] = [item.update if item.update.numel() == 0 else None for item in work]
    for indices in (part for group in group_by_block(work).values() for part in batch_parts(work, group)):
        indices = [i for i in indices if results[i] is None]  # a rank's empty piece of a stack: nothing to do
        if not indices:
            continue
        # In the Newton-Schulz input dtype (Muon's momentum pass already rounds to it; the cast keeps
        # this right for any caller): both methods' first step, half the bytes to stack in bf16.
        dtype = work[indices[0]].ns_key[3]
        stack = stack_blocks([work[i].update.to(dtype) for i in indices], work[indices[0]])
        out = ns(stack, work[indices[0]])
        for i, piece in zip(indices, unstack_blocks(out, [work[i].update for i in indices])):
            results[i] = piece
    return results  # type: ignore[return-value]


def group_by_block(work: list[MatrixWork]) -> dict[tuple, list[int]]:
    """Item indices grouped by (block shape, Newton-Schulz settings), in first-seen order."""
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(work):
        groups.setdefault((item.block_shape, item.ns_key), []).append(i)
    return groups


def batch_parts(work: list[MatrixWork], indices: list[int]) -> list[list[int]]:
    """``indices`` cut into consecutive runs of at most ``ns_batch_elements`` (at least one item each)."""
    parts: list[list[int]] = [[]]
    size = 0
    for i in indices:
        n = work[i].update.numel()
        if parts[-1] and size + n > ns_batch_elements(work[i].update.device):
            parts.append([])
            size = 0
        parts[-1].append(i)
        size += n
    return parts


def stack_blocks(tensors: list[Tensor], like: MatrixWork) -> Tensor:
    """Concatenate the blocks of same-block-shape tensors into one (n, block_rows, cols) stack."""
    rows, cols = like.block_shape
    views = [t.reshape(-1, rows, cols) for t in tensors]
    return views[0] if len(views) == 1 else torch.cat(views)


def unstack_blocks(stack: Tensor, like: list[Tensor]) -> list[Tensor]:
    """Inverse of stack_blocks: pieces shaped like the tensors in ``like``."""
    counts = [t.numel() // (stack.shape[-2] * stack.shape[-1]) for t in like]
    return [piece.reshape(t.shape) for piece, t in zip(stack.split(counts), like)]
