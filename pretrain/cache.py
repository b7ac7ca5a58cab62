"""KV cache for incremental decoding: per layer, the MLA latent [c_kv; k_rope] of every token (the
whole of what absorbed attention reads) and, for layers with an indexer, the indexer keys."""
from __future__ import annotations

import torch

from orthon.pretrain.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, batch_size: int, capacity: int, device=None, dtype=torch.float32):
        width = config.kv_lora_rank + config.qk_rope_head_dim
        self.capacity = capacity
        self.length = 0  # tokens committed; the forward in progress writes at [length, length + T)
        self.latent = [torch.zeros(batch_size, capacity, width, device=device, dtype=dtype)
                       for _ in range(config.num_hidden_layers)]
        self.index_keys = [
            torch.zeros(batch_size, capacity, config.index_head_dim, device=device, dtype=dtype)
            if config.indexer_type(i) == "full" else None
            for i in range(config.num_hidden_layers)
        ]
        # Document of each slot, once any forward passed doc_ids (left padding is document -1).
        self.docs: torch.Tensor | None = None
        self.batch_size, self.device = batch_size, device

    def write_docs(self, doc_ids: torch.Tensor | None, num_new: int) -> torch.Tensor | None:
        """Record the new tokens' documents; returns them (default document 0 once docs are in use)."""
        if doc_ids is None and self.docs is None:
            return None
        if self.docs is None:
            self.docs = torch.zeros(self.batch_size, self.capacity, dtype=torch.long, device=self.device)
        if doc_ids is None:
            doc_ids = torch.zeros(self.batch_size, num_new, dtype=torch.long, device=self.device)
        self.docs[:, self.length : self.length + num_new] = doc_ids
        return doc_ids

    def docs_until(self, end) -> torch.Tensor | None:
        return None if self.docs is None else self.docs[:, : int(end)]

    def slots(self, num_new: int, device=None) -> torch.Tensor:
        if self.length + num_new > self.capacity:
            raise ValueError(
                f"KV cache is full: {self.length} cached + {num_new} new tokens exceed its capacity {self.capacity}"
            )
        return torch.arange(self.length, self.length + num_new, device=device)

    def append(self, layer: int, latent: torch.Tensor, index_keys: torch.Tensor | None):
        """Write this layer's new entries; return everything cached so far for it (views)."""
        end = self.length + latent.shape[1]
        self.latent[layer][:, self.length : end] = latent
        keys = None
        if index_keys is not None and self.index_keys[layer] is not None:
            self.index_keys[layer][:, self.length : end] = index_keys
            keys = self.index_keys[layer][:, :end]
        return self.latent[layer][:, :end], keys

    def advance(self, num_new: int) -> None:
        self.length += num_new

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` tokens a row (a running batch taking a request with a longer response)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return

        def wider(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros((t.shape[0], extra) + tuple(t.shape[2:]))], dim=1)

        self.latent = [wider(t) for t in self.latent]
        self.index_keys = [None if t is None else wider(t) for t in self.index_keys]
        if self.docs is not None:
            self.docs = wider(self.docs)
        self.capacity = capacity

    def drop_front(self, slots: int) -> None:
        """Forget the first ``slots`` slots of every row (left padding of every row still decoding, once
        rows that joined late made the batch's slots outrun its rows' contexts); the tokens cached move
        to the front."""
        if slots <= 0:
            return
        self.latent = [t[:, slots:].contiguous() for t in self.latent]
        self.index_keys = [None if t is None else t[:, slots:].contiguous() for t in self.index_keys]
        if self.docs is not None:
            self.docs = self.docs[:, slots:].contiguous()
        self.length -= slots
        self.capacity -= slots

    def add_rows(self, other: "KVCache", at: int) -> None:
        """Append ``other``'s rows (requests joining a running batch): their ``other.length`` cached
        tokens land at slots [at, at + other.length), which must end where this cache's tokens do; the
        slots before them are left padding (document -1)."""
        if at < 0 or at + other.length != self.length:
            raise ValueError(f"add_rows: {other.length} tokens at slot {at} do not end at this cache's {self.length}")
        n = other.batch_size

        def placed(mine: torch.Tensor, theirs: torch.Tensor, fill: int = 0) -> torch.Tensor:
            rows = mine.new_full((n,) + tuple(mine.shape[1:]), fill)
            rows[:, at:self.length] = theirs[:, : other.length]
            return torch.cat([mine, rows])

        self.latent = [placed(a, b) for a, b in zip(self.latent, other.latent)]
        self.index_keys = [None if a is None else placed(a, b) for a, b in zip(self.index_keys, other.index_keys)]
        if self.docs is None:  # every row so far unpadded: document 0 throughout
            self.docs = torch.zeros(self.batch_size, self.capacity, dtype=torch.long, device=self.device)
        theirs = other.docs if other.docs is not None else torch.zeros(n, other.capacity, dtype=torch.long,
                                                                       device=self.device)
        self.docs = placed(self.docs, theirs, fill=-1)
        self.batch_size += n

    def row_entries(self, row: int, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Slots [start, end) of one row, token first: the latents (n, layers, width) and, where layers
        have an indexer, their keys (n, indexed layers, dim) (what a prefix cache keeps)."""
        latent = torch.stack([t[row, start:end] for t in self.latent], dim=1)
        keys = [t[row, start:end] for t in self.index_keys if t is not None]
        return (latent, torch.stack(keys, dim=1)) if keys else (latent,)

    def write_row_entries(self, row: int, start: int, entries: tuple[torch.Tensor, ...]) -> None:
        """``row_entries``' inverse: write them at slots [start, start + n) of one row."""
        end = start + entries[0].shape[0]
        for layer, t in enumerate(self.latent):
            t[row, start:end] = entries[0][:, layer]
        for k, t in enumerate(t for t in self.index_keys if t is not None):
            t[row, start:end] = entries[1][:, k]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (e.g. drop finished sequences)."""
        self.latent = [t.index_select(0, rows) for t in self.latent]
        self.index_keys = [None if t is None else t.index_select(0, rows) for t in self.index_keys]
        if self.docs is not None:
            self.docs = self.docs.index_select(0, rows)
        self.batch_size = len(rows)
