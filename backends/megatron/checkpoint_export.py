"""A megatron-backend training checkpoint's model as an orthon weights directory (``orthon export RUN --step
N``), read on one process, whatever layout wrote it, one part of the model at a time.

The checkpoint holds each rank's piece under a name of its own (``MegatronCausalLM.checkpoint_names``): a
pipeline stage's layers by their number in the model, an expert by its index in the model, a tensor split
over tensor parallelism as ``name@tp0``, ``name@tp1``, ...; the DSA indexer megatron's model lacks as
``carried.<name>`` (``carried.t<i>`` in one-stage runs: the i-th of their sorted names). So one process
reads a part's pieces (the embedding, a decoder layer, or the final norm with the head: DCP reads just
their bytes), joins the tensor-parallel ones (``parallel.join``), converts them to orthon's names and
writes them as one safetensors file before the next. A checkpoint so exported also starts a run at
another layout (``train.init_from``)."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from orthon.backends.megatron.convert import megatron_shapes, megatron_to_orthon, model_parts
from orthon.backends.megatron.gathered_weights import part_index
from orthon.backends.megatron.model import layout as megatron_layout
from orthon.backends.megatron.parallel import join, split_rule
from orthon.core.errors import CheckpointError
from orthon.pretrain import hf_io
from orthon.pretrain.checkpoint import Checkpointer, verify
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.weights import writing_weights_dir

PREFIX = "model."  # the model's part of a checkpoint (orthon.pretrain.checkpoint saves {"model", "optim"})


def stored_keys(name: str, stored, carried: list[str], prefix: str = PREFIX, suffix: str = "") -> list[str]:
    """The checkpoint keys holding megatron's tensor ``name`` (``prefix``: the model's, or the optimizer
    state's ``optim.state.`` with ``suffix`` its entry, ``.exp_avg``): itself, its tensor-parallel pieces in
    rank order, or its carried copy (``carried``: the carried tensors' names, sorted, as a one-stage run
    numbers them)."""
    key = f"{prefix}gpt.{name}"
    if key + suffix in stored:
        return [key + suffix]
    pieces = []
    while f"{key}@tp{len(pieces)}{suffix}" in stored:
        pieces.append(f"{key}@tp{len(pieces)}{suffix}")
    if pieces:
        return pieces
    for key in (f"{prefix}carried.{name}", f"{prefix}carried.t{carried.index(name)}" if name in carried else None):
        if key is not None and key + suffix in stored:
            return [key + suffix]
    raise CheckpointError(f"the checkpoint lacks {name}{suffix} (keys {prefix}gpt.{name}[@tp<r>]{suffix} or "
                          f"{prefix}carried.*{suffix})")


def carried_names(stored, names) -> list[str]:
    """Which of megatron's tensors ``names`` a checkpoint (``stored``: its metadata) holds beside megatron's
    model (the DSA indexer), sorted as a one-stage run numbers them."""
    return sorted(n for n in names if f"{PREFIX}gpt.{n}" not in stored and f"{PREFIX}gpt.{n}@tp0" not in stored)


def export_megatron_checkpoint(path, config: ModelConfig, runtime: RuntimeOptions, directory, *,
                               dtype: torch.dtype | None = None, tokenizer=None) -> Path:
    """Write the model of the megatron-backend checkpoint ``path`` (of a model ``config`` describes) as the
    weights directory ``directory``, cast to ``dtype``. Verified first; a tensor it lacks is a
    CheckpointError naming it."""
    path = Path(path)
    verify(path)
    saved = Checkpointer.trainer_state(path).get("layout")
    if saved is None:
        raise CheckpointError(f"{path}: not a checkpoint of the megatron backend (no layout in its trainer state)")
    layout = megatron_layout(te=saved.get("transformer_engine") == "on")  # as the model was built
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    names = list(megatron_shapes(config, runtime, layout))
    carried = carried_names(stored, names)
    parts = model_parts(config, layout)
    by_part: list[list[str]] = [[] for _ in parts]
    for name in names:
        by_part[part_index(name, config.num_hidden_layers)].append(name)

    def load(index: int) -> dict[str, torch.Tensor]:
        keys = {name: stored_keys(name, stored, carried) for name in by_part[index]}
        state = {key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype)
                 for pieces in keys.values() for key in pieces}
        dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
        joined = {name: join([state[k] for k in pieces], split_rule(name, layout), name) for name, pieces in keys.items()}
        return hf_io.to_hf(megatron_to_orthon(joined, config, layout, maps=parts[index]), dtype)

    head = "embedding.word_embeddings.weight" if config.tie_word_embeddings else "output_layer.weight"
    head_dtype = hf_io.written_dtype(hf_io.head_name(config), stored[stored_keys(head, stored, carried)[0]].properties.dtype,
                                     dtype)
    with writing_weights_dir(directory, runtime, tokenizer) as tmp:
        hf_io.write_hf_shards(tmp, [partial(load, index) for index in range(len(parts))],
                              hf_io.config_with_dtype(config, head_dtype))
    return Path(directory)
