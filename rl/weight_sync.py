"""The trainer's side of weight sync: the new weights to every engine, by the configured path.

Paths (SPEC: four): ``disk`` writes a versioned HF-layout directory the engines reload; ``distributed``
broadcasts flattened buckets over one process group of the trainer (rank 0) and the engines (gloo
here, NCCL on GPU), the tensors' names, dtypes and shapes going in the HTTP request as SGLang takes
them (the tensor paths name tensors as the HF layout does: routed experts one tensor each); ``shared``
(colocated) puts flattened buckets in shared memory the engines read without a copy on the way.
``delta`` rides on any of them: after a full copy, only the changed bytes travel (orthon.engine.delta),
as one payload that names its base version and carries checksums; the disk path writes it as a file,
the broadcast path sends its bytes over the group, the shared path puts them in shared memory. An
engine that holds anything but the base refuses it and changes nothing.

The first sync, and the one that brings a restarted engine up to date, is a full copy through disk
(an engine in any state can take it). "model" below is what the trainer hands over: the model itself or
the state dict gathered from its ranks' shards; or, where the ranks hold shards (FSDP2, expert
parallelism), what ``form`` asks for so that no process holds the whole model: on the disk path without
delta the version's directory the ranks wrote, a safetensors shard at a time; on the distributed path
without delta ``WeightParts``, loaders the ranks call together, each gathering a part that is broadcast
before the next is gathered (slime's bucket by bucket; an expert stack larger than a part a few experts
at a time), the engines paused in between so no request runs on a mix of versions (a model in pipeline
stages: ``StageParts``, each stage's parts over a group of its own, orthon.rl.stage_sync); with delta, on
either path, ``ShardDeltas``: each rank's delta of the rows it holds, against its own copy of them
(orthon.rl.shard_delta), handed to the engines in rank order, paused, the last payload final. A
streamed sync that fails part way raises ``IncompleteSync`` naming the directory the ranks then write
for a full copy (the parts are gone; the engines may hold a mix of two versions until it is in).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from orthon.core.errors import CheckpointError, EngineUnavailable
from orthon.core.net import service_host
from orthon.engine.delta import DELTA_TENSOR_NAME, DeltaEncoder
from orthon.engine.tensor_bytes import tensor_hashes
from orthon.engine.weight_transfer import (SharedBuckets, TensorMeta, broadcast_bytes, broadcast_tensors,
                                           prune_versions, version_dir, write_delta, write_versioned)
from orthon.pretrain.gathered_weights import drain_on_error
from orthon.pretrain.hf_io import experts_to_hf, load_hf_state
from orthon.rl.engine_group import EngineGroup, together


@dataclass(frozen=True)
class SyncForm:
    """What the trainer ranks hand over where they hold shards: a weights ``directory`` they write,
    ``WeightParts`` of ``part_bytes``, or with delta ``ShardDeltas`` written into ``delta_directory``."""

    directory: Path | None = None
    part_bytes: int = 0
    delta_directory: Path | None = None


@dataclass
class WeightParts:
    """The weights as loaders (orthon.pretrain.gathered_weights.gathered_parts), each called once, in order,
    on rank 0 while the other ranks call theirs: {name: tensor} of one part."""

    loaders: list


@dataclass
class StageParts:
    """A pipelined trainer's version, each stage's parts over its own group: ``run(urls)``, which every rank
    calls at once (orthon.rl.stage_sync.run_stages), returns (parts sent, the failures, the hashes of what
    was sent when checking); ``stages`` and ``sent`` (set once sent) for the counters."""

    run: Callable
    stages: int
    sent: int = 0


@dataclass
class ShardDeltas:
    """One version as each trainer rank's delta payload file (orthon.rl.shard_delta), in rank order, the
    last one final; ``check``: loaders as ``WeightParts``' for check_weights (empty otherwise)."""

    paths: list[Path]
    check: list


class IncompleteSync(Exception):
    """A streamed sync failed part way (every part was still gathered): the ranks write ``directory`` and
    hand it over for a full copy."""

    def __init__(self, directory: Path, why: str):
        super().__init__(f"streamed weight sync failed ({why}); a full copy from {directory} follows")
        self.directory = directory


def _named(weights) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``weights`` (the model, a state dict gathered from FSDP2's shards, or a weights
    directory; or one part of them) as the engines take them: in the HF layout (routed experts one tensor
    each, views of the stacks), as SGLang's loader names them."""
    if isinstance(weights, Path):
        state = load_hf_state(weights)
    else:
        state = weights if isinstance(weights, Mapping) else weights.state_dict()
    return list(experts_to_hf({name: t.detach() for name, t in state.items()}).items())


def _each(clients, call) -> list:
    """``call(client)`` for every client at once (a broadcast needs every receiver waiting)."""
    with ThreadPoolExecutor(max(1, len(clients))) as pool:
        return list(pool.map(call, clients))


