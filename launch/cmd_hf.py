"""`orthon export` / `orthon import`.

A weights directory (a run's final/) is already the Hugging Face glm_moe_dsa layout (config.json +
safetensors) plus orthon's sidecar (orthon.json), so neither command converts between formats:

    orthon export SRC --out DIR [--dtype bfloat16] [--max-shard-size 5GB] [--tokenizer PATH] [--step N|latest]
        a fresh copy of a run's model (SRC: a run directory, its final/ is used, or a weights
        directory), cast and re-sharded for publishing, with its tokenizer (the run's, the weights
        directory's own, or --tokenizer), one safetensors shard in memory at a time; transformers loads
        DIR as it loads SRC, and `orthon generate DIR` samples from it. --step: the model of the run's
        checkpoint of that step instead (its newest that verifies with ``latest``), read one shard at a
        time (orthon.pretrain.checkpoint_export): an intermediate step, or a model too large for final/.
    orthon import SRC --out DIR [--set sparse_impl=gather ...] [--tokenizer PATH]
        check an HF glm_moe_dsa directory (config orthon supports, every tensor present with its
        shape, from the files' headers) and write it as an orthon weights directory, a shard at a time,
        the sidecar holding orthon's own model fields (defaults, or --set), with SRC's tokenizer if it
        has one. SRC may
        also be a weights directory in the old orthon layout (recipe.yaml + model.safetensors), which
        this converts (in place when DIR = SRC).
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from orthon.core import config as config_io
from orthon.core.errors import CheckpointError, ConfigError
from orthon.pretrain.config import ModelConfig, RuntimeOptions

RUNTIME_FIELDS = sorted(f.name for f in fields(RuntimeOptions))

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register(parser, name):
    parser.add_argument("--tokenizer", help="a tokenizer to include (sentencepiece .model, or HF tokenizer.json "
                                            "or its directory); default: SRC's own")
    if name == "export":
        parser.add_argument("source", metavar="SRC", help="run directory (its final/) or weights directory")
        parser.add_argument("--out", required=True, help="directory to write (new, or a weights directory to replace)")
        parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating tensors (default: as saved)")
        parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
        parser.add_argument("--step", help="export the run's checkpoint of this step (or 'latest': its newest that "
                                           "verifies) instead of its final/")
    else:
        parser.add_argument("source", metavar="SRC",
                            help="HF glm_moe_dsa directory (config.json + safetensors), or an old-layout orthon weights dir")
        parser.add_argument("--out", required=True, help="weights directory to write")
        parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                            help=f"a runtime option for the sidecar ({', '.join(RUNTIME_FIELDS)})")


def _runtime_fields(items: list[str]) -> dict:
    mapping = config_io.apply_overrides({}, [i.removeprefix("runtime.") for i in items])
    unknown = sorted(set(mapping) - set(RUNTIME_FIELDS))
    if unknown:
        raise ConfigError(f"--set {unknown[0]}: not a runtime option (those are {RUNTIME_FIELDS}; "
                          f"the model's fields come from config.json)")
    built = config_io.build(RuntimeOptions, mapping, "runtime")  # types and ranges checked as in a recipe
    return {k: getattr(built, k) for k in mapping}


def _load_old_layout(directory: Path, fields: dict):
    """A model from orthon's former weights layout: recipe.yaml (the model section) + model.safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from orthon.pretrain.hf_io import check_state
    from orthon.pretrain.model import GLMForCausalLM

    recipe = config_io.read_yaml(directory / "recipe.yaml")
    section = dict(recipe.get("model") or {})
    # The old layout kept the runtime options in the model section.
    runtime = {**{k: section.pop(k) for k in list(section) if k in RUNTIME_FIELDS}, **(recipe.get("runtime") or {}),
               **fields}
    config = config_io.build(ModelConfig, section, "model")
    model = GLMForCausalLM(config, init=False, runtime=config_io.build(RuntimeOptions, runtime, "runtime"))
    try:
        tensors = load_file(str(directory / "model.safetensors"))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{directory / 'model.safetensors'}: unreadable safetensors file ({exc})") from None
    model.load_state_dict(check_state(model, tensors), strict=False)
    return model


