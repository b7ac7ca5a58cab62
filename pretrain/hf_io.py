"""Hugging Face interop: the ``GlmMoeDsaForCausalLM`` directory layout (config.json + safetensors
shards + index), read and written without importing transformers.

This is the codec of orthon's one model-weights format; ``orthon.pretrain.weights`` (save_weights /
load_weights) adds the orthon sidecar and builds the model."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from orthon.core.errors import CheckpointError
from orthon.core.files import atomic_write_json, fsync_file
from orthon.pretrain.model import GLMForCausalLM

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3


def _persistent_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # state_dict() drops non-persistent buffers; tied weights appear once under the embedding name.
    state = model.state_dict()
    return {k: state[k].detach().contiguous() for k in persistent_names(model)}


_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Rows [first, last) of tensor NAME under the name "NAME[first:last]": a part of a tensor that travels alone
# (a trainer rank's rows of a sharded tensor in a delta, a window of an expert stack in a streamed part).
_ROW_PIECE = re.compile(r"^(.+)\[(\d+):(\d+)\]$")


def row_piece_name(name: str, first: int, last: int) -> str:
    return f"{name}[{first}:{last}]"


def row_piece(name: str) -> tuple[str, int, int] | None:
    """(tensor name, first, last) of a row piece's name (``row_piece_name``); None for a whole tensor's."""
    m = _ROW_PIECE.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def experts_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """orthon keeps routed experts stacked (E, 2I, H) / (E, H, I) for grouped compute; published
    glm_moe_dsa checkpoints (and transformers' save_pretrained) hold one gate/up/down per expert. A row
    piece of a stack (``row_piece_name``: experts first..last-1) becomes those experts' tensors."""
    out = {}
    for key, tensor in state.items():
        piece = row_piece(key)
        if _STACKED.match(key):
            out.update(stack_to_hf(key, tensor))
        elif piece is not None and _STACKED.match(piece[0]):
            out.update(stack_to_hf(piece[0], tensor, piece[1]))
        else:
            out[key] = tensor
    return out


def head_name(config) -> str:
    """The output head's tensor in a checkpoint: the embedding's where the two are tied."""
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


def is_expert_stack(name: str) -> bool:
    return _STACKED.match(name) is not None


def stack_to_hf(name: str, rows: torch.Tensor, first: int = 0) -> dict[str, torch.Tensor]:
    """Experts ``first``, ``first + 1``, ... of the stack ``name`` (``rows``: those experts' slices) as
    the HF layout's one tensor per expert."""
    prefix, kind = _STACKED.match(name).groups()
    out = {}
    for i, expert in enumerate(rows):
        e = first + i
        if kind == "down_proj":
            out[f"{prefix}.{e}.down_proj.weight"] = expert.contiguous()
        else:
            gate, up = expert.chunk(2, dim=0)
            out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
            out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
    return out


def experts_from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors back into orthon's stacks (stacked checkpoints pass through)."""
    out, experts = {}, {}
    for key, tensor in state.items():
        m = _PER_EXPERT.match(key)
        if m:
            prefix, e, kind = m.groups()
            experts.setdefault(prefix, {}).setdefault(int(e), {})[kind] = tensor
        else:
            out[key] = tensor
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))):
            raise CheckpointError(f"{prefix}: expert numbers are not 0..{len(ids) - 1}: {ids[:8]}")
        for e in ids:
            absent = {"gate_proj", "up_proj", "down_proj"} - set(by_expert[e])
            if absent:
                raise CheckpointError(f"{prefix}.{e}: missing {sorted(absent)}")
        try:
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in ids])
            out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
        except RuntimeError as exc:
            raise CheckpointError(f"{prefix}: expert tensors of different shapes ({exc})") from None
    return out


def persistent_names(model: GLMForCausalLM) -> list[str]:
    """The tensors a checkpoint of ``model`` holds: its state dict's names (persistent buffers included),
    a tied head once, under the embedding's name."""
    names = list(model.state_dict(keep_vars=True))  # names only (an FSDP model's are shards)
    if model.config.tie_word_embeddings:
        names.remove("lm_head.weight")
    return names


