"""What the training loop calls: stores -> packed -> blended -> sampled batches of tensors.

``TrainData(cfg, rank, world).next_batch(global_batch)`` returns this rank's
slice of the next global batch (the batch size may change every step, as the
batch-size ramp says). Its state is the sampler position plus the exact
per-source token counts, which every rank computes for the whole global batch
(the order is deterministic, so no communication is needed).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from orthon.data.blend import BlendedDataset
from orthon.data.config import DataConfig, StoreSource
from orthon.core.errors import ConfigError, DataError
from orthon.data.packing import PackedDataset
from orthon.data.sampler import Sampler
from orthon.data.store import TokenStore

IGNORE_INDEX = -100


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor  # [b, seq_len] int64
    labels: torch.Tensor  # [b, seq_len] int64, IGNORE_INDEX where not trained on
    doc_ids: torch.Tensor  # [b, seq_len] document of each input position (for document masking)
    sample_ids: torch.Tensor  # [b] stable sample ids (global blend index)
    source_ids: torch.Tensor  # [b] which source each sample came from

    def slice(self, start: int, stop: int) -> "Batch":
        """Rows start:stop (a micro-batch)."""
        return Batch(*(getattr(self, f.name)[start:stop] for f in dataclasses.fields(self)))

    def to(self, device) -> "Batch":
        return Batch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def make_batch(samples: Sequence[tuple[np.ndarray, np.ndarray, int]], sample_ids, document_mask: bool,
               eod_id: int) -> Batch:
    tokens = torch.from_numpy(np.stack([s[0] for s in samples]))
    docs = torch.from_numpy(np.stack([s[1] for s in samples]))
    labels = tokens[:, 1:].clone()
    if document_mask:
        # With attention stopped at the boundary, the token after an eod cannot be predicted.
        labels[tokens[:, :-1] == eod_id] = IGNORE_INDEX
    return Batch(input_ids=tokens[:, :-1].contiguous(), labels=labels, doc_ids=docs[:, :-1].contiguous(),
                 sample_ids=torch.as_tensor(np.asarray(sample_ids), dtype=torch.int64),
                 source_ids=torch.tensor([s[2] for s in samples], dtype=torch.int64))


def open_sources(sources: Sequence[StoreSource], seq_len: int, eod_id: int | None = None):
    """(packed datasets, names, eod id) for a list of stores; the eod id comes from the stores' manifests."""
    if not sources:
        raise DataError("data.sources: no token store given (prepare one with `orthon data prepare`)")
    stores = [TokenStore(s.path) for s in sources]
    eods = {st.eos_id for st in stores if st.eos_id is not None}
    if eod_id is None:
        if len(eods) != 1:
            raise DataError(f"stores disagree on (or lack) an eos id: {sorted(map(str, eods))}; pass eod_id")
        eod_id = eods.pop()
    vocabs = {st.vocab_size for st in stores}
    if len(vocabs) != 1:
        raise DataError(f"stores were tokenised with different vocab sizes {sorted(vocabs)}")
    names = [s.name or Path(s.path).name for s in sources]
    if len(set(names)) != len(names):
        raise DataError(f"source names must differ: {names}")
    return [PackedDataset(st, seq_len, eod_id) for st in stores], names, eod_id


class TrainData:
    def __init__(self, cfg: DataConfig, rank: int = 0, world: int = 1):
        self.cfg, self.rank, self.world = cfg, rank, world
        packed, names, self.eod_id = open_sources(cfg.sources, cfg.seq_len)
        self.vocab_size = packed[0].store.vocab_size
        self.dataset = BlendedDataset(packed, [s.weight for s in cfg.sources], names, cfg.blend_cycle,
                                      cfg.num_samples)
        self.sampler = Sampler(len(self.dataset), cfg.seed, cfg.shuffle)
        self.tokens_by_source = {name: 0 for name in names}

    def next_batch(self, global_batch: int) -> Batch:
        start = self.sampler.position
        for name, n in self.dataset.tokens_by_source(self.sampler.sample_ids(start, start + global_batch)).items():
            self.tokens_by_source[name] += n
        ids = self.sampler.next_batch(global_batch, self.rank, self.world)
        return make_batch([self.dataset[int(j)] for j in ids], ids, self.cfg.document_mask, self.eod_id)

    def skip(self, samples: int) -> None:
        """Move past the next ``samples`` samples without reading them (they count as consumed by nothing)."""
        self.sampler.position += samples

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "tokens_by_source": dict(self.tokens_by_source)}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.tokens_by_source = dict(state["tokens_by_source"])


class ValidData:
    """A fixed held-out set: the first ``max_samples`` packed samples of each valid store, in order."""

    def __init__(self, cfg: DataConfig, max_samples: int = 256, eod_id: int | None = None):
        self.cfg = cfg
        packed, self.names, self.eod_id = open_sources(cfg.valid, cfg.seq_len, eod_id)
        self.items = [(s, i) for s, ds in enumerate(packed) for i in range(min(len(ds), max_samples))]
        self.packed = packed

    def __len__(self) -> int:
        return len(self.items)

    def num_batches(self, batch_size: int, rank: int = 0, world: int = 1) -> int:
        """How many ``batches`` yields."""
        return -(-len(self.items[rank::world]) // batch_size)

    def batches(self, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        """This rank's share (every ``world``-th sample from ``rank``) in batches of ``batch_size``."""
        mine = self.items[rank::world]
        for k in range(0, len(mine), batch_size):
            chunk = mine[k : k + batch_size]
            samples = [(*self.packed[s][i], s) for s, i in chunk]
            ids = [s * (1 << 40) + i for s, i in chunk]
            yield make_batch(samples, ids, self.cfg.document_mask, self.eod_id)


def open_training_data(cfg: DataConfig, vocab_size: int, eval_samples: int, rank: int = 0, world: int = 1):
    """(TrainData, ValidData or None) of a run whose model has ``vocab_size`` token ids: stores tokenised
    with a larger vocabulary are refused before any step."""
    data = TrainData(cfg, rank, world)
    if data.vocab_size > vocab_size:
        raise ConfigError(f"data: the stores' vocabulary ({data.vocab_size}) exceeds model.vocab_size ({vocab_size})")
    return data, ValidData(cfg, eval_samples, data.eod_id) if cfg.valid else None
