"""torch.profiler over a window of training steps (``train.profile_from_step``, ``train.profile_steps``).

The window's steps are traced (CPU ops, and CUDA kernels where there is a GPU, with shapes and the
Python stack); when it closes, each rank writes ``rank{R}.trace.json`` (open it in Perfetto or
chrome://tracing) and ``rank{R}_ops.txt`` (the ops ranked by their own time) into
``RUN_DIR/profile/steps_{A}-{B}/``. The step before the window runs under the profiler as its warm-up,
so that the first traced step is not the profiler's own start."""
from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule


class StepProfiler:
    """``step()`` after every training step; None-like (``enabled`` False) when no window is set."""

    def __init__(self, run_dir, first: int, steps: int, rank: int = 0, done: int = 0, log=print):
        self.enabled = first > 0 and done < first + steps - 1  # a resumed run past the window traces nothing
        self.first, self.steps, self.rank, self.log = first, steps, rank, log
        self.folder = Path(run_dir) / "profile" / f"steps_{first}-{first + steps - 1}"
        self._prof = None
        if not self.enabled:
            return
        warmup = 1 if first - done > 1 else 0
        active = min(steps, first + steps - 1 - done)  # resumed inside the window: the rest of it
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, record_shapes=True, with_stack=True,
                             schedule=schedule(wait=max(first - done - 1 - warmup, 0), warmup=warmup,
                                               active=active, repeat=1),
                             on_trace_ready=self._write)
        self._prof.__enter__()

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def _write(self, prof) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}.trace.json"
        prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        (self.folder / f"rank{self.rank}_ops.txt").write_text(table + "\n")
        self.log(f"profiled steps {self.first}-{self.first + self.steps - 1}: {trace} (Perfetto / chrome://tracing), "
                 f"{self.folder / f'rank{self.rank}_ops.txt'}")
