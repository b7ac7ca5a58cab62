"""`orthon export` / `orthon import`.

A weights directory (a run's final/) is already the Hugging Face glm_moe_dsa layout (config.json +
safetensors) plus orthon's sidecar (orthon.json), so neither command converts between formats:

    orthon export SRC --out DIR [--dtype bfloat16] [--max-shard-size 5GB] [--tokenizer PATH]
        a fresh copy of a run's model (SRC: a run directory, its final/ is used, or a weights
        directory), cast and re-sharded for publishing, with its tokenizer (the run's, the weights
        directory's own, or --tokenizer); transformers loads DIR as it loads SRC, and
        `orthon generate DIR` samples from it.
    orthon import SRC --out DIR [--set sparse_impl=gather ...] [--tokenizer PATH]
        check an HF glm_moe_dsa directory (config orthon supports, every tensor present with its
        shape, files readable) and write it as an orthon weights directory, the sidecar holding
        orthon's own model fields (defaults, or --set), with SRC's tokenizer if it has one. SRC may
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
    from orthon.pretrain.weights import load_weights, parse_size, save_weights, weights_tokenizer

    source = Path(args.source)
    if name == "export":
        weights = source / "final" if (source / "final").is_dir() and not (source / "config.json").is_file() else source
        model = load_weights(weights)
        tokenizer = args.tokenizer or weights_tokenizer(weights)
        save_weights(model, args.out, dtype=DTYPES[args.dtype] if args.dtype else None,
                     max_shard_bytes=parse_size(args.max_shard_size), tokenizer=tokenizer)
    else:
        from orthon.pretrain.hf_io import read_hf_config

        fields = _runtime_fields(args.set)
        if not (source / "config.json").is_file() and (source / "recipe.yaml").is_file():
            model, dtype = _load_old_layout(source, fields), None
        else:
            model = load_weights(source, **fields)
            dtype = DTYPES.get(str(read_hf_config(source).get("dtype") or read_hf_config(source).get("torch_dtype")))
        tokenizer = args.tokenizer or weights_tokenizer(source)  # copied before DIR = SRC is replaced
        save_weights(model, args.out, dtype=dtype, tokenizer=tokenizer)  # the checkpoint's own dtype
    n = sum(p.numel() for p in model.parameters())
    with_tokenizer = f", tokenizer {Path(tokenizer).name}" if tokenizer else "; no tokenizer (pass --tokenizer)"
    print(f"wrote {args.out} ({n:,} parameters, hidden {model.config.hidden_size}, "
          f"{model.config.num_hidden_layers} layers; HF layout + orthon.json{with_tokenizer})")
    return 0
