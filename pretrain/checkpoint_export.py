"""A training checkpoint's model as a weights directory, one safetensors shard in memory at a time.

A run's ``final/`` is written at its end by gathering the whole model on one process, which a model of
GLM-5's size does not fit; and intermediate steps are wanted for evaluation. This reads the model's
tensors out of a DCP checkpoint (``RUN/checkpoints/step_N``: written by any number of ranks, FSDP
shards or not; DCP reads only the byte ranges each shard needs), converts them to the HF layout and
writes them shard by shard, so memory holds one shard (``max_shard_bytes``) at a time."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

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

    sizes = {n: stored[PREFIX + n].size.numel() * saved_dtype(n).itemsize for n in names}
    groups = hf_io.plan_shards(sizes, max_shard_bytes)  # whole source tensors: an expert stack stays in one shard
    head = hf_io.head_name(config)
    with writing_weights_dir(directory, runtime, tokenizer) as tmp:
        hf_io.write_hf_shards(tmp, [partial(_load_group, path, stored, group, dtype) for group in groups],
                              hf_io.config_with_dtype(config, saved_dtype(head)))
    return Path(directory)


def _load_group(path: Path, stored: dict, names: list[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    state = {PREFIX + n: torch.empty(stored[PREFIX + n].size, dtype=stored[PREFIX + n].properties.dtype) for n in names}
    dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    return hf_io.to_hf({n: state[PREFIX + n] for n in names}, dtype)
