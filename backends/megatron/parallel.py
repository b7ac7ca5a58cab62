"""Megatron's parallel layout of a full GPTModel state dict: tensor (TP), pipeline (PP) and expert (EP,
with the experts' own tensor-parallel size ETP) shards, and their merge back.

How each tensor splits across TP ranks follows megatron-core's layers:

- column-parallel (rows cut into TP contiguous parts): the vocabulary of the embedding and the output
  layer, the MLA up-projections (whole heads per rank: TP must divide the heads), and, in the local spec,
  the MLA down-projections;
- gated column-parallel: a fused ``linear_fc1`` = [gate; up] is cut half by half, rank r holding
  [gate_r; up_r], so each rank's SwiGLU sees matching gate and up rows;
- row-parallel (columns cut): ``linear_proj`` and every ``linear_fc2`` (the partial outputs are summed);
- replicated: norms, the router and its expert bias, the DSA indexer, and (transformer-engine spec) the
  MLA down-projections.

Routed experts go to EP ranks in contiguous blocks (rank k holds experts k*E/EP .. (k+1)*E/EP - 1, renamed
0 .. E/EP - 1), then each expert is split across ETP like a dense MLP. Pipeline stage s holds layers
s*L/PP .. (s+1)*L/PP - 1 renamed from 0; the embedding lives on the first stage, the final norm and the
output layer on the last (with a tied embedding and PP > 1 the last stage keeps its own copy, as
megatron allocates it there).

A shard is keyed ``(pp, tp, ep)``: what that GPU's model holds, its experts split at ETP rank
``tp % etp`` (ETP is 1, every TP rank holding whole experts, or TP, the default of megatron-core).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from orthon.core.errors import CheckpointError, ConfigError
from orthon.backends.megatron.convert import MegatronLayout, expert_name
from orthon.pretrain.config import ModelConfig

REPLICATED, COLUMN, GATED, ROW = "replicated", "column", "gated", "row"


@dataclass(frozen=True)
class ParallelSizes:
    """tp, pp, ep: tensor, pipeline and expert parallel sizes; etp: the experts' tensor-parallel size
    (None: tp, as in megatron-core)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def splits_model(self) -> bool:
        """The ranks hold parts of the model (tensor, pipeline or expert parallelism)."""
        return (self.tp, self.pp, self.ep) != (1, 1, 1)


def check_parallel(config: ModelConfig, sizes: ParallelSizes, layout: MegatronLayout = MegatronLayout()) -> None:
    """A ConfigError naming the sizes that conflict when the layout does not divide the model."""
    for value, name in ((sizes.tp, "TP"), (sizes.pp, "PP"), (sizes.ep, "EP"), (sizes.expert_tp, "ETP")):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
    tp, etp = sizes.tp, sizes.expert_tp
    needs = [(config.num_attention_heads, tp, "TP", "attention heads (num_attention_heads)"),
             (config.vocab_size, tp, "TP", "vocabulary entries (vocab_size)"),
             (config.num_hidden_layers, sizes.pp, "PP", "layers (num_hidden_layers)")]
    if config.first_k_dense_replace:
        needs.append((config.intermediate_size, tp, "TP", "dense MLP width (intermediate_size)"))
    if layout.splits_down_proj:
        needs += [(config.q_lora_rank, tp, "TP", "query latent width (q_lora_rank)"),
                  (config.kv_lora_rank + config.qk_rope_head_dim, tp, "TP",
                   "key-value latent + rope width (kv_lora_rank + qk_rope_head_dim)")]
    if config.has_moe:
        needs += [(config.n_routed_experts, sizes.ep, "EP", "routed experts (n_routed_experts)"),
                  (config.moe_intermediate_size, etp, "ETP", "expert width (moe_intermediate_size)")]
        if config.n_shared_experts:
            needs.append((config.moe_intermediate_size * config.n_shared_experts, tp, "TP",
                          "shared expert width (moe_intermediate_size x n_shared_experts)"))
    elif sizes.ep > 1:
        raise ConfigError(f"EP {sizes.ep}: the model has no MoE layers (first_k_dense_replace = num_hidden_layers)")
    for total, size, name, what in needs:
        if total % size:
            raise ConfigError(f"{name} {size} does not divide the model's {total} {what}")
    if etp not in (1, tp):
        raise ConfigError(f"ETP {etp}: the experts' tensor-parallel size must be 1 or TP ({tp})")


