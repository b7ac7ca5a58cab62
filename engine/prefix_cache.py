"""A radix tree of token sequences and their KV-cache entries: prefill computes a prompt's shared
prefix once (SGLang's RadixAttention, without its paged memory pool).

A token's cached entry (its MLA latent and indexer keys in every layer) depends only on the tokens
before it, so any request whose prompt starts with tokens the engine already ran can take their
entries and prefill only the rest: the G samples of a GRPO prompt, the next turn of a multi-turn or
agentic rollout (whose prompt is the last turn's prompt, its response and the tool's answer), a
system prompt every request shares (the engine runs such a prefix once for a batch whose prompts
share it, then holds it). The tree holds the sequences the engine prefilled and
generated; each node owns the entries of its edge's tokens (a tuple of tensors whose first dimension
is the token). Entries are only valid for the weights that computed them: the engine clears the tree
whenever its weights change.

``max_tokens`` bounds the tokens held; least recently used leaves go first (a node's entries are
shared by everything below it, so only leaves are evicted, as in SGLang).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Sequence

import numpy as np
import torch

Planes = tuple[torch.Tensor, ...]  # entries of consecutive tokens, token first: (n, ...) each


class _Node:
    __slots__ = ("tokens", "planes", "children", "parent", "stamp")

    def __init__(self, tokens: np.ndarray, planes: Planes | None, parent: "_Node | None", stamp: int):
        self.tokens, self.planes, self.parent, self.stamp = tokens, planes, parent, stamp
        self.children: dict[int, _Node] = {}


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    def __init__(self, max_tokens: int):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"prefix cache: max_tokens must be an int >= 0, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self._clock = itertools.count(1)
        self.clear()

    def clear(self) -> None:
        self._root = _Node(np.zeros(0, dtype=np.int64), None, None, 0)
        self.tokens = 0  # tokens held (each once, however many sequences share it)
        self.bytes = 0

    def match(self, tokens: Sequence[int], limit: int | None = None) -> tuple[int, Planes | None]:
        """The longest prefix of ``tokens`` (at most ``limit`` of them) held: its length and its entries
        (copies, concatenated), or (0, None). Marks the path as used."""
        query = np.asarray(tokens, dtype=np.int64)[: len(tokens) if limit is None else max(limit, 0)]
        stamp, pieces = next(self._clock), []
        for node, n in self._path(query):
            node.stamp = stamp
            pieces.append(tuple(p[:n] for p in node.planes))
        if not pieces:
            return 0, None
        return sum(len(p[0]) for p in pieces), tuple(torch.cat(parts) for parts in zip(*pieces))

    def length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` the tree holds (nothing copied, nothing marked used)."""
        return sum(n for _, n in self._path(np.asarray(tokens, dtype=np.int64)))

    def _path(self, query: np.ndarray):
        """The nodes along ``query``'s longest held prefix, each with how many of its tokens it matches."""
        node, done = self._root, 0
        while done < len(query):
            child = node.children.get(int(query[done]))
            if child is None:
                return
            n = _common(child.tokens, query[done:])
            yield child, n
            done += n
            if n < len(child.tokens):
                return
            node = child

    def insert(self, tokens: Sequence[int], entries: Callable[[int, int], Planes]) -> int:
        """Hold the entries of ``tokens``: ``entries(a, b)`` gives those of ``tokens[a:b]`` (new tensors,
        kept as they are), asked for only when the tree does not hold them all already. Of a sequence
        longer than ``max_tokens`` only the first ``max_tokens`` tokens are held (nothing more could be,
        and a long context's entries are not made only to be dropped). Returns the tokens added; then
        evicts least recently used leaves down to ``max_tokens``."""
        query = np.asarray(tokens, dtype=np.int64)[: self.max_tokens]
        if not len(query):
            return 0
        node, done, stamp = self._root, 0, next(self._clock)
        while done < len(query):
            child = node.children.get(int(query[done]))
            if child is None:
                rest = tuple(entries(done, len(query)))
                if any(p.shape[0] != len(query) - done for p in rest):
                    raise ValueError(f"prefix cache: entries for {[p.shape[0] for p in rest]} of "
                                     f"{len(query) - done} tokens")
                node.children[int(query[done])] = _Node(query[done:].copy(), rest, node, stamp)
                self._count(len(query) - done, rest)
                added = len(query) - done
                break
            n = _common(child.tokens, query[done:])
            if n < len(child.tokens):
                child = self._split(child, n)
            child.stamp = stamp
            done += n
            node = child
        else:
            added = 0
        self._evict()
        return added

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node``'s edge after ``n`` tokens; returns the new upper node (which holds those n)."""
        upper = _Node(node.tokens[:n].copy(), tuple(p[:n].clone() for p in node.planes), node.parent, node.stamp)
        upper.parent.children[int(upper.tokens[0])] = upper
        node.tokens, node.planes, node.parent = node.tokens[n:].copy(), tuple(p[n:].clone() for p in node.planes), upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def _count(self, n: int, planes: Planes, sign: int = 1) -> None:
        self.tokens += sign * n
        self.bytes += sign * sum(p.numel() * p.element_size() for p in planes)

    def _evict(self) -> None:
        if self.tokens <= self.max_tokens:
            return
        leaves = [(n.stamp, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self.tokens > self.max_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[int(leaf.tokens[0])]
            self._count(len(leaf.tokens), leaf.planes, -1)
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.stamp, id(parent), parent))

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def stats(self) -> dict:
        return {"tokens": self.tokens, "bytes": self.bytes, "max_tokens": self.max_tokens}
