"""`orthon export` / `orthon import`: move a model between an orthon weights directory
(recipe.yaml + model.safetensors) and the Hugging Face glm_moe_dsa layout."""
from __future__ import annotations

from orthon.pretrain.hf_io import from_hf, save_hf
from orthon.pretrain.weights_dir import load_weights_dir, save_weights_dir


def register(parser, name):
    if name == "export":
        parser.add_argument("weights_dir", help="orthon weights directory (recipe.yaml + model.safetensors)")
        parser.add_argument("--out", required=True, help="HF directory to write")
    else:
        parser.add_argument("hf_dir", help="HF glm_moe_dsa directory (config.json + safetensors)")
        parser.add_argument("--out", required=True, help="orthon weights directory to write")


def run(args, name):
    if name == "export":
        model = load_weights_dir(args.weights_dir)
        save_hf(model, args.out)
    else:
        model = from_hf(args.hf_dir)
        save_weights_dir(model, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out} ({n:,} parameters, hidden {model.config.hidden_size}, "
          f"{model.config.num_hidden_layers} layers)")
    return 0
