"""A multi-turn session as a tree of message nodes, kept token-exact ("token in, token out").

Each node holds one message's token ids exactly as the engine saw them (prompt, observations) or
produced them (assistant turns, with their rollout log-probs). The next turn's prompt is the path's
ids plus the new messages' ids, so generated tokens are never re-tokenised. When the context of the
next turn is not that (the chat template renders the conversation differently, e.g. with
``clear_thinking``, or re-encoding a generated turn gives other ids than were sampled), the session
forks: a new branch starts at the deepest node whose ids still agree, and the old branch keeps its
ids unchanged. Every branch becomes one training sample whose tokens are exactly what the engine saw
and generated along it, its loss mask 1 on the tokens generated in that branch only, so every
generated token is trained once, in the context it was generated in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Node:
    ids: list[int]
    parent: "Node | None" = None
    generated: bool = False  # sampled by the engine (trained on) or given (prompt, observation)
    log_probs: torch.Tensor | None = None  # fp32 rollout log-probs of generated ids
    depth_ids: int = 0  # ids on the path up to and including this node

    def path(self) -> list["Node"]:
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


class Trajectory:
    def __init__(self, prompt_ids: list[int], session_id: str):
        self.session_id = session_id
        self.root = Node(list(prompt_ids), depth_ids=len(prompt_ids))
        self.head = self.root
        self.forks = 0
        self._leaves_closed: list[Node] = []  # heads of branches that were forked away from

    def ids(self, node: Node | None = None) -> list[int]:
        return [i for n in (node or self.head).path() for i in n.ids]

    def _add(self, parent: Node, ids, generated=False, log_probs=None) -> Node:
        return Node(list(ids), parent, generated, log_probs, depth_ids=parent.depth_ids + len(ids))

    def add_generated(self, ids: list[int], log_probs: torch.Tensor) -> Node:
        """The engine's response to the current context, as sampled."""
        self.head = self._add(self.head, ids, True, torch.as_tensor(log_probs, dtype=torch.float32))
        return self.head

    def continue_with(self, context: list[int]) -> list[int]:
        """Make ``context`` (the full prompt of the next turn, however it was built) the current path:
        appended when the current path's ids are its prefix (ids the engine did not sample: observations,
        role headers), else a fork from the deepest node that agrees (counted). Returns ``context``."""
        path = self.ids()
        if context[: len(path)] == path:
            if len(context) > len(path):
                self.head = self._add(self.head, context[len(path):])
            return context
        self.forks += 1
        self._leaves_closed.append(self.head)
        node = self.head
        while node.parent is not None and self.ids(node) != context[: node.depth_ids]:
            node = node.parent
        if self.ids(node) != context[: node.depth_ids]:
            raise ValueError(f"session {self.session_id}: the new context does not start with the prompt")
        self.head = self._add(node, context[node.depth_ids:]) if len(context) > node.depth_ids else node
        return context

    def branches(self) -> list[Node]:
        """The leaf of every branch (forked-away ones first, the current one last)."""
        return [*self._leaves_closed, self.head]

    def branch_sample(self, leaf: Node, owned: set[int]) -> dict:
        """One branch as sample fields: tokens, response_length (all after the prompt), loss_mask
        (1 on the generated ids not already trained in an earlier branch: ``owned`` holds their node
        ids and grows) and rollout_log_probs (0 where the mask is 0)."""
        nodes = leaf.path()
        prompt = nodes[0].ids
        mask, log_probs, tokens = [], [], list(prompt)
        for node in nodes[1:]:
            train = node.generated and id(node) not in owned
            if train:
                owned.add(id(node))
            tokens += node.ids
            mask += [1 if train else 0] * len(node.ids)
            log_probs.append(node.log_probs if train else torch.zeros(len(node.ids)))
        lp = torch.cat(log_probs) if log_probs else torch.zeros(0)
        return {"tokens": tokens, "response_length": len(tokens) - len(prompt), "loss_mask": mask,
                "rollout_log_probs": lp}
