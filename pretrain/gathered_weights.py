"""A weights directory written from the ranks' shards, one safetensors shard gathered at a time.

Where no rank holds the whole model (FSDP2, expert parallelism), gathering the full state dict on rank 0
puts the whole model in one process's memory, which GLM-5 (about 3 TB in fp32) does not fit. Here every
rank walks the model's tensors in the same order, a safetensors shard's worth at a time
(``max_shard_bytes`` of what is written): each sharded tensor (a DTensor) is all-gathered, every rank
taking part, rank 0 keeps a CPU copy, and the shard is written before the next one is gathered. Rank 0
holds one shard; the other ranks one tensor at a time. The directory is the one ``save_weights`` writes
(the HF layout and the sidecar, swapped in whole), as ``orthon export --step`` writes it from a DCP
checkpoint. RL's weight sync streams the same parts to the engines (``gathered_parts``,
orthon.rl.weight_sync).
"""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import orthon.pretrain.hf_io as hf_io
from orthon.pretrain.model import GLMForCausalLM
from orthon.pretrain.weights import writing_weights_dir


def gathered_parts(model: GLMForCausalLM, rank: int, part_bytes: int, dtype: torch.dtype | None = None) -> list:
    """The model's persistent tensors in parts of about ``part_bytes`` (as written in ``dtype``; a larger
    tensor alone), as loaders: calling the i-th, on every rank in the same order (each all-gathers its
    sharded tensors), returns on rank 0 its {name: whole CPU tensor} in the model's names, elsewhere None."""
    live = model.state_dict()  # FSDP2's and expert parallelism's parameters as DTensors: no communication
    names = hf_io.persistent_names(model)
    sizes = {name: live[name].numel() * hf_io.written_dtype(name, live[name].dtype, dtype).itemsize for name in names}
    # Whole source tensors: an expert stack stays in one part.
    return [partial(_gather, live, group, rank == 0) for group in hf_io.plan_shards(sizes, part_bytes)]


def drain_on_error(loaders: list, consume) -> None:
    """``consume(loaders)`` on rank 0, which calls them in order; when it fails, the loaders it did not
    reach are still called (the other ranks wait in their gathers), then the error is raised."""
    started = []

    def counted(load):
        started.append(load)
        return load()

    try:
        consume([partial(counted, load) for load in loaders])
    except BaseException:
        for load in loaders[len(started):]:
            load()
        raise


def save_gathered(model: GLMForCausalLM, directory, rank: int, *, dtype: torch.dtype | None = None,
                  max_shard_bytes: int = hf_io.DEFAULT_SHARD_BYTES, tokenizer=None) -> Path | None:
    """Write ``model`` (its parameters DTensors or plain, the same on every rank) as the weights directory
    ``directory``. A collective: every rank calls it; rank 0 writes and returns the path, the others
    return None. When rank 0's writing fails (a full disk, a foreign directory), rank 0 still takes part
    in the gathers left, so no rank waits in a collective, then raises."""
    loaders = gathered_parts(model, rank, max_shard_bytes, dtype)
    if rank != 0:
        for load in loaders:
            load()
        return None
    head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    head_dtype = hf_io.written_dtype(head, model.get_parameter(head).dtype, dtype)

    def write(parts):
        with writing_weights_dir(directory, model.runtime, tokenizer) as tmp:
            hf_io.write_hf_shards(tmp, [lambda load=load: hf_io.to_hf(load(), dtype) for load in parts],
                                  hf_io.config_with_dtype(model.config, head_dtype))

    drain_on_error(loaders, write)
    return Path(os.path.abspath(directory))


def _gather(live: dict, names: list[str], keep: bool) -> dict[str, torch.Tensor] | None:
    """The tensors ``names`` whole (a DTensor's all-gather is collective), CPU copies on the rank that
    ``keep``s them; None elsewhere."""
    out = {}
    for name in names:
        tensor = live[name].detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if keep:
            out[name] = tensor.cpu()
    return out if keep else None
