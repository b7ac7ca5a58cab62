"""orthon's one model-weights format: the Hugging Face ``glm_moe_dsa`` layout plus a small sidecar.

A weights directory (every run's ``final/``, what ``orthon import`` / ``orthon export`` write, what RL,
generation and evaluation read) is what transformers' ``GlmMoeDsaForCausalLM.from_pretrained`` loads:

    config.json                         the HF config (ModelConfig's HF fields)
    model.safetensors                   or model-0000i-of-0000n.safetensors + model.safetensors.index.json
    orthon.json                         the sidecar: the model's RuntimeOptions (how it runs: sparse attention
                                        on or off, the sparse kernel, chunk sizes), which HF has no key for
    tokenizer.model | tokenizer.json    optional (``orthon export`` writes it): the model's tokenizer, a
                                        sentencepiece model or an HF tokenizer (+ its tokenizer_config.json)

transformers ignores the sidecar; a directory without it (a real HF checkpoint) loads with the
default RuntimeOptions. Resumable training state (optimizer, data position, RNG) is not here: that
is a DCP checkpoint (``orthon.pretrain.checkpoint``).

A save writes a complete directory beside the target (``NAME.tmp``) and swaps it in with renames, so
a crash never leaves a directory that mixes two saves or looks complete when it is not.

The format lives here rather than in ``hf_io`` because ``hf_io`` is the layout's codec (tensor names,
shards, config.json; nothing orthon-specific): the sidecar, the directory swap and the errors for the
old orthon layout are orthon's policy on top of it.
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

import orthon.pretrain.hf_io as hf_io
from orthon.core.config import build, read_yaml, to_dict
from orthon.core.errors import CheckpointError, ConfigError
from orthon.core.files import atomic_write_json
from orthon.core.interrupts import sigint_deferred
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.model import GLMForCausalLM
from orthon.pretrain.model_info import meta_model
from orthon.pretrain.parallel import fill_shard

SIDECAR = "orthon.json"
SIDECAR_FORMAT = "orthon-weights"
SIDECAR_VERSION = 1
# The layout orthon wrote before the HF layout became its format: no config.json.
OLD_LAYOUT = ("recipe.yaml", "model.safetensors")
# What a weights directory may hold; a save replaces the directory whole, so it refuses one holding
# anything else (it is not ours to delete).
SENTENCEPIECE_FILE, HF_TOKENIZER_FILES = "tokenizer.model", ("tokenizer.json", "tokenizer_config.json")
_OURS = {hf_io.CONFIG_NAME, hf_io.SINGLE_NAME, hf_io.INDEX_NAME, SIDECAR, "generation_config.json", "recipe.yaml",
         SENTENCEPIECE_FILE, *HF_TOKENIZER_FILES}


def _is_ours(name: str) -> bool:
    return name in _OURS or (name.startswith("model-") and name.endswith(".safetensors"))


def sidecar(runtime: RuntimeOptions) -> dict:
    """The sidecar's contents for a model that runs with ``runtime``."""
    return {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "runtime": to_dict(runtime)}


def read_sidecar(directory) -> dict:
    """The RuntimeOptions fields saved beside the weights; {} without a sidecar (an HF checkpoint)."""
    path = Path(directory) / SIDECAR
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise CheckpointError(f"{path}: not an orthon sidecar (no \"format\": \"{SIDECAR_FORMAT}\")")
    if data.get("version") != SIDECAR_VERSION:
        raise CheckpointError(f"{path}: sidecar version {data.get('version')!r}; this orthon reads version "
                              f"{SIDECAR_VERSION}")
    fields = data.get("runtime") or {}
    try:
        build(RuntimeOptions, fields, "runtime")
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return dict(fields)


def save_weights(model: GLMForCausalLM, directory, state: dict | None = None, *, dtype: torch.dtype | None = None,
                 max_shard_bytes: int = hf_io.DEFAULT_SHARD_BYTES, tokenizer=None) -> Path:
    """Write ``model`` (or ``state``, a full state dict of it, e.g. gathered from FSDP shards) as a weights
    directory: HF layout + sidecar. ``dtype`` casts the floating tensors (the routers' selection bias stays
    float32); ``max_shard_bytes`` sizes the safetensors shards; ``tokenizer`` (a sentencepiece model, or an
    HF tokenizer.json or its directory) is copied in. An existing weights directory is replaced whole; a
    directory holding other files is refused."""
    with writing_weights_dir(directory, model.runtime, tokenizer) as tmp:
        tensors = hf_io.hf_tensors(model, state, dtype)
        hf_io.write_hf(tmp, tensors, hf_io.hf_config(model, tensors), max_shard_bytes)
    return Path(os.path.abspath(directory))


