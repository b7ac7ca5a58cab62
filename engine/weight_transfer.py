"""Moving whole weights from the trainer to engines: buckets, broadcast, shared memory, versioned disk.

Three of the four weight-sync paths (the fourth, delta, rides on each: ``orthon.engine.delta``):
broadcast (``open_update_group``, ``broadcast_tensors`` / ``receive_tensors``, ``broadcast_bytes``),
colocated (``SharedBuckets`` / ``read_shared``) and disk (``write_versioned``, ``write_delta``). The
update group uses no default process group (an engine server may already run one of its own); the
receivers get the tensors' metadata separately (as SGLang's update_weights_from_distributed takes
names, dtypes and shapes in its request) and compute the same ``bucket_plan``. Every wait has a finite
timeout.
"""
from __future__ import annotations

import ipaddress
import math
import os
import re
import secrets
import shutil
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import xxhash
from safetensors.torch import save_file

from orthon.core.errors import CheckpointError, ConfigError
from orthon.core.files import atomic_write_bytes, fsync_file
from orthon.core.net import interface_towards
from orthon.engine.tensor_bytes import dtype_name, named_list, parse_dtype, tensor_hashes  # noqa: F401 (re-exported)
from orthon.pretrain.hf_io import SINGLE_NAME, experts_to_hf
from orthon.pretrain.model import GLMForCausalLM
from orthon.pretrain.weights import save_weights

ALIGN = 64  # bytes: every tensor of a bucket starts on a cache line (and on any element size)
DEFAULT_BUCKET_BYTES = 64 << 20