# (prefix, fc, expert) as convert.expert_name takes them, for TEGroupedMLP's names or SequentialMLP's
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.(?:(linear_fc[12])\.weight(\d+)|local_experts\.(\d+)\.(linear_fc[12])\.weight)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def split_rule(name: str, layout: MegatronLayout) -> str:
    """How the tensor ``name`` (without any layer or expert numbering questions) splits across TP ranks."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return COLUMN
    if name.endswith(("linear_q_up_proj.weight", "linear_kv_up_proj.weight", "linear_q_proj.weight")):
        return COLUMN
    if name.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
        return COLUMN if layout.splits_down_proj else REPLICATED
    expert_fc = (_expert_key(name) or (None, None))[1]  # a grouped expert's name ends in its number
    if name.endswith(("self_attention.linear_proj.weight", "linear_fc2.weight")) or expert_fc == "linear_fc2":
        return ROW
    if name.endswith("linear_fc1.weight") or expert_fc == "linear_fc1":
        return GATED
    return REPLICATED


def split(tensor: torch.Tensor, rule: str, parts: int) -> list[torch.Tensor]:
    """``tensor`` cut into ``parts`` by ``rule``."""
    return [_own(piece) for piece in _parts(tensor, rule, parts)]


def _parts(tensor: torch.Tensor, rule: str, parts: int) -> list:
    """``split``'s parts before any copy: slices, and gated parts not yet assembled (``shard`` builds only
    the ones it returns)."""
    if parts == 1 or rule == REPLICATED:
        return [tensor] * parts
    if rule == COLUMN:
        return list(tensor.chunk(parts, dim=0))
    if rule == ROW:
        return list(tensor.chunk(parts, dim=1))
    gate, up = tensor.chunk(2, dim=0)
    return [_Gated(g, u) for g, u in zip(gate.chunk(parts, dim=0), up.chunk(parts, dim=0))]


class _Gated:
    """A gated part not yet built: [gate_r; up_r] is assembled only for the shards returned."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor):
        self.gate, self.up = gate, up

    def build(self) -> torch.Tensor:
        return torch.cat([self.gate, self.up])


def _own(piece) -> torch.Tensor:
    """A shard's tensor: a gated part assembled, a column slice as the view it is, a row slice copied."""
    return piece.build() if isinstance(piece, _Gated) else piece.contiguous()


def join(pieces: list[torch.Tensor], rule: str, name: str) -> torch.Tensor:
    """The inverse of ``split``; replicated copies must agree (a mismatch names the tensor)."""
    if len(pieces) == 1:
        return pieces[0]
    if rule == REPLICATED:
        for rank, piece in enumerate(pieces[1:], start=1):
            if not torch.equal(piece, pieces[0]):
                raise CheckpointError(f"{name}: replicated across TP ranks but rank {rank} holds other values than rank 0")
        return pieces[0]
    if rule == COLUMN:
        return torch.cat(pieces, dim=0)
    if rule == ROW:
        return torch.cat(pieces, dim=1)
    halves = [p.chunk(2, dim=0) for p in pieces]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def _expert_key(name: str) -> tuple[str, str, int] | None:
    """(prefix, fc, expert) of an expert tensor's name."""
    m = _EXPERT.match(name)
    if not m:
        return None
    return (m[1], m[2], int(m[3])) if m[2] else (m[1], m[5], int(m[4]))


def global_expert_name(name: str, ep_rank: int, experts_per_rank: int, layout: MegatronLayout) -> str | None:
    """The name an expert tensor of expert-parallel rank ``ep_rank`` (its experts numbered from 0 there) has
    in the full model; None for a tensor that is not an expert's."""
    key = _expert_key(name)
    if key is None:
        return None
    prefix, fc, index = key
    return expert_name(prefix, fc, ep_rank * experts_per_rank + index, layout)


def layer_of(name: str) -> int | None:
    """The decoder layer of megatron's tensor ``name`` (None: the embedding, final norm or head)."""
    m = _LAYER.match(name)
    return int(m[1]) if m else None


def stage_name(name: str, layers_per_stage: int) -> tuple[int | None, str]:
    """(pipeline stage, name on that stage) of a decoder-layer tensor; (None, name) for the others."""
    m = _LAYER.match(name)
    if not m:
        return None, name
    layer = int(m[1])
    return layer // layers_per_stage, f"decoder.layers.{layer % layers_per_stage}.{m[2]}"


