"""Steps not to apply: a gradient that is not finite, and (optionally) a spike.

A gradient norm that is inf or NaN (a loss spike past the float range, a bad batch, an overflow under
bf16) would write NaN into every weight, every later step and every later checkpoint (and checkpoint
pruning would then delete the good ones). Such a step is skipped instead: no update, so the weights and
the optimizer's state stay those of the last applied step, while the data position moves on past the
batch; each skip is counted. More than ``limit`` non-finite steps in a row is no longer a spike but a
run that has diverged: it stops with an error naming the steps.

With ``spike_sigma`` > 0 a finite step is skipped too when its gradient norm or its loss lies more
than that many standard deviations above the mean of the last ``window`` steps' (OLMo 2's skipped
steps; at least half a window of history first). Every step's finite values enter the window, skipped
or not, so a lasting change of level stops counting as a spike after a few steps.

Every rank sees the same global norm and loss, so all skip the same steps."""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable

from orthon.core.errors import DivergedError


class StepGuard:
    """The skip decision and its state (counts, the recent norms and losses), which a checkpoint
    carries so that a resumed run decides exactly as the uninterrupted one."""

    def __init__(self, limit: int, spike_sigma: float = 0.0, window: int = 128,
                 log: Callable[[str], None] = print, key: str = "train.max_nonfinite_skips"):
        self.limit, self.spike_sigma, self.window, self.log, self.key = limit, spike_sigma, window, log, key
        self.total = 0  # steps skipped, for either reason
        self.in_a_row = 0  # non-finite steps in a row, ending at the last step
        self.history = {"grad_norm": deque(maxlen=window), "loss": deque(maxlen=window)}

    def skip(self, step: int, grad_norm: float, loss: float | None = None) -> bool:
        """Whether step ``step`` (the one being taken, counted from 1) is skipped (said in one line through
        ``log``). One non-finite step more than ``limit`` in a row raises DivergedError."""
        values = {"grad_norm": grad_norm, "loss": loss}
        if not all(v is None or math.isfinite(v) for v in values.values()):
            self._nonfinite(step, values)
            return True
        self.in_a_row = 0
        measured = {k: v for k, v in values.items() if v is not None}
        sigmas = {k: self._sigmas(k, v) for k, v in measured.items()}  # against the steps before this one
        spikes = {k: z for k, z in sigmas.items() if z > self.spike_sigma}
        judged = {k: len(self.history[k]) for k in spikes}
        for key, value in measured.items():
            self.history[key].append(value)
        if self.spike_sigma > 0 and spikes:
            self.total += 1
            said = ", ".join(f"{k} {values[k]:.4g} is {z:.1f} sigma above the last {judged[k]} steps' mean"
                             for k, z in spikes.items())
            self.log(f"warning: step {step}: {said}: skipped as a spike (no update; train.spike_sigma {self.spike_sigma})")
            return True
        return False

    def _sigmas(self, key: str, value: float) -> float:
        past = self.history[key]
        if self.spike_sigma <= 0 or len(past) < max(self.window // 2, 2):
            return -math.inf
        spread = statistics.pstdev(past)
        return (value - statistics.fmean(past)) / spread if spread > 0 else -math.inf

    def _nonfinite(self, step: int, values: dict) -> None:
        self.total += 1
        self.in_a_row += 1
        said = ", ".join(f"{k} {v}" for k, v in values.items() if v is not None and not math.isfinite(v))
        if self.in_a_row > self.limit:
            first = step - self.in_a_row + 1
            span = f"step {step}" if first == step else f"steps {first}-{step}"
            raise DivergedError(
                f"not finite ({said}) at {span}, more steps in a row than {self.key} = {self.limit} allows: the run "
                f"has diverged. The weights are those of step {first - 1} (a skipped step updates nothing); resume "
                f"from an earlier checkpoint with a lower learning rate or past the data (orthon pretrain --resume "
                f"RUN --step N --skip-batches K)")
        self.log(f"warning: step {step}: {said}, not finite: skipped (no update; {self.in_a_row} in a row, "
                 f"{self.key} {self.limit})")

    def state_dict(self) -> dict:
        return {"total": self.total, "in_a_row": self.in_a_row, "history": {k: list(v) for k, v in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.in_a_row = int(state["total"]), int(state["in_a_row"])
        for key, values in state.get("history", {}).items():  # absent from checkpoints before spike skipping
            self.history[key] = deque(values, maxlen=self.window)