# ------------------------------------------------------------------ metadata and buckets
@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # "bfloat16", "float32", ...
    shape: tuple[int, ...]

    def __post_init__(self):
        parse_dtype(self.dtype)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d < 0 for d in self.shape):
            raise CheckpointError(f"tensor {self.name!r}: negative dimension in {self.shape}")

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping) -> "TensorMeta":
        try:
            return cls(str(data["name"]), str(data["dtype"]), tuple(data["shape"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"tensor metadata {data!r}: expected name, dtype and shape ({exc})") from None


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bucket_plan(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """The tensors in order, cut into buckets of at most ``bucket_bytes`` (a larger tensor travels
    alone). Deterministic: both sides compute the same plan from the same metadata."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes: must be a positive int, got {bucket_bytes!r}")
    buckets: list[list[TensorMeta]] = []
    size = 0
    for meta in metas:
        need = _aligned(meta.nbytes)
        if not buckets or (buckets[-1] and size + need > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(meta)
        size += need
    return buckets


def bucket_layout(metas: Sequence[TensorMeta]) -> tuple[list[int], int]:
    """(byte offset of each tensor, total bytes) of a flattened bucket: offsets aligned to ``ALIGN``."""
    offsets, total = [], 0
    for meta in metas:
        offsets.append(total)
        total += _aligned(meta.nbytes)
    return offsets, total


def flatten_bucket(tensors, out: torch.Tensor | None = None) -> torch.Tensor:
    """One uint8 tensor holding every tensor's bytes at ``bucket_layout``'s offsets (one copy each),
    on the tensors' device. ``tensors``: (name, tensor) pairs, a state dict, or tensors. ``out``: a
    uint8 buffer of at least the layout's size to write into instead of a new one."""
    if not isinstance(tensors, Mapping):
        tensors = list(tensors)
        if all(isinstance(t, torch.Tensor) for t in tensors):  # bare tensors: named by position
            tensors = [(str(i), t) for i, t in enumerate(tensors)]
    items = named_list(tensors)
    metas = [TensorMeta.of(name, t) for name, t in items]
    offsets, total = bucket_layout(metas)
    device = items[0][1].device if items else torch.device("cpu")
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
        raise ValueError(f"flatten_bucket: out must be a 1-D uint8 tensor of >= {total} bytes")
    with torch.no_grad():
        for (_, tensor), meta, offset, end in zip(items, metas, offsets, offsets[1:] + [total]):
            _view(out, meta, offset).copy_(tensor)
            out[offset + meta.nbytes: end].zero_()  # padding: the same bytes every time
    return out[:total]


def _view(flat: torch.Tensor, meta: TensorMeta, offset: int) -> torch.Tensor:
    return flat[offset: offset + meta.nbytes].view(meta.torch_dtype).view(meta.shape)


def unflatten_bucket(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views (no copies) of the tensors in a flattened bucket."""
    offsets, total = bucket_layout(metas)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < total:
        raise CheckpointError(f"unflatten_bucket: expected a 1-D uint8 tensor of >= {total} bytes, got "
                              f"{dtype_name(flat.dtype)}{list(flat.shape)}")
    return [(meta.name, _view(flat, meta, offset)) for meta, offset in zip(metas, offsets)]


# ------------------------------------------------------------------ distributed broadcast
@dataclass
class UpdateGroup:
    """A weight-update process group: rank 0 is the trainer, ranks >= 1 engines."""

    process_group: dist.ProcessGroup
    store: dist.Store
    rank: int
    timeout: timedelta
    device: torch.device

    def close(self) -> None:
        shutdown = getattr(self.process_group, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def open_update_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
                      timeout_s: float = 60.0) -> UpdateGroup:
    """Join the weight-update group (every member calls this; rank 0 hosts the TCPStore at
    ``master_address:master_port``). Waits at most ``timeout_s`` for the others; every later
    collective of the group has the same limit."""
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend: must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in a group of {world_size}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s: must be > 0, got {timeout_s!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout,
                              wait_for_workers=False)
        prefixed = dist.PrefixStore("orthon-weight-update", store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            # Each member on its own interface towards the master: loopback over loopback; across machines
            # the address that routes there (gloo's default device resolves the hostname, which may name
            # loopback, as on a machine whose /etc/hosts maps it to 127.0.0.1, or not route at all).
            here = "127.0.0.1" if _is_loopback(master_address) else interface_towards(master_address)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=here)]
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
            device = torch.device("cpu")
        return UpdateGroup(group, store, rank, timeout, device)
    except RuntimeError as exc:  # torch.distributed's DistError and gloo's failures
        raise TimeoutError(f"weight-update group at {master_address}:{master_port} (rank {rank} of {world_size}, "
                           f"{backend}): not formed within {timeout_s} s ({str(exc).splitlines()[0]})") from None


def _broadcast(group: UpdateGroup, tensor: torch.Tensor, src: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    options.timeout = group.timeout
    work = group.process_group.broadcast([tensor], options)
    if not work.wait(group.timeout):
        raise TimeoutError(f"weight broadcast: no completion within {group.timeout.total_seconds()} s")


def _check_plan(group: UpdateGroup, metas: list[TensorMeta], bucket_bytes: int, src: int) -> None:
    """The sender broadcasts its plan's fingerprint; a receiver whose metadata differs stops here."""
    # 63 bits (an int64 holds them) that differ when two sides' metadata or bucket size differ.
    text = repr([(m.name, m.dtype, m.shape) for m in metas]) + f"|{bucket_bytes}"
    mine = xxhash.xxh64_intdigest(text.encode()) >> 1
    signal = torch.tensor([len(metas), mine], dtype=torch.int64, device=group.device)
    _broadcast(group, signal, src)
    if group.rank != src and int(signal[1]) != mine:
        raise CheckpointError(f"weight broadcast: the sender's {int(signal[0])} tensors / bucket size differ from "
                              f"the {len(metas)} tensors this receiver was told about")


def broadcast_tensors(group: UpdateGroup, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                      src: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Send ``named`` to every other member (the trainer's side), bucket by bucket."""
    items = named_list(named)
    metas = [TensorMeta.of(name, t) for name, t in items]
    plan = bucket_plan(metas, bucket_bytes)
    _check_plan(group, metas, bucket_bytes, src)
    by_name = dict(items)
    buffer = None
    for bucket in plan:
        _, total = bucket_layout(bucket)
        if buffer is None or buffer.numel() < total:
            buffer = torch.empty(total, dtype=torch.uint8, device=group.device)
        flat = flatten_bucket([(m.name, by_name[m.name].to(group.device)) for m in bucket], out=buffer)
        _broadcast(group, flat, src)


def receive_tensors(group: UpdateGroup, metas: Sequence[TensorMeta], src: int = 0,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[tuple[str, torch.Tensor]]:
    """Receive the tensors ``metas`` describes (an engine's side); views into one buffer per bucket."""
    metas = [m if isinstance(m, TensorMeta) else TensorMeta.from_json(m) for m in metas]
    plan = bucket_plan(metas, bucket_bytes)
    _check_plan(group, metas, bucket_bytes, src)
    out = []
    for bucket in plan:
        _, total = bucket_layout(bucket)
        flat = torch.empty(total, dtype=torch.uint8, device=group.device)
        _broadcast(group, flat, src)
        out.extend(unflatten_bucket(flat, bucket))
    return out


def broadcast_bytes(group: UpdateGroup, data: bytes | None, src: int = 0) -> bytes:
    """One byte string from ``src`` to every member (the sender passes it, the others None): a delta
    payload (``orthon.engine.delta``) over the broadcast path. Length first, then the bytes."""
    if group.rank == src and data is None:
        raise ValueError("broadcast_bytes: the sender must pass the bytes")
    length = torch.tensor([len(data) if group.rank == src else -1], dtype=torch.int64, device=group.device)
    _broadcast(group, length, src)
    if group.rank == src:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        buffer = buffer.to(group.device)
    else:
        buffer = torch.empty(int(length), dtype=torch.uint8, device=group.device)
    _broadcast(group, buffer, src)
    return data if group.rank == src else buffer.cpu().numpy().tobytes()


# ------------------------------------------------------------------ colocated: shared memory
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedBuckets:
    """The trainer's shared-memory file of flattened tensors (colocated sync).

    ``write(named, version)`` copies the tensors into the file (grown as needed) and returns a JSON-able
    handle for ``read_shared``. The writer owns the file: ``close()`` (or leaving a ``with`` block, or
    garbage collection, or interpreter exit) unlinks it, and a new SharedBuckets in the same directory
    removes the files of writers that died without closing (their pid in the name is gone). Readers
    create nothing, so a reader's crash leaves nothing behind. The next ``write`` reuses the file: send
    it once the engine has copied the previous one (its ``update_weights`` returned)."""

    PATTERN = re.compile(r"^orthon-weights-(\d+)-[0-9a-f]+\.bin$")

    def __init__(self, directory: str | os.PathLike | None = None):
        shm = Path("/dev/shm")
        default = shm if shm.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
        self.directory = Path(directory) if directory is not None else default
        self.directory.mkdir(parents=True, exist_ok=True)
        self.removed_stale = [path for path in self.directory.iterdir()
                              if (match := self.PATTERN.match(path.name)) and not _pid_alive(int(match.group(1)))]
        for path in self.removed_stale:
            path.unlink(missing_ok=True)
        self.path = self.directory / f"orthon-weights-{os.getpid()}-{secrets.token_hex(6)}.bin"
        os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        self._finalizer = weakref.finalize(self, self.path.unlink, missing_ok=True)
        self._buffer: torch.Tensor | None = None

    def write(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        if not self._finalizer.alive:
            raise ValueError("SharedBuckets: write after close()")
        items = named_list(named)
        metas = [TensorMeta.of(name, t) for name, t in items]
        _, total = bucket_layout(metas)
        if self._buffer is None or self._buffer.numel() < total:
            os.truncate(self.path, max(total, 1))
            self._buffer = torch.from_file(str(self.path), shared=True, size=max(total, 1), dtype=torch.uint8)
        flatten_bucket(items, out=self._buffer)
        return {"path": str(self.path), "nbytes": total, "version": int(version),
                "tensors": [m.to_json() for m in metas]}

    def close(self) -> None:
        self._buffer = None
        self._finalizer()

    def __enter__(self) -> "SharedBuckets":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_shared(handle: Mapping) -> list[tuple[str, torch.Tensor]]:
    """Views into the shared file a ``SharedBuckets.write`` handle names (no copy; do not write them)."""
    try:
        path, nbytes = str(handle["path"]), int(handle["nbytes"])
        metas = [TensorMeta.from_json(m) for m in handle["tensors"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"shared weights handle: expected path, nbytes and tensors ({exc})") from None
    _, total = bucket_layout(metas)
    if total != nbytes:
        raise CheckpointError(f"shared weights handle: its tensors take {total} bytes, it declares {nbytes}")
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise CheckpointError(f"shared weights {path}: {exc.strerror}") from None
    if size < nbytes:
        raise CheckpointError(f"shared weights {path}: {size} bytes, the handle needs {nbytes}")
    flat = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    return unflatten_bucket(flat, metas)


# ------------------------------------------------------------------ disk: versioned HF-layout directories
VERSION_DIR = re.compile(r"^v(\d{8})$")


def version_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def list_versions(root: str | os.PathLike) -> list[int]:
    """The complete versions under ``root``, ascending (staging directories are not versions)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := VERSION_DIR.match(p.name)))


def latest_version(root: str | os.PathLike) -> tuple[int, Path] | None:
    versions = list_versions(root)
    return (versions[-1], version_dir(root, versions[-1])) if versions else None


def write_versioned(model_or_state, root: str | os.PathLike, version: int, keep: int = 2) -> Path:
    """Write weights as ``root/v{version:08d}`` and keep only the newest ``keep`` versions.

    ``model_or_state``: a GLMForCausalLM (``orthon.pretrain.weights.save_weights``: the HF layout with
    config.json and the sidecar) or a bare state dict in the model's names (written as model.safetensors
    alone, routed experts per expert: the engine's ``update_weights`` reads such a directory too). The
    directory is written under a hidden staging name and renamed into place, so a version is never
    visible half-written; one writer per root. Rewriting an existing version replaces it."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 10**8:
        raise ConfigError(f"version: must be an int in 0..99999999, got {version!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep: must be an int >= 1, got {keep!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".v*.staging*"):  # left by a writer that died mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = version_dir(root, version)
    staging = root / f".{final.name}.staging"
    if isinstance(model_or_state, GLMForCausalLM):
        save_weights(model_or_state, staging)
    elif isinstance(model_or_state, Mapping):
        _write_state(model_or_state, staging)
    else:
        raise TypeError(f"write_versioned: expected a GLMForCausalLM or a state dict, "
                        f"got {type(model_or_state).__name__}")
    old = root / f".{final.name}.staging-old"
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)
    prune_versions(root, keep)
    return final


def prune_versions(root: str | os.PathLike, keep: int = 2) -> None:
    """Delete all but the newest ``keep`` versions under ``root``."""
    for stale in list_versions(root)[:-keep]:
        shutil.rmtree(version_dir(root, stale), ignore_errors=True)


def write_delta(root: str | os.PathLike, payload) -> Path:
    """A delta payload (``orthon.engine.delta.DeltaPayload``) as root/delta-v{base}-v{version}.bin,
    written atomically; the engine reads it with ``DeltaPayload.from_bytes(path.read_bytes())``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"delta-v{payload.base_version:08d}-v{payload.version:08d}.bin"
    atomic_write_bytes(path, payload.to_bytes())
    return path


def _write_state(state: Mapping[str, torch.Tensor], directory: Path) -> None:
    """model.safetensors alone into ``directory`` (a fresh staging directory: renamed into place whole)."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in experts_to_hf(dict(named_list(state))).items()}
    directory.mkdir()
    save_file(tensors, str(directory / SINGLE_NAME), metadata={"format": "pt"})
    fsync_file(directory / SINGLE_NAME)