def hf_tensors(model: GLMForCausalLM, state: dict[str, torch.Tensor] | None = None,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors an HF directory holds for ``model`` (or for ``state``, a full state dict of it, e.g.
    gathered from FSDP shards): persistent tensors only, a tied head once (under the embedding's name),
    routed experts one tensor each, on the CPU, cast as ``to_hf`` casts."""
    if state is None:
        state = _persistent_state(model)
    else:
        expected = persistent_names(model)
        missing = sorted(set(expected) - set(state))
        if missing:
            raise CheckpointError(f"the state to save lacks {len(missing)} tensors of the model: {missing[:8]}")
        state = {k: state[k] for k in expected}
    return to_hf(state, dtype)


def to_hf(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """orthon-named tensors as the HF layout names them (routed experts one tensor each), contiguous on
    the CPU. ``dtype`` casts floating tensors, except the routers' ``e_score_correction_bias`` (kept in
    float32: it decides expert selection by small margins)."""
    return {key: tensor.cpu().to(written_dtype(key, tensor.dtype, dtype)).contiguous()
            for key, tensor in experts_to_hf({k: v.detach() for k, v in state.items()}).items()}


def written_dtype(name: str, stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype tensor ``name`` (now ``stored``) is written in when a save casts to ``dtype``: floating
    tensors are cast, except the routers' ``e_score_correction_bias``."""
    if dtype is None or not stored.is_floating_point or name.endswith("e_score_correction_bias"):
        return stored
    return dtype


def expert_windows(name: str, rows: int, nbytes: int, max_bytes: int) -> dict:
    """The parts a tensor is read or written in, {item: bytes}: an expert stack larger than ``max_bytes``
    as windows of whole experts, items (name, first, last); anything else whole, item ``name``."""
    if nbytes <= max_bytes or not is_expert_stack(name):
        return {name: nbytes}
    per_expert = nbytes // rows
    step = max(1, max_bytes // per_expert)
    return {(name, first, min(first + step, rows)): per_expert * (min(first + step, rows) - first)
            for first in range(0, rows, step)}


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """The names, in order, grouped into shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_hf(directory, tensors: dict[str, torch.Tensor], config: dict,
             max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Write ``tensors`` as safetensors shards of at most ``max_shard_bytes`` and ``config.json`` into
    ``directory`` (``write_hf_shards``); returns the files written."""
    groups = plan_shards({k: t.numel() * t.element_size() for k, t in tensors.items()}, max_shard_bytes)
    return write_hf_shards(directory, [lambda group=group: {k: tensors[k] for k in group} for group in groups], config)


def write_hf_shards(directory, shards: list[Callable[[], dict[str, torch.Tensor]]], config: dict) -> list[Path]:
    """Write each shard as its loader returns it, one in memory at a time (one ``model.safetensors`` when
    there is one, else numbered shards and the index), then ``config.json``; returns the files written.
    Each file goes to a temporary name first, config.json last, so a crash never leaves a directory that
    looks complete."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = [SINGLE_NAME] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    written, weight_map, total = [], {}, 0
    for load, fname in zip(shards, names):
        shard = load()
        tmp = directory / (fname + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        fsync_file(tmp)
        os.replace(tmp, directory / fname)
        written.append(directory / fname)
        weight_map.update({k: fname for k in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        del shard
    stale = directory / (SINGLE_NAME if len(shards) > 1 else INDEX_NAME)
    if stale.exists():
        stale.unlink()
    if len(shards) > 1:
        atomic_write_json(directory / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append(directory / INDEX_NAME)
    atomic_write_json(directory / CONFIG_NAME, config)
    written.append(directory / CONFIG_NAME)
    return written


def hf_config(model: GLMForCausalLM, tensors: dict[str, torch.Tensor]) -> dict:
    """config.json for ``model`` whose weights are ``tensors`` (their dtype is the config's ``dtype``)."""
    head = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    return config_with_dtype(model.config, None if head is None else head.dtype)


def config_with_dtype(config, dtype: torch.dtype | None) -> dict:
    """config.json of a ModelConfig whose weights are stored in ``dtype`` (None: not said)."""
    out = config.to_hf_dict()
    if dtype is not None:
        out["dtype"] = str(dtype).replace("torch.", "")
    return out


def read_hf_config(directory) -> dict:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {CONFIG_NAME}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def weight_files(directory) -> list[Path]:
    """The safetensors files of an HF directory: those its index names, or the single model.safetensors."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: unreadable index ({type(exc).__name__}: {exc})") from None
    elif (directory / SINGLE_NAME).is_file():
        files = [SINGLE_NAME]
    else:
        raise CheckpointError(f"{directory}: no {SINGLE_NAME} or {INDEX_NAME}")
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise CheckpointError(f"{directory}: weight files listed in the index are missing: {missing}")
    return [directory / f for f in files]


def load_hf_state(directory) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, routed experts stacked; a damaged file is named in the error."""
    state = {}
    for path in weight_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file, truncated or corrupted? ({exc})") from None
    return experts_from_hf(state)


# safetensors' dtype names (a file's header) as torch dtypes
_STORED = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class HFTensors:
    """The tensors of an HF directory read one at a time by orthon's names (a routed-expert stack
    assembled from its per-expert tensors when asked for): what a sharded model loads from without any
    process holding every tensor at once."""

    def __init__(self, directory):
        self.where: dict[str, Path] = {}
        for path in weight_files(directory):
            try:
                with safe_open(str(path), framework="pt") as f:
                    self.where.update((key, path) for key in f.keys())
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path}: unreadable safetensors file, truncated or corrupted? ({exc})") from None

    def read(self, name: str) -> torch.Tensor:
        """The tensor orthon names ``name``; CheckpointError when the directory lacks it."""
        if name in self.where:
            return self._get(name)
        m = _STACKED.match(name)
        if not m:
            raise CheckpointError(f"the weights lack {name}")
        prefix, kind = m.groups()
        experts = sorted(int(k[len(prefix) + 1:].split(".")[0]) for k in self.where
                         if k.startswith(prefix + ".") and k.endswith(".down_proj.weight"))
        if not experts or experts != list(range(len(experts))):
            raise CheckpointError(f"the weights lack the experts of {prefix} (found {experts[:8]})")
        if kind == "down_proj":
            return torch.stack([self._get(f"{prefix}.{e}.down_proj.weight") for e in experts])
        return torch.stack([torch.cat([self._get(f"{prefix}.{e}.gate_proj.weight"),
                                       self._get(f"{prefix}.{e}.up_proj.weight")]) for e in experts])

    def metas(self) -> dict[str, torch.Tensor]:
        """Every tensor as it is stored, on the meta device (shape and dtype from the files' headers: nothing
        read), under the directory's own names."""
        out = {}
        for path in sorted(set(self.where.values())):
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        if self.where[key] == path:
                            view = f.get_slice(key)
                            out[key] = torch.empty(view.get_shape(), dtype=_STORED[view.get_dtype()], device="meta")
            except (SafetensorError, OSError, KeyError) as exc:
                raise CheckpointError(f"{path}: unreadable header ({type(exc).__name__}: {exc})") from None
        return out

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"the weights lack {name}")
        try:
            with safe_open(str(self.where[name]), framework="pt") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{self.where[name]}: unreadable ({exc})") from None


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_state(model: GLMForCausalLM, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` the model takes, after checking that none is missing or mis-shaped.
    Extra layers past num_hidden_layers (GLM-5 ships a multi-token-prediction layer there) are dropped."""
    expected = _persistent_state(model)
    n_layers = model.config.num_hidden_layers
    extra = []
    for key in state:
        if key not in expected:
            m = _LAYER.match(key)
            if not (m and int(m.group(1)) >= n_layers):
                extra.append(key)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"missing tensors ({len(missing)}): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if extra:
        raise CheckpointError(f"unexpected tensors ({len(extra)}): {sorted(extra)[:8]}")
    for key, ref in expected.items():
        if tuple(state[key].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"tensor {key}: shape {tuple(state[key].shape)} does not match the config's {tuple(ref.shape)}"
            )
    return {k: state[k] for k in expected}
