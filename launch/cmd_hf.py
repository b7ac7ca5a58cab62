"""`orthon export` / `orthon import`: move weights between an orthon checkpoint file and the HF
glm_moe_dsa directory layout."""
from __future__ import annotations

from pathlib import Path

import torch

from orthon.launch.recipe import add_recipe_args, load_recipe
from orthon.pretrain.hf_io import check_state, from_hf, save_hf
from orthon.pretrain.model import GLMForCausalLM


def register(parser, name):
    if name == "export":
        parser.add_argument("--weights", required=True, help="orthon weights: a .safetensors / .pt state dict")
        parser.add_argument("--out", required=True, help="HF directory to write")
        add_recipe_args(parser)
    else:
        parser.add_argument("hf_dir", help="HF glm_moe_dsa directory (config.json + safetensors)")
        parser.add_argument("--out", required=True, help="orthon weights file to write (.safetensors)")


def _load_state(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("model", state)


def run(args, name):
    if name == "export":
        recipe = load_recipe(args.config, args.overrides)
        model = GLMForCausalLM(recipe.model, init=False)
        model.load_state_dict(check_state(model, _load_state(Path(args.weights))), strict=False)
        save_hf(model, args.out)
        print(f"wrote {args.out} (glm_moe_dsa, {sum(p.numel() for p in model.parameters()):,} parameters)")
    else:
        from safetensors.torch import save_file

        model = from_hf(args.hf_dir)
        out = Path(args.out)
        tmp = out.with_name(out.name + ".tmp")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
        tmp.replace(out)
        print(f"wrote {out}; its model section: {model.config.to_hf_dict()['architectures'][0]} "
              f"hidden {model.config.hidden_size}, {model.config.num_hidden_layers} layers")
    return 0
