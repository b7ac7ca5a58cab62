"""orthon's own weights directory: recipe.yaml (the resolved model section) + model.safetensors.

This is what `orthon import` writes and `orthon export` reads; run directories hold one per saved
model, so every run's weights move to the HF layout with one command.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import yaml
from safetensors.torch import load_file, save_file

from orthon.core import config as config_io
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.hf_io import check_state
from orthon.pretrain.model import GLMForCausalLM

RECIPE = "recipe.yaml"
WEIGHTS = "model.safetensors"


def save_weights_dir(model: GLMForCausalLM, directory, state: dict | None = None) -> None:
    """Write the model's weights (or ``state``, a full state dict of it, e.g. gathered from FSDP shards)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in (state or model.state_dict()).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp = directory / (WEIGHTS + ".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, directory / WEIGHTS)
    tmp = directory / (RECIPE + ".tmp")
    tmp.write_text(yaml.safe_dump({"model": asdict(model.config), "runtime": asdict(model.runtime)}, sort_keys=False))
    os.replace(tmp, directory / RECIPE)


def load_weights_dir(directory, device="cpu") -> GLMForCausalLM:
    directory = Path(directory)
    for name in (RECIPE, WEIGHTS):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory}: no {name} (expected an orthon weights directory)")
    recipe = config_io.read_yaml(directory / RECIPE)
    config = config_io.build(ModelConfig, recipe.get("model", {}), "model")
    runtime = config_io.build(RuntimeOptions, recipe.get("runtime", {}), "runtime")
    model = GLMForCausalLM(config, init=False, runtime=runtime).to(device)
    model.load_state_dict(check_state(model, load_file(str(directory / WEIGHTS))), strict=False)
    return model
