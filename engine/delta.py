"""Delta weight payloads: what changed since the weights a receiver holds, checked end to end.

The trainer's ``DeltaEncoder`` keeps a CPU copy of the bytes the receiver holds (the last synced
version) and turns new weights into a ``DeltaPayload``: per changed tensor the smallest encoding of
its change (``orthon.engine.delta_codec``), the hash of the bytes it expects the receiver to hold
(``base_hash``) and of the bytes the receiver will hold after applying it (``hash``); over everything a
checksum. The receiver (``apply_in_place``) refuses a payload before writing anything when the checksum,
a name, dtype or shape, or a base hash does not match, then overwrites the changed bytes in place and
checks every result hash: afterwards both sides hold byte-identical weights. The version numbers
(``base_version`` -> ``version``) are the engine's to check (``InProcessEngine.update_weights``).

Wire format (``to_bytes`` / ``from_bytes``), little-endian:

    0   8 bytes   magic b"ORTHDLT1"
    8   u64       length of the whole payload
    16  u64       length H of the compressed header
    24  16 bytes  xxh3-128 checksum of every other byte (0..24 and 40..end)
    40  H bytes   zstd of the header JSON: format, base_version, version, final, and per changed
                  tensor name, dtype, shape, encoding, changed, nbytes, base_hash, hash
    40+H          the blobs, in header order

Tensors that did not change are not in the payload. Tensors that share storage (a tied embedding and
head) are sent once, under the first name. A name "NAME[a:b]" is rows a..b-1 of tensor NAME (``row_views``):
where the trainer's ranks hold shards, each encodes its own rows and a version comes as several payloads,
all but the last not ``final``.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import xxhash
import zstandard

from orthon.core.errors import CheckpointError
from orthon.engine.delta_codec import ENCODINGS, ZSTD_LEVEL, Prepared, check_encodings, encode_tensor, prepare
from orthon.engine.tensor_bytes import (cpu_contiguous, dtype_name, int_kind, int_view, named_list, parse_dtype,
                                        tensor_hash)
from orthon.pretrain.hf_io import row_piece

MAGIC = b"ORTHDLT1"
FORMAT = "orthon-delta"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<8sQQ16s")
MAX_HEADER_BYTES = 256 << 20  # a decompressed header larger than this is refused (a bomb, not a model)
_ENTRY_FIELDS = {"name": str, "dtype": str, "shape": list, "encoding": str, "changed": int, "nbytes": int,
                 "base_hash": str, "hash": str}

Named = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

# A payload moved as one uint8 tensor, where a path carries tensors (broadcast, shared memory).
DELTA_TENSOR_NAME = "__orthon_delta__"


@dataclass
class DeltaEntry:
    """One changed tensor: its encoded change and the hashes of its bytes before and after."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    changed: int
    base_hash: str
    hash: str
    blob: bytes | memoryview

    def header(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "encoding": self.encoding,
                "changed": self.changed, "nbytes": len(self.blob), "base_hash": self.base_hash, "hash": self.hash}


def _header(base_version: int, version: int, entries: list[DeltaEntry], final: bool = True) -> dict:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "base_version": base_version,
            "version": version, "final": final, "entries": [e.header() for e in entries]}


def _checksum(prefix: bytes | memoryview, header: bytes | memoryview, blobs: Iterable[bytes | memoryview]) -> bytes:
    """xxh3-128 of the prefix's first 24 bytes, the compressed header and the blobs: every byte sent
    but the checksum's own."""
    digest = xxhash.xxh3_128()
    digest.update(prefix[:24])
    digest.update(header)
    for blob in blobs:
        digest.update(blob)
    return digest.digest()


def _check_version(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"delta payload: {name} must be an int >= 0, got {value!r}")
    return value


