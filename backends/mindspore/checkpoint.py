"""Resumable checkpoints of a MindSpore run: ``checkpoints/step_N/`` holding the weights (the weights
directory format), the optimizer state (``optimizer.npz``) and the trainer's position
(``trainer.json``: step, tokens, data position). Written under a temporary name and renamed, so a
directory named step_N is complete; the last ``keep_last`` are kept."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from orthon.backends.mindspore.weights import from_hf, load_arrays, save_hf, state_arrays
from orthon.core.errors import CheckpointError
from orthon.core.files import atomic_write_json

TRAINER_STATE = "trainer.json"


def _flatten(state: dict) -> dict[str, np.ndarray]:
    arrays = {}
    for part in ("momentum", "exp_avg", "exp_avg_sq"):
        arrays.update({f"{part}/{name}": value for name, value in state[part].items()})
    return arrays


def _unflatten(arrays, steps: dict, tokens: int) -> dict:
    state = {"momentum": {}, "exp_avg": {}, "exp_avg_sq": {}, "steps": steps, "tokens_consumed": tokens}
    for key in arrays.files:
        part, name = key.split("/", 1)
        state[part][name] = arrays[key]
    return state


class MindSporeCheckpointer:
    def __init__(self, run_dir, keep_last: int = 3, log=print):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last, self.log = keep_last, log

    def step_dirs(self) -> list[Path]:
        found = [p for p in self.root.glob("step_*") if p.is_dir() and p.name.split("_")[1].isdigit()]
        return sorted(found, key=lambda p: int(p.name.split("_")[1]))

    def has(self, step: int) -> bool:
        return (self.root / f"step_{step}" / TRAINER_STATE).is_file()

    def save(self, step: int, cell, optimizer, trainer_state: dict) -> Path:
        final = self.root / f"step_{step}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf(cell, tmp / "weights")
        opt = optimizer.state_dict()
        np.savez(tmp / "optimizer.npz", **_flatten(opt))
        atomic_write_json(tmp / TRAINER_STATE, {**trainer_state, "optimizer_steps": opt["steps"],
                                                "tokens_consumed": opt["tokens_consumed"]})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self.step_dirs()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest(self) -> Path | None:
        done = [p for p in self.step_dirs() if (p / TRAINER_STATE).is_file()]
        return done[-1] if done else None

    def load(self, path: Path, cell, optimizer) -> dict:
        """Restore the cell and the optimizer from ``path``; returns the trainer state."""
        try:
            state = json.loads((path / TRAINER_STATE).read_text())
            load_arrays(cell, state_arrays(from_hf(path / "weights")))
            with np.load(path / "optimizer.npz") as arrays:
                optimizer.load_state_dict(_unflatten(arrays, state["optimizer_steps"], state["tokens_consumed"]))
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{path}: not a readable MindSpore checkpoint ({type(exc).__name__}: {exc})") from None
        return state