def _resume(client) -> None:
    try:
        client.resume()
    except Exception:  # a dead engine: the fleet replaces it
        pass


class WeightSync:
    def __init__(self, cluster, run_dir):
        self.cfg = cluster
        self.root = Path(run_dir) / "weights"
        self.encoder = None  # the delta encoder, once a full copy gave every engine the same bytes
        self.group = EngineGroup(address=service_host(cluster.network))  # the distributed path's process group
        self._shared = None
        self.shard_base: int | None = None  # the version every engine holds that the ranks' deltas start from

    def form(self, version: int, full: bool = False) -> SyncForm | None:
        """What trainer ranks that hold shards hand over as ``version`` (see the module docstring); None:
        the tensors gathered whole (the shared path). ``full``: a whole copy, not a delta (an engine holds
        another version)."""
        if self.cfg.gathers_whole:
            return None
        if self.cfg.delta and not full and self.shard_base is not None:
            return SyncForm(delta_directory=self._directory(version).with_name(f"delta-v{version:08d}"))
        if self.cfg.weight_sync == "distributed" and not self.cfg.delta:
            return SyncForm(part_bytes=self.cfg.part_bytes)
        return SyncForm(directory=self._directory(version))

    def _directory(self, version: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return version_dir(self.root, version)

    # ------------------------------------------------------------ full copies
    def full(self, model, version: int, client) -> None:
        """A complete copy of ``model`` at ``version`` to one engine (any state), through disk."""
        client.update_weights(str(self._on_disk(model, version)), version=version)

    def _on_disk(self, model, version: int) -> Path:
        """``model``'s directory: the one the trainer wrote (a Path), else written here."""
        if isinstance(model, Path):
            prune_versions(self.root)
            return model
        return write_versioned(model, self.root, version)

    def _full_all(self, model, version: int, clients) -> None:
        path = self._on_disk(model, version)
        _each(clients, lambda c: c.update_weights(str(path), version=version))
        self._reset_delta(model, version)

    def _reset_delta(self, model, version: int) -> None:
        """After a full copy every engine holds ``model``'s bytes: the next deltas start from them (a
        directory the ranks wrote: their ShardDeltas, each rank's copy of its own rows)."""
        if not self.cfg.delta:
            return
        if isinstance(model, Path):
            self.encoder, self.shard_base = None, version
        else:
            self.encoder = DeltaEncoder()
            self.encoder.reset(_named(model), version)

    # ------------------------------------------------------------ every sync
    def push(self, model, version: int, clients) -> list[str]:
        """``model``'s weights to every engine as ``version`` (the engines hold the previous one).
        Returns the URLs of engines that could not take them: when anything fails on the way (an engine
        died or hung mid-sync, a broken collective), every engine that still answers gets a full copy
        from disk, so none is left holding something else; the caller replaces the dead ones."""
        if isinstance(model, WeightParts):
            return self._stream(model, version, clients)
        if isinstance(model, StageParts):
            return self._stream_stages(model, version, clients)
        if isinstance(model, ShardDeltas):
            return self._push_shard_deltas(model, version, clients)
        try:
            if (isinstance(model, Path) or self.cfg.weight_sync == "disk" and not self.cfg.delta
                    or self.cfg.delta and self.encoder is None):
                self._full_all(model, version, clients)
            elif self.cfg.delta:
                self._send_delta(self.encoder.encode(_named(model), version), clients)
            elif self.cfg.weight_sync == "distributed":
                self._broadcast(_named(model), version, clients)
            else:
                self._share(_named(model), version, clients)
        except Exception:
            dead = self._recover(model, version, clients)
            clients = [c for c in clients if c.url not in dead]
        else:
            dead = []
        if self.cfg.check_weights:  # a directory is read back whole: a debugging mode
            self.check(tensor_hashes(_named(model)), clients)
        return dead

    def _stream(self, parts: WeightParts, version: int, clients) -> list[str]:
        """Each part broadcast as it is gathered, the engines paused from the first to the last (so no
        request runs on a mix of versions); IncompleteSync when anything fails on the way."""
        want = {}

        def send(loaders):
            group = self.group.formed(clients)
            for i, load in enumerate(loaders):
                named = _named(load())
                if self.cfg.check_weights:
                    want.update(tensor_hashes(named))
                metas = [TensorMeta.of(name, t) for name, t in named]
                last = i == len(loaders) - 1  # the prefix cache is flushed once, with the last part
                together(clients, lambda c: c.update_weights_from_distributed(metas, version, flush_cache=last),
                         lambda: broadcast_tensors(group, named))

        self._while_paused(clients, version, parts.loaders, send)
        if self.cfg.check_weights:
            self.check(want, clients)
        return []

    def _stream_stages(self, parts: StageParts, version: int, clients) -> list[str]:
        """Each pipeline stage's parts over its own group (orthon.rl.stage_sync), the engines paused from
        before the first to after the last; IncompleteSync when anything fails on any rank."""
        failure = None
        try:
            _each(clients, lambda c: c.pause("in_place"))
        except Exception as exc:
            failure = exc
        try:
            # Every rank waits in run(): it runs even when pausing failed, then sending nothing.
            sent, errors, want = parts.run(None if failure else [c.url for c in clients])
            if failure is not None:
                raise failure
            if errors:
                raise RuntimeError("; ".join(errors))
            _each(clients, lambda c: c.flush())  # once every stage is in (the parts flush nothing)
            if self.cfg.check_weights:
                self.check(want, clients)
        except Exception as exc:
            raise IncompleteSync(self._directory(version), f"{type(exc).__name__}: {exc}") from exc
        finally:
            _each(clients, _resume)
        parts.sent = sent
        return []

    def _push_shard_deltas(self, deltas: ShardDeltas, version: int, clients) -> list[str]:
        """Each rank's payload in turn, the engines paused from the first to the last; IncompleteSync when
        anything fails on the way (an engine then holds a mix of two versions: a full copy follows)."""
        base, self.shard_base = self.shard_base, None  # until every payload is in

        def send(check):
            if base is None or None in deltas.paths:
                raise CheckpointError("no delta base" if base is None else "a rank wrote no delta payload")
            for path in deltas.paths:
                self._send_delta_file(path, version, clients)
            if self.cfg.check_weights:
                want = {}
                for load in check:
                    want.update(tensor_hashes(_named(load())))
                self.check(want, clients)

        try:
            self._while_paused(clients, version, deltas.check, send)
        finally:
            for path in deltas.paths:
                if path is not None:
                    path.unlink(missing_ok=True)
        self.shard_base = version
        return []

    def _while_paused(self, clients, version: int, loaders: list, send) -> None:
        """``send(loaders)`` with the engines paused in place, every loader called even when it fails (the
        other ranks wait in their gathers); IncompleteSync naming the version's directory on any failure."""
        def paused(loaders):
            _each(clients, lambda c: c.pause("in_place"))
            send(loaders)

        try:
            drain_on_error(loaders, paused)
        except Exception as exc:
            self.group.close()
            raise IncompleteSync(self._directory(version), f"{type(exc).__name__}: {exc}") from exc
        finally:
            _each(clients, _resume)

    def _recover(self, model, version: int, clients) -> list[str]:
        """Full copies from disk to every engine that answers; the URLs of those that do not."""
        self.group.close()
        dead = []
        for client in clients:
            try:
                self.full(model, version, client)
            except (EngineUnavailable, ValueError):
                dead.append(client.url)
        self._reset_delta(model, version)
        return dead

    def _send_delta(self, payload, clients) -> None:
        if self.cfg.weight_sync == "disk":
            path = write_delta(self.root, payload)
            try:
                self._send_delta_file(path, payload.version, clients)
            finally:
                path.unlink(missing_ok=True)
        elif self.cfg.weight_sync == "distributed":
            self._broadcast_delta(payload.to_bytes(), payload.version, clients)
        else:
            data = torch.frombuffer(bytearray(payload.to_bytes()), dtype=torch.uint8)
            self._share([(DELTA_TENSOR_NAME, data)], payload.version, clients)

    def _send_delta_file(self, path: Path, version: int, clients) -> None:
        """A payload file to every engine: its path on the disk path, its bytes over the group otherwise."""
        if self.cfg.weight_sync == "disk":
            _each(clients, lambda c: c.update_weights_from_delta_file(str(path)))
        else:
            self._broadcast_delta(path.read_bytes(), version, clients)

    def _broadcast_delta(self, data: bytes, version: int, clients) -> None:
        group = self.group.formed(clients)
        together(clients, lambda c: c.update_weights_from_distributed([], version, delta=True),
                 lambda: broadcast_bytes(group, data))

    def _broadcast(self, named, version: int, clients) -> None:
        group = self.group.formed(clients)
        metas = [TensorMeta.of(name, t) for name, t in named]
        together(clients, lambda c: c.update_weights_from_distributed(metas, version),
                 lambda: broadcast_tensors(group, named))

    def _share(self, named, version: int, clients) -> None:
        if self._shared is None:
            self._shared = SharedBuckets()
        handle = self._shared.write(named, version)
        _each(clients, lambda c: c.update_weights_from_shared(handle))  # the engines copy before this returns

    # ------------------------------------------------------------ debugging
    def check(self, want: dict[str, str], clients) -> None:
        """Every engine's hash per tensor equals the trainer's, ``want`` (slime's weight check)."""
        for client, got in zip(clients, _each(clients, lambda c: c.weight_hashes())):
            wrong = sorted(name for name in want if got.get(name) != want[name])
            if wrong:
                raise CheckpointError(f"weight check: engine {client.url} differs from the trainer in "
                                      f"{len(wrong)} tensors ({', '.join(wrong[:3])}...)")