class DeltaPayload:
    """A delta from weights ``base_version`` to ``version`` (an ``orthon.engine.protocol.WeightDelta``)."""

    def __init__(self, base_version: int, version: int, entries: list[DeltaEntry], *, final: bool = True,
                 header: bytes | None = None, checksum: bytes | None = None):
        """``final``: False for a payload that is one of several making up ``version`` (each trainer rank's
        part of the weights, ``orthon.rl.shard_delta``): the receiver applies it and still holds
        ``base_version`` until the final one. ``header`` / ``checksum``: as received (``from_bytes``);
        computed from the entries when absent."""
        self.base_version = _check_version("base_version", base_version)
        self.version = _check_version("version", version)
        self.entries = list(entries)
        self.final = final
        if header is None:
            raw = json.dumps(_header(self.base_version, self.version, self.entries, final), sort_keys=True,
                             separators=(",", ":")).encode()
            header = zstandard.ZstdCompressor(level=3).compress(raw)
        self._header_bytes = bytes(header)
        self.checksum = checksum if checksum is not None else _checksum(self._prefix(), self._header_bytes, self._blobs())

    def _blobs(self):
        return (e.blob for e in self.entries)

    def _prefix(self, checksum: bytes = bytes(16)) -> bytes:
        return PREFIX.pack(MAGIC, self.nbytes, len(self._header_bytes), checksum)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    # ------------------------------------------------------------ bytes
    @property
    def nbytes(self) -> int:
        """The length of ``to_bytes()``: what goes over the wire."""
        return PREFIX.size + len(self._header_bytes) + sum(len(e.blob) for e in self.entries)

    def to_bytes(self) -> bytes:
        return b"".join([self._prefix(self.checksum), self._header_bytes, *self._blobs()])

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "DeltaPayload":
        """Parse and verify a payload; CheckpointError names what is wrong (truncated, not a delta
        payload, a checksum mismatch, a damaged header). Blobs are views into ``data`` (no copy)."""
        view = memoryview(data).cast("B")
        if len(view) < PREFIX.size:
            raise CheckpointError(f"delta payload: truncated ({len(view)} bytes, shorter than its "
                                  f"{PREFIX.size}-byte prefix)")
        magic, total, header_len, checksum = PREFIX.unpack(view[: PREFIX.size])
        if magic != MAGIC:
            raise CheckpointError(f"delta payload: bad magic {bytes(magic)!r} (expected {MAGIC!r}): not an orthon delta")
        if total != len(view):
            raise CheckpointError(f"delta payload: {'truncated' if len(view) < total else 'trailing bytes'} "
                                  f"({len(view)} bytes, the prefix declares {total})")
        if _checksum(view, view[PREFIX.size:], ()) != checksum:
            raise CheckpointError("delta payload: checksum mismatch (corrupted in transit or storage)")
        header_end = PREFIX.size + header_len
        if header_end > total:
            raise CheckpointError(f"delta payload: the header length {header_len} runs past the payload's end")
        header = view[PREFIX.size:header_end]
        base_version, version, final, metas = _parse_header(_read_header(header))
        declared = sum(m["nbytes"] for m in metas)
        if declared != total - header_end:
            raise CheckpointError(f"delta payload: the header declares {declared} bytes of tensor data, "
                                  f"{total - header_end} follow it")
        entries, offset = [], header_end
        for m in metas:
            entries.append(DeltaEntry(m["name"], m["dtype"], tuple(m["shape"]), m["encoding"], m["changed"],
                                      m["base_hash"], m["hash"], view[offset: offset + m["nbytes"]]))
            offset += m["nbytes"]
        return cls(base_version, version, entries, final=final, header=header, checksum=checksum)

    # ------------------------------------------------------------ applying
    def _prepare(self, state_dict: Mapping[str, torch.Tensor]) -> list[tuple[DeltaEntry, torch.Tensor, Prepared]]:
        """Every check that needs no write: checksum, header, names, dtypes, shapes, distinct storage,
        base hashes, each blob against its tensor."""
        if _checksum(self._prefix(), self._header_bytes, self._blobs()) != self.checksum:
            raise CheckpointError("delta payload: checksum mismatch (corrupted after it was made)")
        if _read_header(self._header_bytes) != _header(self.base_version, self.version, self.entries, self.final):
            raise CheckpointError("delta payload: its entries no longer match its header (modified after it was made)")
        plan, spans = [], []
        for e in self.entries:
            target = state_dict.get(e.name)
            if target is None:
                raise CheckpointError(f"delta payload: {e.name!r} is not a tensor of the receiver")
            if dtype_name(target.dtype) != e.dtype or tuple(target.shape) != e.shape:
                raise CheckpointError(f"delta payload: {e.name!r} is {e.dtype}{list(e.shape)} in the payload, "
                                      f"{dtype_name(target.dtype)}{list(target.shape)} at the receiver")
            if not target.is_contiguous():
                raise CheckpointError(f"delta payload: {e.name!r} is not contiguous at the receiver")
            start = target.data_ptr()
            spans.append((start, start + target.numel() * target.element_size(), target.device, e.name))
            plan.append((e, target, prepare(e.encoding, e.blob, target.numel(), int_kind(target.dtype), e.changed)))
        spans.sort(key=lambda s: (str(s[2]), s[0]))
        for a, b in zip(spans, spans[1:]):
            if a[2] == b[2] and b[0] < a[1]:
                raise CheckpointError(f"delta payload: {a[3]!r} and {b[3]!r} share memory at the receiver "
                                      f"(tied tensors are sent once)")
        stale = [e.name for e, target, _ in plan if tensor_hash(target) != e.base_hash]
        if stale:
            raise CheckpointError(f"delta payload: the receiver's bytes of {len(stale)} tensors ({stale[:3]}) are "
                                  f"not this delta's base (version {self.base_version}); a full sync is needed")
        return plan

    def apply_in_place(self, state_dict: Mapping[str, torch.Tensor]) -> list[str]:
        """Overwrite the changed bytes of ``state_dict``'s tensors in their own storage, after every check
        passed; then verify each result hash. Returns the names written. A tensor off the CPU is
        written through a CPU copy and copied back."""
        plan = self._prepare(state_dict)
        for _, target, prepared in plan:
            _write(target, prepared)
        wrong = [e.name for e, target, _ in plan if tensor_hash(target) != e.hash]
        if wrong:
            raise CheckpointError(f"delta payload: after applying, {len(wrong)} tensors ({wrong[:3]}) differ from "
                                  f"the sender's version {self.version}; a full sync is needed")
        return [e.name for e, _, _ in plan]

    def apply_to(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The ``WeightDelta`` protocol: the new values of the changed tensors, as new tensors
        (``state_dict`` is not modified)."""
        out = {}
        for e, target, prepared in self._prepare(state_dict):
            copy = target.detach().clone()
            _write(copy, prepared)
            if tensor_hash(copy) != e.hash:
                raise CheckpointError(f"delta payload: {e.name!r} decodes to other bytes than the sender's")
            out[e.name] = copy
        return out


def _write(target: torch.Tensor, prepared: Prepared) -> None:
    host = cpu_contiguous(target)  # the target's own memory when it is on the CPU
    prepared.write(int_view(host))
    if host.device != target.device:
        with torch.no_grad():
            target.copy_(host)


def _read_header(compressed) -> object:
    try:
        return json.loads(zstandard.ZstdDecompressor().decompress(compressed, max_output_size=MAX_HEADER_BYTES))
    except (zstandard.ZstdError, ValueError) as exc:
        raise CheckpointError(f"delta payload: damaged header ({exc})") from None


def _parse_header(header) -> tuple[int, int, bool, list[dict]]:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"delta payload: the header is not an {FORMAT} header")
    if header.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"delta payload: format version {header.get('format_version')!r}; this orthon reads "
                              f"{FORMAT_VERSION}")
    entries = header.get("entries")
    if not isinstance(entries, list):
        raise CheckpointError("delta payload: the header has no entry list")
    if not isinstance(header.get("final"), bool):
        raise CheckpointError(f"delta payload: the header's final: expected true or false, got {header.get('final')!r}")
    for i, m in enumerate(entries):
        if not isinstance(m, dict):
            raise CheckpointError(f"delta payload: entry {i} is not an object")
        for key, kind in _ENTRY_FIELDS.items():
            value = m.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CheckpointError(f"delta payload: entry {i} field {key!r}: expected {kind.__name__}, got {value!r}")
        if m["nbytes"] < 0 or not all(isinstance(d, int) and d >= 0 for d in m["shape"]):
            raise CheckpointError(f"delta payload: entry {i} ({m['name']!r}): negative size or shape")
        parse_dtype(m["dtype"])
    return (_check_version("base_version", header.get("base_version")),
            _check_version("version", header.get("version")), header["final"], entries)


# ------------------------------------------------------------------ row pieces
def row_views(state: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """{piece name: the view of its rows} for each of ``names`` that names rows of a tensor of ``state``
    (contiguous where the tensor is)."""
    views = {}
    for name in names:
        piece = row_piece(name)
        if piece is None or piece[0] not in state:
            continue
        tensor, first, last = state[piece[0]], piece[1], piece[2]
        if not first < last <= (tensor.shape[0] if tensor.dim() else 0):
            raise CheckpointError(f"delta payload: {name!r}: rows outside the receiver's {tuple(tensor.shape)}")
        views[name] = tensor[first:last]
    return views


# ------------------------------------------------------------------ the sender
def _distinct(items: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], set[str]]:
    """The pairs without the later names of tensors that share memory with an earlier one (tied weights)."""
    seen, kept, aliases = set(), [], set()
    for name, tensor in items:
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and key in seen:
            aliases.add(name)
            continue
        seen.add(key)
        kept.append((name, tensor))
    return kept, aliases


class DeltaEncoder:
    """The trainer's side: a CPU copy of what the receiver holds, and deltas from it.

    ``reset(named, version)`` after a full sync (the receiver now holds exactly ``named``);
    ``encode(named, version)`` returns the payload from the held version to ``named`` and then holds
    ``named``. A receiver that refuses a payload needs a full sync and a ``reset``. ``encodings``
    restricts the per-tensor choice (benchmarks force one)."""

    def __init__(self, *, encodings: tuple[str, ...] = ENCODINGS):
        self.encodings = check_encodings(encodings)
        self._compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self._held: dict[str, torch.Tensor] = {}
        self._hashes: dict[str, str] = {}
        self._aliases: set[str] = set()
        self.version: int | None = None

    def hashes(self) -> dict[str, str]:
        """Per tensor, the hash of the bytes the receiver holds (as ``tensor_hashes`` gives them)."""
        return dict(self._hashes)

    def reset(self, named: Named, version: int) -> None:
        kept, aliases = _distinct(named_list(named))
        self._held = {name: cpu_contiguous(t).clone() for name, t in kept}
        self._hashes = {name: tensor_hash(t) for name, t in self._held.items()}
        self._aliases = aliases
        self.version = _check_version("version", version)

    def encode(self, named: Named, version: int, final: bool = True) -> DeltaPayload:
        if self.version is None:
            raise CheckpointError("delta encoder: no base yet; reset() it after a full sync")
        version = _check_version("version", version)
        if version <= self.version:
            raise CheckpointError(f"delta encoder: version {version} does not follow the held version {self.version}")
        kept, aliases = _distinct(named_list(named))
        names = {name for name, _ in kept}
        if names != set(self._held) or aliases != self._aliases:
            missing, extra = sorted(set(self._held) - names), sorted(names - set(self._held))
            raise CheckpointError(f"delta encoder: the tensors differ from the held ones (missing {missing[:3]}, "
                                  f"new {extra[:3]}); reset() after a full sync")
        entries, updates = [], []
        for name, tensor in kept:
            held = self._held[name]
            if tensor.dtype != held.dtype or tensor.shape != held.shape:
                raise CheckpointError(f"delta encoder: {name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, "
                                      f"the held one {dtype_name(held.dtype)}{list(held.shape)}")
            new = cpu_contiguous(tensor)
            encoded = encode_tensor(int_view(held), int_view(new), self._compressor, self.encodings)
            if encoded is None:
                continue
            new_hash = tensor_hash(new)
            entries.append(DeltaEntry(name, dtype_name(held.dtype), tuple(held.shape), encoded.encoding,
                                      encoded.changed, self._hashes[name], new_hash, encoded.blob))
            updates.append((name, new, new_hash))
        payload = DeltaPayload(self.version, version, entries, final=final)
        for name, new, new_hash in updates:  # the base moves only once every tensor encoded
            self._held[name].copy_(new)
            self._hashes[name] = new_hash
        self.version = version
        return payload
