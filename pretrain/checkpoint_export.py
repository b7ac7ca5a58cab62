"""A training checkpoint's model as a weights directory, one safetensors shard in memory at a time.

A run's ``final/`` is written at its end by gathering the whole model on one process, which a model of
GLM-5's size does not fit; and intermediate steps are wanted for evaluation. This reads the model's
tensors out of a DCP checkpoint (``RUN/checkpoints/step_N``: written by any number of ranks, FSDP
shards or not; DCP reads only the byte ranges each shard needs), converts them to the HF layout and
writes them shard by shard, so memory holds one shard (``max_shard_bytes``) at a time: an expert stack larger
than that (a GLM-5 layer's is 25.8 GB in fp32) is read a few experts at a time."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import orthon.pretrain.hf_io as hf_io
from orthon.core.errors import CheckpointError
from orthon.pretrain.checkpoint import verify
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.model_info import meta_model
from orthon.pretrain.weights import writing_weights_dir

PREFIX = "model."  # the model's part of a checkpoint (orthon.pretrain.checkpoint saves {"model", "optim"})


def export_checkpoint(path, config: ModelConfig, runtime: RuntimeOptions, directory, *,
                      dtype: torch.dtype | None = None, max_shard_bytes: int = hf_io.DEFAULT_SHARD_BYTES,
                      tokenizer=None) -> Path:
    """Write the model of checkpoint ``path`` (of a model ``config`` describes) as the weights directory
    ``directory``, cast to ``dtype`` as ``orthon export`` casts. The checkpoint is verified first; one
    that lacks a tensor of the model or holds it in another shape is a CheckpointError naming it."""
    path = Path(path)
    verify(path)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model = meta_model(config, runtime)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    names = hf_io.persistent_names(model)
    missing = [n for n in names if PREFIX + n not in stored]
    if missing:
        raise CheckpointError(f"{path}: lacks {len(missing)} tensors of the model its run describes, e.g. {missing[:3]}")
    for name in names:
        if tuple(stored[PREFIX + name].size) != shapes[name]:
            raise CheckpointError(f"{path}: tensor {name} has shape {tuple(stored[PREFIX + name].size)}, the "
                                  f"model {shapes[name]}")

    def saved_dtype(name):
        return hf_io.written_dtype(name, stored[PREFIX + name].properties.dtype, dtype)

    sizes = {}
    for n in names:  # an expert stack larger than a shard is read a few experts at a time
        size = stored[PREFIX + n].size
        sizes.update(hf_io.expert_windows(n, size[0] if len(size) else 1, size.numel() * saved_dtype(n).itemsize,
                                          max_shard_bytes))
    groups = hf_io.plan_shards(sizes, max_shard_bytes)
    head = hf_io.head_name(config)
    with writing_weights_dir(directory, runtime, tokenizer) as tmp:
        hf_io.write_hf_shards(tmp, [partial(_load_group, path, stored, group, dtype) for group in groups],
                              hf_io.config_with_dtype(config, saved_dtype(head)))
    return Path(directory)


def _load_group(path: Path, stored: dict, items: list, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The tensors ``items`` (names, or (stack name, first, last) windows of experts) in the HF layout: one
    DCP read of just their bytes."""
    state, first_rows = {}, {}
    for item in items:
        name, first, last = item if isinstance(item, tuple) else (item, 0, None)
        meta = stored[PREFIX + name]
        assert PREFIX + name not in state, "two windows of one stack never fit one shard"
        shape = meta.size if last is None else (last - first, *meta.size[1:])
        state[PREFIX + name] = torch.empty(shape, dtype=meta.properties.dtype)
        first_rows[PREFIX + name] = first
    dcp.load(state, checkpoint_id=str(path), planner=_RowWindows(first_rows))
    out = {}
    for item in items:
        if isinstance(item, tuple):
            out.update(hf_io.stack_to_hf(item[0], state[PREFIX + item[0]], item[1]))
        else:
            out[item] = state[PREFIX + item]
    return hf_io.to_hf(out, dtype)


class _RowWindows(DefaultLoadPlanner):
    """DCP's reads of a flat state dict whose tensors may hold rows [first, first + len) of the checkpoint's
    (``first_rows``: fqn -> first): each read lands in its buffer at the offset within it."""

    def __init__(self, first_rows: dict[str, int]):
        super().__init__(allow_partial_load=True)
        self.first_rows = first_rows

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, buffer in self.state_dict.items():
            offsets = [0] * buffer.dim()
            if offsets:
                offsets[0] = self.first_rows.get(fqn, 0)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=buffer.shape)
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]  # the buffer itself: its chunk's offsets are not the tensor's
