"""`orthon smoke -c configs/tiny.yaml`: build the recipe's model, train a few steps of the one Trainer
(the recipe's optimizer at ``smoke.lr``) on a fixed batch of random tokens, print the loss. The smallest
real thing the model does; `orthon pretrain` is the real run. ``backend=mindspore`` runs the same steps
on the MindSpore backend's trainer."""
from __future__ import annotations

import math
import tempfile
from dataclasses import replace

from orthon.launch.args import add_recipe_args, check_model_fits, require_recipe
from orthon.pretrain.recipe import load_recipe


def register(parser, name):
    add_recipe_args(parser)


def run(args, name):
    import torch

    from orthon.data.loader import Batch
    from orthon.launch.cmd_pretrain import make_trainer
    from orthon.optim.config import ScheduleConfig
    from orthon.pretrain.model_info import parameter_counts

    require_recipe(args, name)
    recipe = load_recipe(args.config, args.overrides)
    check_model_fits(recipe.model, command="train")
    s = recipe.smoke
    recipe = replace(recipe, schedule=ScheduleConfig(peak_lr=s.lr, floor_lr=s.lr, warmup_tokens=0, total_tokens=1,
                                                     total_steps=s.steps),
                     train=replace(recipe.train, seed=s.seed, micro_batch_size=s.batch_size, progress=False))
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = make_trainer(recipe, run_dir, with_data=False)
        n_params = sum(c["total"] for c in parameter_counts(recipe.model).values())
        print(f"model: {n_params / 1e6:.2f}M parameters, {recipe.backend} backend; "
              f"ln(vocab) = {math.log(recipe.model.vocab_size):.3f}")
        # A fixed batch of random tokens: the loss must fall as the model memorises it.
        ids = torch.randint(0, recipe.model.vocab_size, (s.batch_size, s.seq_len + 1))
        zeros = torch.zeros(s.batch_size, dtype=torch.long)
        batch = Batch(ids[:, :-1], ids[:, 1:], torch.zeros_like(ids[:, :-1]), zeros, zeros)
        for step in range(s.steps):
            metrics = trainer.train_step(batch, tokens=batch.input_ids.numel())
            print(f"step {step}: loss {metrics['loss']:.4f} ({metrics['step_time_s']:.2f}s)")
    return 0
