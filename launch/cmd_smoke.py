"""`orthon smoke -c configs/tiny.yaml`: build the recipe's model, train a few AdamW steps on random
tokens, print the loss. The smallest real thing the model does; `orthon pretrain` is the real run."""
from __future__ import annotations

import math
import time

import torch

from orthon.launch.args import add_recipe_args, check_model_fits, require_recipe
from orthon.pretrain.recipe import load_recipe
from orthon.pretrain.model import GLMForCausalLM


def register(parser, name):
    add_recipe_args(parser)


def run(args, name):
    require_recipe(args, name)
    recipe = load_recipe(args.config, args.overrides)
    check_model_fits(recipe.model, command="train")
    s = recipe.smoke
    torch.manual_seed(s.seed)
    model = GLMForCausalLM(recipe.model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters; ln(vocab) = {math.log(recipe.model.vocab_size):.3f}")
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)
    # A fixed batch of random tokens: the loss must fall as the model memorises it.
    ids = torch.randint(0, recipe.model.vocab_size, (s.batch_size, s.seq_len + 1))
    for step in range(s.steps):
        start = time.perf_counter()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.2f}s)")
    return 0
