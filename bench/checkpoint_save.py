"""How long a checkpoint stops training: foreground saves against background ones (`train.async_checkpoint`).

The tiny recipe's model (configs/tiny.yaml) with its Muon + Split / AdamW optimizer trains on random
tokens, a checkpoint every ``--every`` steps, through orthon's Checkpointer (DCP, checksums, atomic
rename), once writing each checkpoint before the next step and once in the background. Reported: the
time the loop is held per checkpoint (foreground: the whole save; background: copying the state, plus
any wait for the previous save still being written), and the whole loop's wall time. The two runs
alternate, ``--rounds`` times each. On a GPU the copy is a device-to-host transfer and the writing
thread competes with nothing; on these 2-core CPUs it competes with training for the cores, so the
loop's wall time gains less than the time held.

    python bench/checkpoint_save.py [--steps 12] [--every 3] [--rounds 3] [--batch 4x256]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_kind, report  # noqa: E402

from orthon.optim import build_for_model  # noqa: E402
from orthon.pretrain.checkpoint import Checkpointer  # noqa: E402
from orthon.pretrain.model import GLMForCausalLM  # noqa: E402
from orthon.pretrain.recipe import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(recipe, ids, steps: int, every: int, background: bool, where: Path) -> tuple[list[float], float, int]:
    """(seconds the loop was held by each checkpoint, the loop's wall seconds, a checkpoint's bytes)."""
    torch.manual_seed(0)
    model = GLMForCausalLM(recipe.model, runtime=recipe.runtime)
    optimizer = build_for_model(model, recipe.optim, recipe.schedule)
    ckpt = Checkpointer(where, keep_last=2, log=lambda *_: None)
    held = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        loss = model(ids[:, :-1], labels=ids[:, 1:], return_logits=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % every == 0:
            t = time.perf_counter()
            ckpt.save(step, model, optimizer.optimizers, {"step": step}, background=background)
            held.append(time.perf_counter() - t)
    t = time.perf_counter()
    ckpt.wait()  # the run's end completes the last one
    held[-1] += time.perf_counter() - t
    wall = time.perf_counter() - start
    size = sum(f.stat().st_size for f in ckpt.step_dirs()[-1].iterdir())
    shutil.rmtree(where)
    return held, wall, size


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", default="4x256")
    args = parser.parse_args()
    print(f"CPU: {cpu_kind()}; {torch.get_num_threads()} threads")
    recipe = load_recipe(ROOT / "configs/tiny.yaml", [])
    b, t = (int(v) for v in args.batch.split("x"))
    ids = torch.randint(0, recipe.model.vocab_size, (b, t + 1))
    params = sum(p.numel() for p in GLMForCausalLM(recipe.model, runtime=recipe.runtime).parameters())
    print(f"tiny model {params / 1e6:.2f}M parameters; {args.steps} steps of {b} x {t}, a checkpoint every "
          f"{args.every}; {args.rounds} rounds")
    held = {"foreground": [], "background": []}
    walls = {"foreground": [], "background": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in (("foreground", "background") if r % 2 == 0 else ("background", "foreground")):
                h, w, size = run(recipe, ids, args.steps, args.every, mode == "background", Path(tmp) / mode)
                held[mode] += h[1:]  # the first save of a run also pays one-time setup
                walls[mode].append(w)
    print(f"a checkpoint: {size / 1e6:.1f} MB (weights and optimizer state)")
    print(f"{'':<12}{'held per checkpoint (median)':>30}{'loop wall (median)':>22}")
    for mode in held:
        print(f"{mode:<12}{statistics.median(held[mode]) * 1e3:>27.1f} ms{statistics.median(walls[mode]):>20.2f} s")
    ratio_held = statistics.median(held["background"]) / statistics.median(held["foreground"])
    ratio_wall = statistics.median(walls["background"]) / statistics.median(walls["foreground"])
    print(f"background / foreground: held {ratio_held:.2f}, loop wall {ratio_wall:.2f}")
    report("checkpoint_save",
           {f"{m}_held_ms": statistics.median(held[m]) * 1e3 for m in held}
           | {f"{m}_wall_s": statistics.median(walls[m]) for m in walls},
           {"held_background_vs_foreground": ratio_held, "wall_background_vs_foreground": ratio_wall})


if __name__ == "__main__":
    main()
