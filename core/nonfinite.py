"""Steps whose gradient is not finite.

A gradient norm that is inf or NaN (a loss spike past the float range, a bad batch, an overflow under
bf16) would write NaN into every weight, every later step and every later checkpoint (and checkpoint
pruning would then delete the good ones). Such a step is skipped instead: no update, so the weights and
the optimizer's state stay those of the last finite step, while the data position moves on past the
batch; each skip is counted. More than ``limit`` in a row is no longer a spike but a run that has
diverged: it stops with an error naming the steps. Every rank sees the same global norm, so all skip
the same steps."""
from __future__ import annotations

import math
from collections.abc import Callable

from orthon.core.errors import DivergedError


class NonFiniteSteps:
    """The skip decision and its counts (``total`` skipped, ``in_a_row`` ending at the last step), which
    a checkpoint carries so that a resumed run counts on exactly."""

    def __init__(self, limit: int, log: Callable[[str], None] = print, key: str = "train.max_nonfinite_skips"):
        self.limit, self.log, self.key = limit, log, key
        self.total = 0
        self.in_a_row = 0

    def skip(self, step: int, grad_norm: float) -> bool:
        """Whether step ``step`` (the one being taken, counted from 1) is skipped: its gradient norm is
        not finite (said in one line through ``log``). One more than ``limit`` in a row raises DivergedError."""
        if math.isfinite(grad_norm):
            self.in_a_row = 0
            return False
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row > self.limit:
            first = step - self.in_a_row + 1
            span = f"step {step}" if first == step else f"steps {first}-{step}"
            raise DivergedError(
                f"the gradient norm was not finite ({grad_norm}) at {span}, more steps in a row than {self.key} "
                f"= {self.limit} allows: the run has diverged. The weights are those of step {first - 1} "
                f"(a skipped step updates nothing); resume from an earlier checkpoint with a lower learning rate or past "
                f"the data (orthon pretrain --resume RUN --step N --skip-batches K)")
        self.log(f"warning: step {step}: gradient norm {grad_norm}, not finite: skipped (no update; "
                 f"{self.in_a_row} in a row, {self.key} {self.limit})")
        return True

    def state_dict(self) -> dict:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.in_a_row = int(state["total"]), int(state["in_a_row"])