@contextmanager
def writing_weights_dir(directory, runtime: RuntimeOptions, tokenizer=None):
    """A weights directory written whole: the body writes the HF layout into the yielded temporary
    directory beside ``directory``; then the sidecar of ``runtime`` and the tokenizer go in and it
    replaces ``directory`` by renames. A directory holding files other than model weights is refused."""
    directory = Path(os.path.abspath(directory))
    old = directory.with_name(directory.name + ".old")
    if not directory.exists() and old.is_dir():  # a save that died between its two renames: put it back
        os.replace(old, directory)
    if directory.exists():
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: exists and is not a directory")
        foreign = sorted(p.name for p in directory.iterdir() if not _is_ours(p.name))
        if foreign:
            raise CheckpointError(f"{directory}: holds files that are not model weights ({', '.join(foreign[:5])}); "
                                  f"save into an empty or new directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with sigint_deferred():  # a Ctrl-C lands after the swap, not inside safetensors' writer
        yield tmp
        atomic_write_json(tmp / SIDECAR, sidecar(runtime))
        if tokenizer is not None:
            _copy_tokenizer(Path(tokenizer), tmp)
        _swap_in(tmp, directory)


def _copy_tokenizer(source: Path, directory: Path) -> None:
    tokenizer_json, tokenizer_config = HF_TOKENIZER_FILES
    if source.is_dir():
        source = source / tokenizer_json
    if not source.is_file():
        raise CheckpointError(f"{source}: no such tokenizer")
    if source.suffix != ".json":
        shutil.copyfile(source, directory / SENTENCEPIECE_FILE)
        return
    shutil.copyfile(source, directory / tokenizer_json)
    if (source.parent / tokenizer_config).is_file():  # names the eos token
        shutil.copyfile(source.parent / tokenizer_config, directory / tokenizer_config)


def weights_tokenizer(directory) -> Path | None:
    """The tokenizer of a weights directory: a tokenizer.json or tokenizer.model in it (what ``orthon
    export`` writes, an HF checkpoint's), else the one the run that wrote it names (RUN/final's
    RUN/config.yaml, data.tokenizer) where that file exists; None when there is none."""
    directory = Path(directory)
    for name in (HF_TOKENIZER_FILES[0], SENTENCEPIECE_FILE):
        if (directory / name).is_file():
            return directory / name
    try:
        named = (read_yaml(directory.parent / "config.yaml").get("data") or {}).get("tokenizer")
    except (ConfigError, AttributeError):
        return None
    return Path(named) if named and Path(named).exists() else None


def _swap_in(tmp: Path, directory: Path) -> None:
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(directory.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_weights_dir(directory) -> Path:
    """``directory`` as a Path once it looks like a weights directory; a CheckpointError says what it is
    instead (missing, the old orthon layout, no config.json)."""
    directory = Path(directory)
    if not directory.is_dir():
        hint = ""
        for suffix in (".old", ".tmp"):
            if directory.with_name(directory.name + suffix).is_dir():
                hint = f" (a save was interrupted: {directory.name}{suffix} beside it holds a copy)"
                break
        raise CheckpointError(f"{directory}: no such weights directory{hint}")
    if not (directory / hf_io.CONFIG_NAME).is_file():
        if all((directory / name).is_file() for name in OLD_LAYOUT):
            raise CheckpointError(
                f"{directory}: the old orthon weights layout (recipe.yaml + model.safetensors, no config.json); "
                f"weights are now the Hugging Face layout (config.json + safetensors + {SIDECAR}). "
                f"Convert it with: orthon import {directory} --out {directory}")
        raise CheckpointError(f"{directory}: no {hf_io.CONFIG_NAME} (not a weights directory: expected the "
                              f"Hugging Face layout, config.json + safetensors)")
    return directory


def load_config(directory) -> ModelConfig:
    """The ModelConfig (the architecture) of a weights directory: its config.json."""
    directory = check_weights_dir(directory)
    try:
        config = ModelConfig.from_hf_dict(hf_io.read_hf_config(directory))
    except ConfigError as exc:
        raise ConfigError(f"{directory / hf_io.CONFIG_NAME}: {exc}") from None
    if config.indexer_types is not None and set(config.indexer_types) == {"full"}:
        # config.json always lists every layer; ModelConfig's canonical "all full" is None (what a
        # recipe that never mentions IndexShare holds), so a saved config compares equal to its recipe.
        config = config.replace(indexer_types=None)
    return config


def load_runtime(directory, **runtime_fields) -> RuntimeOptions:
    """How the saved model runs: the sidecar's RuntimeOptions (defaults without one), then ``runtime_fields``."""
    fields = {**read_sidecar(check_weights_dir(directory)), **runtime_fields}
    return build(RuntimeOptions, fields, "runtime")


def read_checked(directory, **runtime_fields) -> tuple[GLMForCausalLM, dict[str, torch.Tensor]]:
    """(the model of a weights directory on the meta device, its tensors checked against that model):
    what every backend's reader starts from."""
    model = meta_model(load_config(directory), load_runtime(directory, **runtime_fields))
    return model, hf_io.check_state(model, hf_io.load_hf_state(directory))


def load_weights(directory, device="cpu", dtype: torch.dtype | None = None, **runtime_fields) -> GLMForCausalLM:
    """The model of a weights directory (orthon's, or any HF ``glm_moe_dsa`` checkpoint).

    ``runtime_fields`` override the sidecar's RuntimeOptions (e.g. ``sparse_impl="gather"``); without a
    sidecar they take their defaults. The model is float32 (whatever the files hold) unless ``dtype``
    says otherwise. Missing, extra or mis-shaped tensors and damaged files raise CheckpointError naming
    what is wrong."""
    model, state = read_checked(directory, **runtime_fields)
    model.to_empty(device=device)
    if model.config.tie_word_embeddings:  # to_empty gives each module its own tensor: tie the head again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_state_dict(state, strict=False)  # non-persistent buffers are absent from checkpoints
    for router in model.moe_routers():
        router.expert_load.zero_()
    if dtype is not None:
        model.to(dtype)
    return model


def copy_weights(source, directory, *, dtype: torch.dtype | None = None,
                 max_shard_bytes: int = hf_io.DEFAULT_SHARD_BYTES, tokenizer=None, **runtime_fields) -> GLMForCausalLM:
    """Write the weights directory (or HF ``glm_moe_dsa`` checkpoint) ``source`` again as ``directory``, cast
    to ``dtype`` (None: each tensor as stored) and re-sharded, one safetensors shard in memory at a time:
    every tensor is checked against the config from the files' headers first (present, of its shape;
    layers past num_hidden_layers dropped), then read when its shard is written. ``runtime_fields``
    override the sidecar's options. Returns the model on the meta device (its config, its parameters)."""
    model = meta_model(load_config(source), load_runtime(source, **runtime_fields))
    tensors = hf_io.HFTensors(source)
    stored = hf_io.experts_to_hf(hf_io.check_state(model, hf_io.experts_from_hf(tensors.metas())))
    sizes = {name: t.numel() * hf_io.written_dtype(name, t.dtype, dtype).itemsize for name, t in stored.items()}
    head = hf_io.head_name(model.config)
    config = hf_io.config_with_dtype(model.config, hf_io.written_dtype(head, stored[head].dtype, dtype))

    def shard(names):
        return hf_io.to_hf({name: tensors.read(name) for name in names}, dtype)

    with writing_weights_dir(directory, model.runtime, tokenizer) as tmp:
        hf_io.write_hf_shards(tmp, [lambda names=names: shard(names)
                                    for names in hf_io.plan_shards(sizes, max_shard_bytes)], config)
    return model


@torch.no_grad()
def load_into(model: GLMForCausalLM, directory) -> None:
    """The weights of ``directory`` into ``model`` as built (on its device; FSDP2-sharded or not), one
    tensor at a time: a sharded model takes its shards without any process reading every tensor at once.
    A tensor missing or of another shape is a CheckpointError naming it."""
    tensors = hf_io.HFTensors(check_weights_dir(directory))
    state = model.state_dict(keep_vars=True)
    for name in hf_io.persistent_names(model):
        value = tensors.read(name)
        if tuple(value.shape) != tuple(state[name].shape):
            raise CheckpointError(f"{directory}: tensor {name} has shape {tuple(value.shape)}, the model "
                                  f"{tuple(state[name].shape)}")
        fill_shard(state[name], lambda t, value=value: t.copy_(value))
    for router in model.moe_routers():
        router.expert_load.zero_()


def parse_size(text: str) -> int:
    """Bytes of a size such as ``5GB``, ``500MB``, ``2GiB`` or ``1000000``."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    raw = str(text).strip().lower().replace("_", "")
    number = raw.rstrip("kmgtib")
    unit = raw[len(number):]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise CheckpointError(f"size {text!r}: expected a number with an optional unit (e.g. 5GB, 500MB)") from None
    if value <= 0:
        raise CheckpointError(f"size {text!r}: must be positive")
    return int(value)
