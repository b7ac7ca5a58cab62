"""Packing documents into fixed-length training sequences.

The token stream of a store is every document followed by one
end-of-document (eod) token: ``d0 eod d1 eod d2 eod ...``. Sample ``i`` is the
``seq_len + 1`` stream tokens starting at ``i * seq_len``: inputs are its
first ``seq_len`` tokens, targets its last ``seq_len``. Consecutive samples
share one token, so every stream token but the first is a target exactly
once, and documents run across sample boundaries (no padding, nothing lost
but the tail shorter than a sample).

Each position also carries the index of the document it belongs to (an eod
belongs to the document it ends), so attention can be stopped at document
boundaries (the model's ``orthon.pretrain.attention.document_mask``).
"""
from __future__ import annotations

import numpy as np

from orthon.core.errors import DataError
from orthon.data.store import TokenStore


def stream_starts(offsets: np.ndarray) -> np.ndarray:
    """Where each document starts in the stream with one eod after every document (n_docs + 1 entries)."""
    return offsets + np.arange(len(offsets), dtype=np.int64)


def num_samples(stream_length: int, seq_len: int) -> int:
    """How many ``seq_len + 1`` windows with stride ``seq_len`` fit in a stream."""
    return max(0, (stream_length - 1) // seq_len)


class PackedDataset:
    """Random access to the packed samples of a store: ``ds[i] -> (tokens, doc_ids)``, both ``seq_len + 1`` long."""

    def __init__(self, store: TokenStore, seq_len: int, eod_id: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if not 0 <= eod_id < max(store.vocab_size, 1):
            raise DataError(f"{store.path}: eod id {eod_id} is outside the vocabulary of {store.vocab_size}")
        self.store, self.seq_len, self.eod_id = store, seq_len, eod_id
        self.starts = stream_starts(store.offsets)
        self.stream_length = int(self.starts[-1])
        self.n = num_samples(self.stream_length, seq_len)
        if self.n == 0:
            raise DataError(
                f"{store.path}: {self.stream_length} tokens (with end-of-document tokens) make no sample of "
                f"{seq_len + 1}; use a shorter seq_len or more data"
            )

    def __len__(self) -> int:
        return self.n

    @property
    def dropped_tokens(self) -> int:
        """Stream tokens after the last sample: never trained on in this packing."""
        return self.stream_length - 1 - self.n * self.seq_len

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} out of range [0, {self.n})")
        return self.window(i * self.seq_len, i * self.seq_len + self.seq_len + 1)

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Stream tokens [start, stop) and the document index of each."""
        tokens = np.empty(stop - start, dtype=np.int64)
        doc_ids = np.empty(stop - start, dtype=np.int64)
        d = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            doc_start, doc_end = int(self.starts[d]), int(self.starts[d + 1])  # doc_end - 1 is its eod
            take = min(stop, doc_end)
            lo, hi = pos - doc_start, take - doc_start  # offsets within "doc tokens + eod"
            body_hi = min(hi, doc_end - 1 - doc_start)
            out = pos - start
            if body_hi > lo:
                base = int(self.store.offsets[d])
                tokens[out : out + body_hi - lo] = self.store.read(base + lo, base + body_hi)
            if hi == doc_end - doc_start:
                tokens[out + hi - lo - 1] = self.eod_id
            doc_ids[out : out + hi - lo] = d
            pos = take
            d += 1
        return tokens, doc_ids
