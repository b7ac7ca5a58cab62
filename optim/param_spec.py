"""What the model says about each of its parameters, for the optimizer.

The optimizer never guesses from parameter names: the model returns a
``ParamSpec`` for every named parameter (``model.param_specs()``), and the
routing rule reads only these.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ParamKind = Literal["embedding", "output_head", "norm", "bias", "matrix", "expert_stack"]


@dataclass(frozen=True)
class ParamSpec:
    """kind: what the parameter is.

    - ``matrix``: a 2-D hidden weight (rows = out features, cols = in features).
    - ``expert_stack``: a 3-D stack of E expert matrices (E, rows, cols); each
      expert is its own matrix for Muon.
    - ``embedding`` / ``output_head`` / ``norm`` / ``bias``: the AdamW kinds.

    split_rows: Muon Split. The matrix is cut into this many equal row blocks
    (for W_QB and W_KVB: one block per attention head), each orthogonalised
    and scaled on its own. 1 means no split.
    """

    kind: ParamKind
    split_rows: int = 1
