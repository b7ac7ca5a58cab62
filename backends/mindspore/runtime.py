"""MindSpore, imported once and set up: the missing-extra error, the device, the execution mode.

Two things about MindSpore 2.10's wheel that everything else here relies on:

- Its C++ argument parser (libmindspore_common) was compiled against NumPy 1.x and calls NumPy's
  1.x ``import_array`` the first time an op receives a Python sequence. Under NumPy 2 that import
  raises (NumPy refuses a 1.x ABI), the op fails once, and from then on the parser runs without
  NumPy support: ops work, but NumPy scalars are not taken as numbers. ``import_mindspore``
  spends that one failure at import, silently, so no user op sees it; the backend never passes a
  NumPy scalar to an op (arrays go through ``Tensor(ndarray)``, which uses pybind11's NumPy-2-aware
  path). Under NumPy 1.x nothing fails and the priming is a no-op.
- On CPU most ``mindspore.mint`` kernels are not registered (they are Ascend's); the backend uses the
  ``mindspore.ops`` primitives, which run on CPU, GPU and Ascend alike.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os

from orthon.core.errors import ConfigError
from orthon.pretrain.recipe import MindSporeConfig

INSTALL_HINT = "pip install 'orthon[mindspore]' (MindSpore's CPU/Ascend wheel, Python 3.9-3.12)"


def import_mindspore():
    """The ``mindspore`` module, or a ConfigError naming the extra to install."""
    # MindSpore logs at WARNING by default through glog (on stderr); keep its chatter to errors.
    os.environ.setdefault("GLOG_v", "3")
    try:
        import mindspore
    except ImportError as exc:
        raise ConfigError(f"backend mindspore: MindSpore is not installed ({exc}); {INSTALL_HINT}") from None
    probe = mindspore.Tensor([[0.0, 0.0]], mindspore.float32)  # spend the parser's NumPy failure (see above)
    with contextlib.redirect_stderr(io.StringIO()):  # NumPy prints its ABI notice before raising
        try:
            probe.reshape((2, 1))  # a tuple argument: the parser's first NumPy lookup
        except (SystemError, ImportError):
            pass
    return mindspore


ms = import_mindspore()


def place(cfg: MindSporeConfig | None = None) -> None:
    """Select the device (``mindspore.set_device``: CPU here, Ascend 910B NPUs on Atlas nodes) and the
    execution mode (PyNative runs op by op; graph mode compiles what the trainer jits)."""
    cfg = cfg or MindSporeConfig()
    if ms.get_context("device_target") != cfg.device_target or cfg.device_target != "CPU":
        ms.set_device(cfg.device_target, cfg.device_id)
    ms.set_context(mode=ms.GRAPH_MODE if cfg.mode == "graph" else ms.PYNATIVE_MODE)
    if cfg.device_target == "CPU":
        _set_cpu_threads()


@functools.cache  # MindSpore lets a process set them once
def _set_cpu_threads() -> None:
    """The CPU kernels' threads: as many as torch was given (the CLI's --threads / OMP_NUM_THREADS);
    MindSpore's default is 25 whatever the machine has."""
    import torch

    ms.device_context.cpu.op_tuning.threads_num(max(1, torch.get_num_threads()))
