"""Ctrl-C during a checkpoint save: held back until the save is complete, then raised."""
import os
import signal

import pytest
import torch

from orthon.core.interrupts import sigint_deferred
from orthon.pretrain.checkpoint import Checkpointer, verify


@pytest.fixture(autouse=True)
def python_handles_sigint():
    """Python's own Ctrl-C handler for each test, whatever the process inherited (a shell's background
    job starts with SIGINT ignored, and Python then never installs its handler)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigint_inside_is_raised_on_leaving():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the body finished")
    assert done == ["the body finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    with sigint_deferred():
        pass  # nothing received: nothing raised


def test_an_exception_from_the_body_wins():
    with pytest.raises(ValueError):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            raise ValueError("the save failed")


def test_ctrl_c_during_a_checkpoint_save_leaves_it_complete(tmp_path, monkeypatch):
    import orthon.pretrain.checkpoint as module

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    real = module.sha256_file

    def interrupted_checksum(path):  # Ctrl-C between the tensors and the manifest
        os.kill(os.getpid(), signal.SIGINT)
        return real(path)

    monkeypatch.setattr(module, "sha256_file", interrupted_checksum)
    ckpt = Checkpointer(tmp_path, log=lambda *_: None)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(1, model, [opt], {"step": 1})
    monkeypatch.undo()
    verify(ckpt.step_dirs()[-1])  # finished, manifest and all
    assert ckpt.latest_good().name == "step_00000001"
