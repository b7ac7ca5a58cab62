"""The MindSpore backend's weights: the same directory format as the torch backend (HF glm_moe_dsa
layout + orthon.json), read and written through orthon.pretrain's codec. Tensors cross between the
two frameworks as NumPy arrays; the names are the torch model's, so no mapping is written here."""
from __future__ import annotations

import numpy as np
import torch

from orthon.backends.mindspore.model import GLMForCausalLM
from orthon.backends.mindspore.runtime import ms
from orthon.core.errors import CheckpointError
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.model import GLMForCausalLM as TorchModel
from orthon.pretrain.model_info import meta_model
from orthon.pretrain.weights import read_checked, save_weights


def state_arrays(cell: GLMForCausalLM) -> dict[str, np.ndarray]:
    """Every persistent tensor of the cell (parameters and the routers' selection bias) by its HF name."""
    return {p.name: p.asnumpy() for p in cell.get_parameters()}


def load_arrays(cell: GLMForCausalLM, arrays: dict[str, np.ndarray]) -> None:
    """Set every parameter from ``arrays`` (float32); missing, extra or mis-shaped names are errors."""
    params = {p.name: p for p in cell.get_parameters()}
    missing, extra = sorted(set(params) - set(arrays)), sorted(set(arrays) - set(params))
    if missing or extra:
        raise CheckpointError(f"mindspore backend: state does not fit the model (missing {missing[:6]}, "
                              f"unexpected {extra[:6]})")
    for name, param in params.items():
        value = np.asarray(arrays[name], np.float32)
        if value.shape != tuple(param.shape):
            raise CheckpointError(f"tensor {name}: shape {value.shape} does not match the model's {tuple(param.shape)}")
        param.set_data(ms.Tensor(np.ascontiguousarray(value)))


def build(config: ModelConfig, runtime: RuntimeOptions | None = None, state=None, seed: int | None = 0) -> GLMForCausalLM:
    """A cell for ``config`` holding ``state`` (a torch state dict or name -> array), or else the torch
    model's initialisation under ``seed`` (so both backends start a run from the same weights)."""
    cell = GLMForCausalLM(config, runtime)
    if state is None:
        if seed is not None:
            torch.manual_seed(seed)
        state = TorchModel(config, runtime=runtime).state_dict()
    if state and not isinstance(next(iter(state.values())), np.ndarray):  # a torch state dict, any float dtype
        state = {k: v.detach().to(torch.float32).cpu().numpy() for k, v in state.items()}
    if config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    load_arrays(cell, state)
    return cell


def from_hf(directory, **runtime_fields) -> GLMForCausalLM:
    """The MindSpore model of a weights directory (orthon's or any HF glm_moe_dsa checkpoint), float32.
    ``runtime_fields`` override the sidecar's RuntimeOptions, as for the torch backend's load_weights."""
    model, state = read_checked(directory, **runtime_fields)
    return build(model.config, model.runtime, state)


def save_hf(cell: GLMForCausalLM, directory, **save_kwargs):
    """Write the cell as a weights directory (config.json + safetensors + orthon.json), the torch
    backend's writer doing the work (``save_kwargs``: dtype, max_shard_bytes)."""
    state = {k: torch.from_numpy(v) for k, v in state_arrays(cell).items()}
    return save_weights(meta_model(cell.config, cell.runtime), directory, state, **save_kwargs)
