"""Which optimizer updates which parameter, decided from the model's ParamSpecs.

The rule (the GLM-5 recipe; README, "The recipe"): Muon for hidden matrices ("matrix") and expert
stacks ("expert_stack": E matrices, each its own Muon matrix); AdamW for
embeddings, the output head (unless ``head_to_muon``), norm scales and
biases. Muon Split comes from the spec's ``split_rows`` (the model declares
W_QB / W_KVB as one block per head); ``extra_splits`` adds splits by name
pattern for ablations. Every parameter is routed exactly once: a parameter
without a spec, a spec without a parameter, or one tensor under two names
is an error naming it.
"""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from orthon.optim.param_spec import ParamSpec

MUON_KINDS = ("matrix", "expert_stack")
ADAMW_KINDS = ("embedding", "output_head", "norm", "bias")
KIND_NDIM = {"matrix": 2, "expert_stack": 3}


class RoutingError(ValueError):
    """A parameter that cannot be routed; the message names it."""


@dataclass(frozen=True)
class ParamRoute:
    """Where one parameter goes. ``split_rows`` > 1: Muon Split into that many row blocks."""

    name: str
    optimizer: Literal["muon", "adamw"]
    kind: str
    shape: tuple[int, ...]
    split_rows: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def block_shape(self) -> tuple[int, int] | None:
        """Shape of each matrix Newton-Schulz sees (None for AdamW)."""
        if self.optimizer != "muon":
            return None
        return self.shape[-2] // self.split_rows, self.shape[-1]

    @property
    def num_blocks(self) -> int:
        """How many matrices Newton-Schulz sees for this parameter (0 for AdamW)."""
        if self.optimizer != "muon":
            return 0
        return math.prod(self.shape[:-2]) * self.split_rows


@dataclass
class RoutingPlan:
    """The routes in parameter order, and the parameters by name."""

    routes: list[ParamRoute]
    params: dict[str, Tensor] = field(repr=False)

    def select(self, optimizer: str) -> list[ParamRoute]:
        return [r for r in self.routes if r.optimizer == optimizer]

    def totals(self) -> dict[str, dict[str, int]]:
        """Parameter, element and Newton-Schulz block counts per optimizer and overall."""
        out = {}
        for name in ("muon", "adamw"):
            routes = self.select(name)
            out[name] = {
                "params": len(routes),
                "numel": sum(r.numel for r in routes),
                "blocks": sum(r.num_blocks for r in routes),
                "split_params": sum(1 for r in routes if r.split_rows > 1),
            }
        out["total"] = {key: out["muon"][key] + out["adamw"][key] for key in out["muon"]}
        return out


def route_parameters(
    named_parameters: Iterable[tuple[str, Tensor]],
    specs: Mapping[str, ParamSpec],
    *,
    head_to_muon: bool = False,
    muon_split: bool = True,
    extra_splits: Mapping[str, int] | None = None,
    adamw_only: bool = False,
) -> RoutingPlan:
    """Route every named parameter by its spec.

    head_to_muon: send the output head to Muon instead of AdamW.
    muon_split: honour the specs' split_rows (False: plain Muon everywhere).
    extra_splits: {name or fnmatch pattern: row blocks} on Muon parameters.
    adamw_only: everything to AdamW (the AdamW baseline of the ablation).
    """
    params: dict[str, Tensor] = {}
    names_by_tensor: dict[int, str] = {}
    for name, p in named_parameters:
        if name in params:
            raise RoutingError(f"parameter {name!r} is routed twice (its name appears twice)")
        other = names_by_tensor.get(id(p))
        if other is not None:
            raise RoutingError(f"parameter {name!r} is routed twice: it is the same tensor as {other!r}")
        params[name] = p
        names_by_tensor[id(p)] = name
    missing = [n for n in params if n not in specs]
    if missing:
        raise RoutingError(f"parameter {missing[0]!r} is not routed: the model gave no ParamSpec for it"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unknown = [n for n in specs if n not in params]
    if unknown:
        raise RoutingError(f"ParamSpec for {unknown[0]!r} names no parameter of the model")

    extra = dict(extra_splits or {})
    used_patterns: set[str] = set()
    routes = []
    for name, p in params.items():
        spec = specs[name]
        shape = tuple(p.shape)
        if spec.kind not in MUON_KINDS + ADAMW_KINDS:
            raise RoutingError(f"parameter {name!r}: unknown ParamSpec kind {spec.kind!r}")
        if spec.kind in KIND_NDIM and len(shape) != KIND_NDIM[spec.kind]:
            raise RoutingError(
                f"parameter {name!r}: kind {spec.kind!r} needs {KIND_NDIM[spec.kind]} dims, shape is {shape}"
            )
        if spec.split_rows != 1 and spec.kind not in MUON_KINDS:
            raise RoutingError(f"parameter {name!r}: split_rows={spec.split_rows} on a {spec.kind!r} parameter")
        to_muon = spec.kind in MUON_KINDS or (head_to_muon and spec.kind == "output_head" and len(shape) == 2)
        if adamw_only:
            to_muon = False
        split = spec.split_rows if muon_split else 1
        for pattern, blocks in extra.items():
            # A pattern may also match AdamW parameters (a bias beside its weight); those are skipped.
            if to_muon and fnmatch.fnmatchcase(name, pattern):
                used_patterns.add(pattern)
                split = blocks
        if to_muon:
            if not isinstance(split, int) or split < 1:
                raise RoutingError(f"parameter {name!r}: split must be a positive integer, got {split!r}")
            if shape[-2] % split:
                raise RoutingError(f"parameter {name!r}: {split} row blocks do not divide its {shape[-2]} rows")
        routes.append(ParamRoute(name, "muon" if to_muon else "adamw", spec.kind, shape, split if to_muon else 1))
    unused = [p for p in extra if p not in used_patterns]
    if unused and not adamw_only:
        raise RoutingError(f"extra split {unused[0]!r} matches no Muon parameter")
    return RoutingPlan(routes, params)


def format_plan(plan: RoutingPlan) -> str:
    """A table of every parameter (optimizer, kind, shape, split blocks, elements) and the totals."""
    header = ("parameter", "optimizer", "kind", "shape", "newton-schulz blocks", "elements")
    rows = [header]
    for r in plan.routes:
        blocks = "-" if r.optimizer != "muon" else f"{r.num_blocks} x {r.block_shape[0]}x{r.block_shape[1]}"
        if r.split_rows > 1:
            blocks += f" (split {r.split_rows})"
        rows.append((r.name, r.optimizer, r.kind, "x".join(map(str, r.shape)), blocks, f"{r.numel:,}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    totals = plan.totals()
    lines.append("")
    for name in ("muon", "adamw", "total"):
        t = totals[name]
        lines.append(
            f"{name:>6}: {t['params']:5d} parameters  {t['numel']:>18,} elements  "
            f"{t['blocks']:7d} newton-schulz blocks  {t['split_params']:4d} split"
        )
    return "\n".join(lines)
