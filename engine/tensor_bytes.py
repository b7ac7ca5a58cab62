"""A tensor's bytes as the weight-sync paths see them: dtype names, integer views, hashes.

Weight sync compares and moves bytes, never float values: an integer view of the element width makes
NaNs, -0.0 and every bit pattern compare and copy exactly. Shared by the delta payloads
(``orthon.engine.delta``) and the transfer paths (``orthon.engine.weight_transfer``).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np
import torch
import xxhash

from orthon.core.errors import CheckpointError

# Unsigned integer views by element width: unsigned so that differences wrap around (mod 2**bits).
UINT_BY_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the JSON spelling of a dtype."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"dtype {name!r}: not a torch dtype")
    return dtype


def named_list(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a state dict or of an iterable of pairs; a repeated name is refused."""
    items = []
    for item in named.items() if isinstance(named, Mapping) else named:
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected (name, tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__})")
        items.append((name, tensor))
    if len({name for name, _ in items}) != len(items):
        raise CheckpointError(f"a tensor name is given twice: {sorted(n for n, _ in items)[:5]}...")
    return items


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array sharing its memory (writes land in it)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"byte_view needs a contiguous CPU tensor, got one on {tensor.device} "
                         f"(contiguous: {tensor.is_contiguous()})")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def int_kind(dtype: torch.dtype) -> type:
    """The unsigned numpy integer type of ``dtype``'s element width."""
    width = torch.empty(0, dtype=dtype).element_size()
    if width not in UINT_BY_WIDTH:
        raise CheckpointError(f"dtype {dtype_name(dtype)}: {width}-byte elements have no integer view")
    return UINT_BY_WIDTH[width]


def int_view(tensor: torch.Tensor) -> np.ndarray:
    """The elements of a contiguous CPU tensor as unsigned integers of their width, sharing its memory."""
    return byte_view(tensor).view(int_kind(tensor.dtype))


def cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the CPU, contiguous (itself when it already is)."""
    return tensor.detach().to("cpu").contiguous()


def tensor_hash(tensor: torch.Tensor) -> str:
    """xxh3-128 (hex) of a tensor's dtype, shape and bytes: equal exactly when the tensors are
    byte-identical (up to hash collisions). About 15 GB/s on one CPU core; a GPU tensor is copied out."""
    digest = xxhash.xxh3_128()
    digest.update(f"{dtype_name(tensor.dtype)}{tuple(tensor.shape)}".encode())
    digest.update(byte_view(cpu_contiguous(tensor)))
    return digest.hexdigest()


def tensor_hashes(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{name: tensor_hash}: compare two of them to check that every engine holds the trainer's weights."""
    return {name: tensor_hash(tensor) for name, tensor in named_list(named)}
