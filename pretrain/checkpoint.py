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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
# DCP's own flattening (private, but the one that names the keys a checkpoint's metadata holds).
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from orthon.core.distributed import all_gather_object, barrier, gather_object, is_distributed, rank, world_size
from orthon.core.errors import CheckpointError
from orthon.core.files import sha256_file
from orthon.core.interrupts import sigint_deferred
from orthon.pretrain.parallel import unwrap

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
CORRUPT_DIR = "corrupt"
ABANDONED_DIR = "abandoned"


# DCP warns on every save and load in a single process that torch.distributed is not initialised and it
# works in one process: there that is the intent, and it is the only place the warning arises. A filter
# for the whole process, since a background save warns from its own thread, out of reach of a
# catch_warnings context.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


def _move_to(path: Path, folder: Path) -> Path:
    """``path`` moved into ``folder`` (``NAME.1``, ``NAME.2``, ... if the name is taken); returns where."""
    target = folder / path.name
    n = 1
    while target.exists():
        target = folder / f"{path.name}.{n}"
        n += 1
    folder.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)
    return target


def _checksums(paths) -> dict:
    return {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in paths}


def _own_files(tmp: Path) -> dict:
    """Size and checksum of the data files this rank wrote (DCP names them ``__RANK_N.distcp``): every
    rank checksums its own share, so the time does not grow with the number of ranks."""
    return _checksums(p for p in sorted(tmp.iterdir()) if p.name.startswith(f"__{rank()}_"))


def _own_files_once_written(written, tmp: Path) -> dict:
    written.result()
    return _own_files(tmp)


