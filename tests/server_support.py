"""Helpers for the engine-server tests (no tests here): tiny weights directories and `orthon serve`
subprocesses on ports the OS picks, found from the server's "serving ... on http://host:port" line."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_reference import small_model

READY = re.compile(r"serving .* on (http://\S+)")


def tiny_weights(directory: Path, seed: int = 0) -> Path:
    """A 2-layer MoE model of hf_reference's small config (vocab 320: room for the test tokenizer's 300
    ids) saved as a weights directory."""
    from orthon.pretrain.weights import save_weights

    torch.manual_seed(0)
    model = small_model("moe", num_hidden_layers=2, vocab_size=320)
    if seed:
        model.reset_parameters(seed=seed)
    return save_weights(model, directory)


class ServerProcess:
    """`orthon serve WEIGHTS --port 0 ...` in a subprocess (one OpenMP thread); ``url`` once it is ready."""

    def __init__(self, weights: Path, log: Path, *args: str):
        """Starts the server; ``wait()`` for it to listen (start several, then wait for each)."""
        self.log = Path(log)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "orthon.launch.cli", "serve", str(weights), "--port", "0",
                                          *args], stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout_s: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout_s
        while True:
            match = READY.search(self.log.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"orthon serve did not start:\n{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        return self.proc.returncode