def shard(state: dict[str, torch.Tensor], config: ModelConfig, sizes: ParallelSizes,
          layout: MegatronLayout = MegatronLayout(),
          only: tuple[int, int, int] | None = None) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """Megatron's full state dict -> {(pp, tp, ep): the state dict of that rank's model}; ``only``: just that
    rank's (what a process loads: nothing of the other ranks is copied)."""
    check_parallel(config, sizes, layout)
    tp, pp, ep, etp = sizes.tp, sizes.pp, sizes.ep, sizes.expert_tp
    per_stage = config.num_hidden_layers // pp
    per_ep = config.n_routed_experts // ep if config.has_moe else 0
    keys = [(s, t, e) for s in range(pp) for t in range(tp) for e in range(ep)]
    if only is not None:
        if only not in keys:
            raise ConfigError(f"rank (pp, tp, ep) = {only} is outside PP {pp} x TP {tp} x EP {ep}")
        keys = [only]
    shards = {key: {} for key in keys}
    for name, tensor in state.items():
        if name.endswith("._extra_state"):
            continue
        stage, local = stage_name(name, per_stage)
        stages = [stage] if stage is not None else _stages_of(name, pp, config)
        expert = _expert_key(local)
        if expert is not None:
            prefix, fc, index = expert
            owner, local_index = divmod(index, per_ep)
            pieces = _parts(tensor, split_rule(local, layout), etp)
            local = expert_name(prefix, fc, local_index, layout)
            for s in stages:
                for t in range(tp):
                    if (s, t, owner) in shards:
                        shards[(s, t, owner)][local] = _own(pieces[t % etp])
            continue
        pieces = _parts(tensor, split_rule(local, layout), tp)
        targets = [(s, local) for s in stages]
        if name == "embedding.word_embeddings.weight" and config.tie_word_embeddings and pp > 1:
            targets.append((pp - 1, "output_layer.weight"))  # the last stage's copy of the tied embedding
        for s, target in targets:
            for t in range(tp):
                for e in range(ep):
                    if (s, t, e) in shards:
                        shards[(s, t, e)][target] = _own(pieces[t])
    return shards


def _stages_of(name: str, pp: int, config: ModelConfig) -> list[int]:
    if name == "embedding.word_embeddings.weight":
        return [0]
    if name in ("decoder.final_layernorm.weight", "output_layer.weight"):
        return [pp - 1]
    raise CheckpointError(f"{name}: not a tensor of megatron's GPTModel")


def merge(shards: dict[tuple[int, int, int], dict[str, torch.Tensor]], config: ModelConfig, sizes: ParallelSizes,
          layout: MegatronLayout = MegatronLayout()) -> dict[str, torch.Tensor]:
    """{(pp, tp, ep): rank state} -> megatron's full state dict (the inverse of ``shard``)."""
    check_parallel(config, sizes, layout)
    tp, pp, ep, etp = sizes.tp, sizes.pp, sizes.ep, sizes.expert_tp
    missing = [(s, t, e) for s in range(pp) for t in range(tp) for e in range(ep) if (s, t, e) not in shards]
    if missing:
        raise CheckpointError(f"shards missing for (pp, tp, ep) = {missing[:4]} of PP {pp} x TP {tp} x EP {ep}")
    per_stage = config.num_hidden_layers // pp
    per_ep = config.n_routed_experts // ep if config.has_moe else 0
    out: dict[str, torch.Tensor] = {}
    for s in range(pp):
        for name in shards[(s, 0, 0)]:
            if name.endswith("._extra_state") or _expert_key(name) is not None:
                continue
            if name == "output_layer.weight" and config.tie_word_embeddings:
                continue  # the last stage's copy of the tied embedding
            full = global_layer_name(name, s, per_stage)
            out[full] = join([_take(shards[(s, t, 0)], name, (s, t, 0)) for t in range(tp)], split_rule(name, layout), full)
        for e in range(ep):
            for name in shards[(s, 0, e)]:
                key = _expert_key(name)
                if key is None:
                    continue
                prefix, fc, index = key
                pieces = [_take(shards[(s, t, e)], name, (s, t, e)) for t in range(etp)]
                full = global_layer_name(expert_name(prefix, fc, e * per_ep + index, layout), s, per_stage)
                out[full] = join(pieces, split_rule(name, layout), full)
    return out


def global_layer_name(name: str, stage: int, per_stage: int) -> str:
    """The model's name of a tensor named ``name`` on pipeline ``stage`` (the inverse of ``stage_name``)."""
    m = _LAYER.match(name)
    return f"decoder.layers.{stage * per_stage + int(m[1])}.{m[2]}" if m else name


def _take(shard_state: dict, name: str, rank) -> torch.Tensor:
    try:
        return shard_state[name]
    except KeyError:
        raise CheckpointError(f"shard (pp, tp, ep) = {rank} lacks {name}") from None
