"""orthon's optimizer (Muon + Muon Split on hidden matrices, AdamW on the rest; ``orthon.optim``) for a
megatron-core model whose matrices are tensor-parallel shards.

Muon orthogonalises whole matrices, and the orthogonalisation of a shard is not the shard of the
orthogonalised matrix. ``TensorParallelOrthogonaliser`` gathers each sharded update along its partition
dimension within its tensor-parallel group (the experts' group for expert weights), orthogonalises the
full matrix and keeps this rank's part, so every rank applies exactly the update one device would. Two
cases need no gathering: a matrix that is not sharded, and Muon Split's per-head blocks of the MLA
up-projections, whose heads are whole on each rank (column-parallel by heads).

orthon's torch model keeps a dense MLP's (and the shared expert's) gate and up projections as two
matrices, each orthogonalised on its own, where megatron fuses them into one ``linear_fc1``; that tensor
is Muon Split into its two halves here (tagged ``orthon_gate_up``), and under TP its gathered shards
[gate_0; up_0; gate_1; up_1; ...] are put back in [gate; up] order first. A routed expert's fused
[gate; up] is one matrix in orthon too; gathered across the experts' TP ranks it arrives as a row
permutation of [gate; up], and Newton-Schulz commutes with row permutations, so the result is the same.

Muon scales an update by its block's shape (``orthon.optim.muon.update_scale``), and it sees the local
shard's; the orthogonaliser returns its slice pre-multiplied by full-scale / shard-scale, so the step
equals the unsharded one (for the default ``match_rms_adamw`` scaling, which is what
``orthon.optim.hybrid.build_optimizer`` sets)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from orthon.backends.megatron.parallel import GATED, join, split
from orthon.optim.muon import MatrixWork, orthogonalise_local, update_scale
from orthon.optim.param_spec import ParamSpec
from orthon.pretrain.config import ModelConfig

_SPLIT_BY_HEAD = ("linear_q_up_proj.weight", "linear_kv_up_proj.weight")
# megatron's fused [gate; up] of a dense MLP or a shared expert: two matrices in orthon's model
_GATE_UP = ("mlp.linear_fc1.weight", "shared_experts.linear_fc1.weight")


def param_specs(named_parameters, model: ModelConfig, tp: int) -> dict[str, ParamSpec]:
    """ParamSpec of each megatron parameter, by its name: the embedding and output layer as orthon's
    embedding / output head, 1-D tensors as norms (megatron's GLM-5 has no biases), the MLA
    up-projections split into one Muon block per head on this rank, every other matrix Muon's."""
    heads_here = model.num_attention_heads // tp
    specs = {}
    for name, p in named_parameters:
        if name.endswith("word_embeddings.weight"):
            specs[name] = ParamSpec("embedding")
        elif name.startswith("output_layer."):
            specs[name] = ParamSpec("output_head")
        elif p.ndim == 1:
            specs[name] = ParamSpec("norm")
        elif name.endswith(_SPLIT_BY_HEAD):
            specs[name] = ParamSpec("matrix", split_rows=heads_here)
        elif name.endswith(_GATE_UP):
            specs[name] = ParamSpec("matrix", split_rows=2)
        elif p.ndim == 3:
            specs[name] = ParamSpec("expert_stack")
        else:
            specs[name] = ParamSpec("matrix")
    return specs


class TensorParallelOrthogonaliser:
    """Muon's ``orthogonaliser`` for tensor-parallel shards: ``tp_group`` for dense weights,
    ``expert_group`` (the experts' tensor-parallel group) for expert weights; None: not sharded."""

    def __init__(self, tp_group=None, expert_group=None):
        self.tp_group, self.expert_group = tp_group, expert_group
        self.gathered = 0  # items of the last step orthogonalised whole (for tests and inspection)

    def _group(self, item: MatrixWork):
        param = item.param
        if not getattr(param, "tensor_model_parallel", False):
            return None
        # megatron-core marks expert weights allreduce=False (they are reduced over the expert groups)
        group = self.tp_group if getattr(param, "allreduce", True) else self.expert_group
        if group is None or dist.get_world_size(group) == 1:
            return None
        if getattr(param, "orthon_gate_up", False):
            return group
        if item.split_rows > 1 and getattr(param, "partition_dim", 0) == 0:
            return None  # Muon Split by head: the heads are whole on this rank
        return group

    def __call__(self, work: list[MatrixWork], ns: Callable[[Tensor, MatrixWork], Tensor]) -> list[Tensor]:
        groups = [self._group(item) for item in work]
        local = [i for i, g in enumerate(groups) if g is None]
        results: list[Tensor | None] = [None] * len(work)
        for i, out in zip(local, orthogonalise_local([work[i] for i in local], ns)):
            results[i] = out
        self.gathered = 0
        for i, group in enumerate(groups):
            if group is not None:
                results[i] = self._whole(work[i], group, ns)
                self.gathered += 1
        return results  # type: ignore[return-value]

    def _whole(self, item: MatrixWork, group, ns) -> Tensor:
        dim = getattr(item.param, "partition_dim", 0) % item.update.ndim
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        pieces = [torch.empty_like(item.update) for _ in range(world)]
        dist.all_gather(pieces, item.update.contiguous(), group=group)
        gate_up = getattr(item.param, "orthon_gate_up", False)  # [gate_r; up_r] per rank, [gate; up] whole
        full = join(pieces, GATED, "") if gate_up else torch.cat(pieces, dim=dim)
        whole = dataclasses.replace(item, update=full, global_shape=tuple(full.shape))
        out = orthogonalise_local([whole], ns)[0]
        n = item.update.shape[dim]
        mine = split(out, GATED, world)[rank] if gate_up else out.narrow(dim, rank * n, n)
        ratio = update_scale(*whole.block_shape) / update_scale(*item.block_shape)
        return mine * ratio


def build_optimizer(gpt, model: ModelConfig, optim_cfg, schedule, tp: int = 1):
    """orthon's HybridOptimizer (Muon + Split / AdamW, one LR schedule) over ``gpt``'s parameters, with the
    tensor-parallel orthogonaliser over megatron's TP and expert-TP groups. Parameters in bf16 (megatron's
    bf16 mode, ``MegatronOptions.params_dtype``) are stepped through fp32 main weights
    (orthon.optim.main_weights), as megatron's own mixed-precision optimizer does."""
    from megatron.core import parallel_state

    from orthon.optim.hybrid import build_optimizer as build_hybrid, route_by_config
    from orthon.optim.main_weights import with_main_weights

    named = list(gpt.named_parameters())
    for name, p in named:
        if name.endswith(_GATE_UP):
            p.orthon_gate_up = True
    orthogonaliser = TensorParallelOrthogonaliser(parallel_state.get_tensor_model_parallel_group(),
                                                  parallel_state.get_expert_tensor_parallel_group())

    def build(main):
        plan = route_by_config(main, param_specs(main, model, tp), optim_cfg)
        return build_hybrid(plan, optim_cfg, schedule, orthogonaliser=orthogonaliser)

    return with_main_weights(named, build)