def verify(path: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Raise CheckpointError unless every file of the manifest is present with its size and checksum.

    ``share`` (i, n): read and checksum only every n-th file from the i-th (the sizes of all are checked):
    the n ranks of a job resuming split the reading, each file read once, instead of each rank reading
    the whole checkpoint."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (incomplete checkpoint)")
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise CheckpointError(f"{manifest}: unreadable ({exc})") from None
    mine, of = share
    for k, (name, expected) in enumerate(sorted(entries.items())):
        f = path / name
        try:
            if not f.is_file():
                raise CheckpointError(f"{path}: file {name} is missing")
            if f.stat().st_size != expected["size"]:
                raise CheckpointError(f"{path}: file {name} is {f.stat().st_size} bytes, expected {expected['size']} (truncated?)")
            if k % of == mine and sha256_file(f) != expected["sha256"]:
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
        self.pending = None  # (future, step, trainer state) of a background save not yet completed
        self._group = None
        self._thread = None  # the background saves' checksumming thread

    def step_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.suffix != ".tmp"]
        return sorted(dirs, key=lambda p: int(p.name.split("_")[1]))

    def save(self, step: int, model: torch.nn.Module, optimizers: list, trainer_state: dict,
             background: bool = False) -> Path:
        """Collective when distributed: every rank calls it. A Ctrl-C during the save takes effect once the
        checkpoint is complete (core.interrupts). A save still in flight is completed first.

        ``background``: the state is copied to CPU memory (DCP's staging) and a thread writes it and
        checksums this rank's files while training goes on; the checkpoint gets its manifest and its
        final name at the next ``wait()`` (the next save, or the end of the run). Until then it is a
        ``.tmp`` directory, which resuming ignores."""
        with sigint_deferred():
            self.wait()
            tmp = self._begin(step)
            model_state, optim_state = get_state_dict(model, optimizers)
            state = _renamed({"model": model_state, "optim": optim_state}, _checkpoint_names(model))
            text = json.dumps(trainer_state)  # now: the caller's dicts may change while the thread writes
            if background:
                written = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._background_group())
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-checksums")
                self.pending = (self._thread.submit(_own_files_once_written, written, tmp), step, text)
                return tmp.with_suffix("")
            dcp.save(state, checkpoint_id=str(tmp))
            return self._finish(step, text, _own_files(tmp))

    def wait(self) -> None:
        """Complete the save in flight, if any: its files written and checksummed, then its manifest,
        name and pruning. Collective when distributed."""
        if self.pending is None:
            return
        (checksummed, step, text), self.pending = self.pending, None
        with sigint_deferred():
            self._finish(step, text, checksummed.result())

    def _background_group(self):
        """A gloo group of its own for the writing thread's collectives, so that they never interleave
        with the training's on the default group (None in one process: no collectives)."""
        if not is_distributed():
            return None
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def _begin(self, step: int) -> Path:
        tmp = self.root / f"step_{step:08d}.tmp"
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        return tmp

    def _finish(self, step: int, trainer_state: str, own_files: dict) -> Path:
        """Every rank's files written and checksummed (each rank its own, in parallel): rank 0 adds the
        rest (DCP's metadata, the trainer state), writes the manifest and renames the directory."""
        final = self.root / f"step_{step:08d}"
        tmp = final.with_suffix(".tmp")
        shares = gather_object(own_files)
        if rank() == 0:
            (tmp / TRAINER_STATE).write_text(trainer_state)
            files = {name: entry for share in shares for name, entry in share.items()}
            files.update(_checksums(p for p in tmp.iterdir() if p.name not in files))
            (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": dict(sorted(files.items()))}, indent=1))
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
            if path.is_dir():
                self.log(f"moved the unusable checkpoint {name} aside to {_move_to(path, self.root / CORRUPT_DIR)}")
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
        """Whether the newest checkpoint (or the one being written in the background) is of ``step``."""
        if self.pending is not None:
            return self.pending[1] == step
        dirs = self.step_dirs()
        return bool(dirs) and dirs[-1].name == f"step_{step:08d}"

    def latest_good(self) -> Path | None:
        """The newest checkpoint that verifies; bad ones are reported and skipped. Collective when
        distributed: the ranks split the checksumming (``verify``'s share) and agree on each verdict."""
        for path in reversed(self.step_dirs()):
            problem = self.problem(path)
            if problem is None:
                self.good = path.name
                return path
            self.bad.add(path.name)
            self.log(f"checkpoint {path.name} is unusable, falling back: {problem}")
        return None

    def of_step(self, step: int) -> Path:
        """The checkpoint of ``step``, verified (collective, as ``latest_good``); CheckpointError naming the
        steps there are when it is missing, or what is wrong with it."""
        path = self.root / f"step_{step:08d}"
        if not path.is_dir():
            have = ", ".join(str(int(p.name.split("_")[1])) for p in self.step_dirs()) or "none"
            raise CheckpointError(f"{self.root.parent}: no checkpoint of step {step} (it has steps {have})")
        problem = self.problem(path)
        if problem is not None:
            raise CheckpointError(problem)
        return path

    def problem(self, path: Path) -> str | None:
        """What makes the checkpoint ``path`` unusable (None: it verifies). Collective when distributed:
        each rank checksums its share of the files and every rank gets the same answer."""
        try:
            verify(path, (rank(), world_size()) if is_distributed() else (0, 1))
            mine = None
        except CheckpointError as exc:
            mine = str(exc)
        return next((p for p in all_gather_object(mine) if p), None)

    def set_aside_after(self, step: int) -> list[str]:
        """Move the checkpoints after ``step`` to ``checkpoints/abandoned/`` (a run resumed from an earlier
        step starts a new line of steps; the old ones are kept, out of the way of resuming and pruning).
        Collective when distributed; returns the names moved."""
        later = [p for p in self.step_dirs() if int(p.name.split("_")[1]) > step]
        if rank() == 0:
            for path in later:
                _move_to(path, self.root / ABANDONED_DIR)
        barrier()
        return [p.name for p in later]

    def load(self, path: Path, model: torch.nn.Module, optimizers: list, rebuild=None) -> dict:
        """Load into an already-built (and already-sharded) model and optimizers; returns trainer state.

        An optimizer setting that orthon added after the checkpoint was written (a param-group key such
        as Muon's ``ns_method``) is absent from it: it keeps this run's value, and the log says so. Any
        other key missing (a weight, an optimizer state tensor) is a CheckpointError naming it.

        ``rebuild(targets, path, stored)``: the checkpoint was written at another layout of the model's ranks
        (another backend's model parallelism); it fills in place the tensors of this rank's it does not hold
        under their names ({flattened key: tensor}; ``stored``: its metadata's tensors), and the param
        groups stay this run's."""
        model_state, optim_state = get_state_dict(model, optimizers)
        names = _checkpoint_names(model)
        state = _renamed({"model": model_state, "optim": optim_state}, names)
        if rebuild is not None:
            state["optim"] = {"state": state["optim"]["state"]}  # this run's param groups
            flat, mapping = flatten_state_dict(state)
            stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            rebuild({k: v for k, v in flat.items() if k not in stored and isinstance(v, torch.Tensor)}, path, stored)
            held = {k: v for k, v in flat.items() if k in stored}
            dcp.load(held, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
            state = unflatten_state_dict({**flat, **held}, mapping)
            state["optim"]["param_groups"] = optim_state["param_groups"]
        else:
            missing = missing_keys(state, path)
            if missing:
                self.log(f"checkpoint {path.name} predates the optimizer settings "
                         f"{sorted({key.rsplit('.', 1)[1] for key in missing})}: they keep this run's values")
            dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=bool(missing)))
        state = _renamed(state, {v: k for k, v in names.items()})
        # Into the module itself, not a DDP wrapper: through the wrapper torch takes a None value (a module's
        # empty extra state, as megatron-core's layers have) for a missing key.
        set_state_dict(unwrap(model), optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(strict=True))
        return self.trainer_state(path)

    @staticmethod
    def trainer_state(path: Path) -> dict:
        """The trainer state a checkpoint was written with (readable before its tensors are loaded)."""
        return json.loads((path / TRAINER_STATE).read_text())

    def load_model(self, path: Path, model: torch.nn.Module) -> dict:
        """Only the model's weights (to evaluate a saved step, no optimizer built); returns trainer state."""
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        return self.trainer_state(path)


