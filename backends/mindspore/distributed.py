"""Data parallelism for the MindSpore backend over the workers msrun starts (`orthon launch msrun`).

msrun tells each worker its place in the environment (MS_ROLE=MS_WORKER, RANK_ID, MS_WORKER_NUM, and
DEVICE_ID, the device on its node) and starts the same command once more as the cluster's scheduler
(MS_ROLE=MS_SCHED: the CLI runs ``run_scheduler`` there and nothing else). ``DataParallel`` enters the
cluster (HCCL on Ascend, MindSpore's own collectives on CPU). Each rank takes its share of the global
batch and computes the gradient of its share's summed loss; one reduction (``nn.DistributedGradReducer``,
whose all-reduces MindSpore fuses) adds them, and the trainer divides by the global token count: the
step equals one process taking the whole batch. A process not started by msrun is rank 0 of 1 and
nothing here communicates.
"""
from __future__ import annotations

import os

import numpy as np

from orthon.backends.mindspore.runtime import ms
from orthon.core.distributed import launched_by_msrun


def run_scheduler() -> int:
    """The scheduler's whole job: ``init`` serves the workers' rendezvous and returns (or ends the process)
    when they are done. It trains nothing, so it must not run the command it was started with."""
    from mindspore.communication import init

    init()
    return 0


def local_device_id(default: int) -> int:
    """The device this worker drives: msrun's DEVICE_ID (one device a worker), else the recipe's."""
    return int(os.environ["DEVICE_ID"]) if launched_by_msrun() and "DEVICE_ID" in os.environ else default


class DataParallel:
    """This worker's rank and world size, and the sums across workers the training step needs. Create
    it after the device is placed (``runtime.place``) and the model is built."""

    def __init__(self, params):
        self.rank, self.world, self._reducer = 0, 1, None
        if launched_by_msrun():
            from mindspore.communication import get_group_size, get_rank, init

            init()
            self.rank, self.world = get_rank(), get_group_size()
            if self.world > 1:
                self._reducer = ms.nn.DistributedGradReducer(params, mean=False)
                self._all_reduce_sum = ms.ops.AllReduce(ms.ops.ReduceOp.SUM)

    def grads(self, grads: list) -> list:
        """Every worker's gradients added (each rank's gradient of its own summed loss)."""
        return grads if self._reducer is None else list(self._reducer(tuple(grads)))

    def sum(self, values) -> np.ndarray:
        """``values`` (loss sums, token counts, expert loads) added across workers, as float32: the one
        type every device's all-reduce takes (MindSpore's CPU collectives take no integers); a count is
        exact up to 2^24 tokens a step and within 1e-7 beyond."""
        values = np.asarray(values, np.float64)
        if self._reducer is None:
            return values
        return self._all_reduce_sum(ms.Tensor(values.astype(np.float32))).asnumpy().astype(np.float64)

    def max(self, value: int) -> int:
        """The largest signal number (0-64) any worker holds: the stop signal the ranks agree on. A sum of
        one-hot vectors, since MindSpore's CPU all-reduce only sums."""
        if self._reducer is None:
            return value
        flags = np.zeros(65)
        flags[value] = 1.0
        return int(np.flatnonzero(self.sum(flags)).max(initial=0))