def run(args, name):
    from orthon.pretrain.weights import copy_weights, parse_size, save_weights, weights_tokenizer

    source = Path(args.source)
    if name == "export" and args.step:
        return _export_step(source, args)
    if name == "export":  # one safetensors shard in memory at a time (copy_weights), as for --step
        weights = source / "final" if (source / "final").is_dir() and not (source / "config.json").is_file() else source
        tokenizer = args.tokenizer or weights_tokenizer(weights)
        model = copy_weights(weights, args.out, dtype=DTYPES[args.dtype] if args.dtype else None,
                             max_shard_bytes=parse_size(args.max_shard_size), tokenizer=tokenizer)
    else:
        from orthon.pretrain.hf_io import read_hf_config

        fields = _runtime_fields(args.set)
        tokenizer = args.tokenizer or weights_tokenizer(source)  # copied before DIR = SRC is replaced
        if not (source / "config.json").is_file() and (source / "recipe.yaml").is_file():
            model = _load_old_layout(source, fields)
            save_weights(model, args.out, tokenizer=tokenizer)
        else:
            hf = read_hf_config(source)
            model = copy_weights(source, args.out, dtype=DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype"))),
                                 tokenizer=tokenizer, **fields)  # the checkpoint's own dtype
    n = sum(p.numel() for p in model.parameters())
    with_tokenizer = f", tokenizer {Path(tokenizer).name}" if tokenizer else "; no tokenizer (pass --tokenizer)"
    print(f"wrote {args.out} ({n:,} parameters, hidden {model.config.hidden_size}, "
          f"{model.config.num_hidden_layers} layers; HF layout + orthon.json{with_tokenizer})")
    return 0


def _export_step(run: Path, args) -> int:
    """`orthon export RUN --step N|latest --out DIR`: a checkpoint's model, shard by shard."""
    from orthon.pretrain.checkpoint import Checkpointer
    from orthon.pretrain.checkpoint_export import export_checkpoint
    from orthon.pretrain.weights import parse_size, weights_tokenizer

    checkpointer = Checkpointer(run, log=print)
    if not checkpointer.step_dirs():
        raise CheckpointError(f"{run}: no checkpoints (--step exports a run directory's RUN/checkpoints/step_N)")
    if args.step == "latest":
        path = checkpointer.latest_good()
        if path is None:
            raise CheckpointError(f"{run}: no checkpoint verifies")
    else:
        try:
            step = int(args.step)
        except ValueError:
            raise ConfigError(f"--step: a step number or 'latest', got {args.step!r}") from None
        path = checkpointer.of_step(step)
    config, runtime, tokenizer = _run_model(run)
    tokenizer = args.tokenizer or tokenizer
    dtype = DTYPES[args.dtype] if args.dtype else None
    if "layout" in Checkpointer.trainer_state(path):  # the megatron backend's: a part of the model at a time
        from orthon.backends.megatron.checkpoint_export import export_megatron_checkpoint

        export_megatron_checkpoint(path, config, runtime, args.out, dtype=dtype, tokenizer=tokenizer)
    else:
        export_checkpoint(path, config, runtime, args.out, dtype=dtype, max_shard_bytes=parse_size(args.max_shard_size),
                          tokenizer=tokenizer)
    with_tokenizer = f", tokenizer {Path(tokenizer).name}" if tokenizer else "; no tokenizer (pass --tokenizer)"
    print(f"wrote {args.out} from {path} (hidden {config.hidden_size}, {config.num_hidden_layers} layers; "
          f"HF layout + orthon.json{with_tokenizer})")
    return 0


def _run_model(run: Path):
    """(ModelConfig, RuntimeOptions, tokenizer or None) of a run: its recipe (config.yaml), else the
    weights directory it ended with (final/), for runs whose config.yaml is not a pretraining recipe."""
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.weights import load_config, load_runtime, weights_tokenizer

    try:
        recipe = load_recipe(run / "config.yaml")
    except (ConfigError, OSError) as exc:
        if (run / "final").is_dir():
            return load_config(run / "final"), load_runtime(run / "final"), weights_tokenizer(run / "final")
        raise CheckpointError(f"{run}: its config.yaml does not describe the model ({exc}) and it has no final/") from None
    tokenizer = recipe.data.tokenizer if recipe.data.tokenizer and Path(recipe.data.tokenizer).exists() else None
    return recipe.model, recipe.runtime, tokenizer