def _checkpoint_names(model: torch.nn.Module) -> dict[str, str]:
    """{state-dict name: name in a checkpoint} where a model's ranks use one name for different tensors
    (megatron-core's tensor-parallel slices, and its experts numbered from 0 on every expert-parallel rank:
    orthon.backends.megatron.causal_lm); {} for orthon's own model, whose state dicts name each tensor once
    (DTensors)."""
    names = getattr(unwrap(model), "checkpoint_names", None)
    return names() if names is not None else {}


def _renamed(state: dict, names: dict[str, str]) -> dict:
    """``state`` ({"model": ..., "optim": get_state_dict's}) with the names of its tensors mapped by ``names``.
    The param groups keep the ranks' own parameter names (they say which parameter each setting goes
    with, not a tensor); where the ranks hold different parameters (pipeline stages), ``names`` maps
    "param_groups" to a key of each rank's own, since one copy of a key is stored."""
    if not names:
        return state
    optim = {}
    for key, value in state["optim"].items():
        if key == "state":
            optim[key] = {names.get(name, name): v for name, v in value.items()}
        else:  # param_groups
            optim[names.get(key, key)] = value
    return {**state, "model": {names.get(k, k): v for k, v in state["model"].items()}, "optim": optim}


def carry(path: Path, model: torch.nn.Module, optimizers: list) -> dict:
    """Weights and per-parameter optimizer state from a checkpoint of a related run (mid-training's
    hand-over between stages, whose models may differ: IndexShare drops the shared layers' indexers),
    loaded straight into this already-built (and already-sharded) model: no rank holds it whole. Every
    weight of ``model`` must be in the checkpoint (a CheckpointError names the first missing); a
    parameter whose optimizer state the checkpoint lacks (never trained there, or by another optimizer)
    keeps the state it has; the param-group settings stay this run's. Returns {"dropped": the
    checkpoint's weights the model lacks, "fresh": parameters that kept their state, "carried": count}."""
    model_state, optim_state = get_state_dict(model, optimizers)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    weights = flatten_state_dict({"model": model_state})[0]
    missing = [key for key in weights if key not in stored]
    if missing:
        raise CheckpointError(f"{path} has no {missing[0].removeprefix('model.')!r} (and {len(missing) - 1} "
                              f"more weights this model needs)")
    carried = {name: entries for name, entries in optim_state["state"].items()
               if all(f"optim.state.{name}.{key}" in stored for key in entries)}
    dcp.load({"model": model_state, "optim": {"state": carried}}, checkpoint_id=str(path))
    set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(strict=True))
    return {"dropped": sorted(key.removeprefix("model.") for key in stored
                              if key.startswith("model.") and key not in weights),
            "fresh": [name for name in optim_state["state"] if name not in carried], "carried": len(carried)}


_GROUP_SETTING = re.compile(r"optim\.param_groups(@\w+)?\.\d+\.(?!params$)\w+")


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
