"""The trainer's side of weight sync: the new weights to every engine, by the configured path.

Paths (SPEC: four): ``disk`` writes a versioned HF-layout directory that the engines reload;
``distributed`` broadcasts flattened buckets over one process group of the trainer (rank 0) and the
engines (gloo here, NCCL on GPU); ``shared`` (colocated) puts flattened buckets in shared memory that
the engines read without a copy on the way. ``delta`` rides on any of them: after the first full copy
only the changed bytes travel (orthon.engine.delta), as one byte payload that names its base version
and carries checksums, so an engine that holds anything else refuses it and nothing changes.

The first sync, and the one that brings a restarted engine up to date, is a full copy from disk (an
engine of any state can take it); every later one goes by the configured path.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from orthon.core.net import free_port


def _named(model) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors by the names engines take (its state_dict's)."""
    return [(name, t.detach()) for name, t in model.state_dict().items()]


def _each(clients, call) -> list:
    """``call(client)`` for every client at once (a broadcast needs every receiver waiting)."""
    with ThreadPoolExecutor(max(1, len(clients))) as pool:
        return list(pool.map(call, clients))


class WeightSync:
    def __init__(self, cluster, run_dir):
        self.cfg = cluster
        self.root = Path(run_dir) / "weights"
        self.encoder = None  # the delta encoder, once a full copy gave every engine the same bytes
        self.group = None  # the distributed path's process group
        self._members: tuple[str, ...] = ()
        self._shared = None
        self.bytes_sent = 0

    # ------------------------------------------------------------ full copies
    def full(self, model, version: int, client) -> None:
        """A complete copy of ``model`` at ``version`` to one engine (any state), through disk."""
        from orthon.engine.weight_transfer import write_versioned

        path = write_versioned(model, self.root, version)
        client.update_weights(str(path), version=version)

    def _full_all(self, model, version: int, clients) -> None:
        from orthon.engine.delta import DeltaEncoder
        from orthon.engine.weight_transfer import write_versioned

        path = write_versioned(model, self.root, version)
        _each(clients, lambda c: c.update_weights(str(path), version=version))
        if self.cfg.delta:
            self.encoder = DeltaEncoder()
            self.encoder.reset(_named(model), version)

    # ------------------------------------------------------------ every sync
    def push(self, model, version: int, clients) -> None:
        """``model``'s weights to every engine as ``version``. The engines hold the previous version."""
        if self.encoder is None and (self.cfg.delta or self.cfg.weight_sync == "disk"):
            return self._full_all(model, version, clients)
        named = _named(model)
        if self.cfg.delta:
            payload = self.encoder.encode(named, version)
            self.bytes_sent += len(self._send_delta(payload, clients))
        elif self.cfg.weight_sync == "distributed":
            self._broadcast(named, version, clients)
        elif self.cfg.weight_sync == "shared":
            self._share(named, version, clients)
        else:
            self._full_all(model, version, clients)
        if self.cfg.check_weights:
            self.check(named, clients)

    def _send_delta(self, payload, clients) -> bytes:
        data = payload.to_bytes()
        if self.cfg.weight_sync == "distributed":
            blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._broadcast([("__orthon_delta__", blob)], payload.version, clients)
        elif self.cfg.weight_sync == "shared":
            self._share([("__orthon_delta__", torch.frombuffer(bytearray(data), dtype=torch.uint8))],
                        payload.version, clients)
        elif self.cfg.weight_sync == "disk":
            from orthon.core.files import atomic_write_bytes

            path = self.root / f"delta_{payload.version:08d}.bin"
            atomic_write_bytes(path, data)
            _each(clients, lambda c: c.update_weights_from_delta_file(str(path)))
            previous = self.root / f"delta_{payload.version - 1:08d}.bin"
            previous.unlink(missing_ok=True)
        return data

    def _broadcast(self, named, version: int, clients) -> None:
        from orthon.engine.weight_transfer import TensorMeta, broadcast_tensors, open_update_group

        members = tuple(c.url for c in clients)
        if self.group is None or members != self._members:  # (re)form the group: an engine was replaced
            port = free_port()
            calls = lambda i_c: i_c[1].init_weights_update_group("127.0.0.1", port, i_c[0] + 1, len(clients) + 1)
            with ThreadPoolExecutor(len(clients)) as pool:
                joined = pool.map(calls, enumerate(clients))
                self.group = open_update_group("127.0.0.1", port, 0, len(clients) + 1)
                list(joined)
            self._members = members
        metas = [TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in named]
        with ThreadPoolExecutor(len(clients)) as pool:
            received = [pool.submit(c.update_weights_from_distributed, metas, version) for c in clients]
            broadcast_tensors(self.group, named)
            for future in received:
                future.result()

    def _share(self, named, version: int, clients) -> None:
        from orthon.engine.weight_transfer import SharedBuckets

        if self._shared is None:
            self._shared = SharedBuckets()
        handle = self._shared.write(named, version)
        _each(clients, lambda c: c.update_weights_from_shared(handle))

    # ------------------------------------------------------------ debugging
    def check(self, named, clients) -> None:
        """Every engine's hash per tensor equals the trainer's (slime's weight check)."""
        from orthon.core.errors import CheckpointError
        from orthon.engine.weight_transfer import tensor_hashes

        want = tensor_hashes(named)
        for client, got in zip(clients, _each(clients, lambda c: c.weight_hashes())):
            wrong = sorted(name for name in want if got.get(name) != want[name])
            if wrong:
                raise CheckpointError(f"weight check: engine {client.url} differs from the trainer in "
                                      f"{len(wrong)} tensors ({', '.join(wrong[:3])}...)")

