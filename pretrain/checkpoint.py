"""Checkpoints: model + optimizer through torch.distributed.checkpoint (reshards between world sizes
and FSDP layouts), trainer state as JSON, a manifest of sha256 checksums, written atomically.

Layout: RUN_DIR/checkpoints/step_00000120/{*.distcp, .metadata, trainer_state.json, manifest.json}.
A checkpoint is written into ``step_N.tmp`` and renamed once its manifest is complete, so a crash
leaves no directory that looks finished. Loading verifies every checksum; a truncated or corrupted
checkpoint is reported and the previous good one is used. At the next save a checkpoint found bad is
moved aside to ``checkpoints/corrupt/`` (kept for inspection, never counted by ``keep_last``), and
pruning never removes the newest checkpoint known to be good.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
# DCP's own flattening (private, but the one that names the keys a checkpoint's metadata holds).
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from orthon.core.distributed import barrier, is_distributed, rank
from orthon.core.errors import CheckpointError
from orthon.core.files import sha256_file
from orthon.core.interrupts import sigint_deferred

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
CORRUPT_DIR = "corrupt"


@contextmanager
def _single_process_quiet():
    """DCP warns on every save and load that torch.distributed is not initialised and it works in one
    process; in a single-process run that is the intent, so the warning is dropped there (and only there)."""
    if is_distributed():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def verify(path: Path) -> None:
    """Raise CheckpointError unless every file of the manifest is present with its checksum."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (incomplete checkpoint)")
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise CheckpointError(f"{manifest}: unreadable ({exc})") from None
    for name, expected in entries.items():
        f = path / name
        try:
            if not f.is_file():
                raise CheckpointError(f"{path}: file {name} is missing")
            if f.stat().st_size != expected["size"]:
                raise CheckpointError(f"{path}: file {name} is {f.stat().st_size} bytes, expected {expected['size']} (truncated?)")
            if sha256_file(f) != expected["sha256"]:
                raise CheckpointError(f"{path}: file {name} fails its checksum (corrupted)")
        except OSError as exc:  # vanished or unreadable while being checked
            raise CheckpointError(f"{path}: file {name} cannot be read ({exc})") from None


class Checkpointer:
    def __init__(self, run_dir, keep_last: int = 3, log=print):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.log = log
        self.bad: set[str] = set()  # checkpoints latest_good() found unusable; moved aside at the next save
        self.good: str | None = None  # the newest checkpoint known to verify (found, or written here)

    def step_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.suffix != ".tmp"]
        return sorted(dirs, key=lambda p: int(p.name.split("_")[1]))

    def save(self, step: int, model: torch.nn.Module, optimizers: list, trainer_state: dict) -> Path:
        """Collective when distributed: every rank calls it. A Ctrl-C during the save takes effect once the
        checkpoint is complete (core.interrupts)."""
        with sigint_deferred():
            return self._save(step, model, optimizers, trainer_state)

    def _save(self, step: int, model: torch.nn.Module, optimizers: list, trainer_state: dict) -> Path:
        final = self.root / f"step_{step:08d}"
        tmp = final.with_suffix(".tmp")
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        model_state, optim_state = get_state_dict(model, optimizers)
        with _single_process_quiet():
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
        barrier()
        if rank() == 0:
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state))
            files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())}
            (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
            self._move_bad_aside()
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self.good = final.name
            self._prune()
        barrier()
        return final

    def _move_bad_aside(self) -> None:
        """Checkpoints found unusable go to checkpoints/corrupt/ (a later name if one is there already)."""
        for name in sorted(self.bad):
            path = self.root / name
            if not path.is_dir():
                continue
            target = self.root / CORRUPT_DIR / name
            n = 1
            while target.exists():
                target = self.root / CORRUPT_DIR / f"{name}.{n}"
                n += 1
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
            self.log(f"moved the unusable checkpoint {name} aside to {target}")
        self.bad.clear()

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` checkpoints, and always the newest one known to be good."""
        dirs = self.step_dirs()
        keep = set(p.name for p in dirs[-self.keep_last:]) if self.keep_last > 0 else set()
        if self.good:
            keep.add(self.good)
        for old in dirs:
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def has(self, step: int) -> bool:
        dirs = self.step_dirs()
        return bool(dirs) and dirs[-1].name == f"step_{step:08d}"

    def latest_good(self) -> Path | None:
        """The newest checkpoint that verifies; bad ones are reported and skipped."""
        for path in reversed(self.step_dirs()):
            try:
                verify(path)
                self.good = path.name
                return path
            except CheckpointError as exc:
                self.bad.add(path.name)
                self.log(f"checkpoint {path.name} is unusable, falling back: {exc}")
        return None

    def load(self, path: Path, model: torch.nn.Module, optimizers: list) -> dict:
        """Load into an already-built (and already-sharded) model and optimizers; returns trainer state.

        An optimizer setting that orthon added after the checkpoint was written (a param-group key such
        as Muon's ``ns_method``) is absent from it: it keeps this run's value, and the log says so. Any
        other key missing (a weight, an optimizer state tensor) is a CheckpointError naming it."""
        model_state, optim_state = get_state_dict(model, optimizers)
        state = {"model": model_state, "optim": optim_state}
        missing = missing_keys(state, path)
        if missing:
            self.log(f"checkpoint {path.name} predates the optimizer settings "
                     f"{sorted({key.rsplit('.', 1)[1] for key in missing})}: they keep this run's values")
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=bool(missing)))
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=True))
        return json.loads((path / TRAINER_STATE).read_text())

    def load_model(self, path: Path, model: torch.nn.Module) -> dict:
        """Only the model's weights (to evaluate a saved step, no optimizer built); returns trainer state."""
        state = {"model": get_model_state_dict(model)}
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        return json.loads((path / TRAINER_STATE).read_text())


_GROUP_SETTING = re.compile(r"optim\.param_groups\.\d+\.(?!params$)\w+")


def missing_keys(state: dict, path: Path) -> list[str]:
    """The keys of ``state`` (flattened as DCP stores them) that the checkpoint at ``path`` lacks, if all
    are param-group settings; CheckpointError if anything else is missing."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [key for key in flatten_state_dict(state)[0] if key not in stored]
    others = [key for key in missing if not _GROUP_SETTING.fullmatch(key)]
    if others:
        raise CheckpointError(f"checkpoint {path} lacks {len(others)} entries this run needs, e.g. {others[:3]}: "
                              "written for another model or optimizer?")
    return missing
