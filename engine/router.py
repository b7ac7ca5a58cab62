"""sglang-router (SGLang's Rust gateway, PyPI ``sglang-router``) in front of the engine servers.

orthon does not route requests itself: it launches this router and drives its worker API. With
``policy="manual"`` a request's ``X-SMG-Routing-Key`` header pins it to one worker (a new key goes to
a worker chosen by ``assignment_mode``; every later request of that key goes to the same one, so a
multi-turn session finds its KV prefix there). Workers join and leave through ``POST /workers``
and ``DELETE /workers/{id}`` while the router runs; the router health-checks them itself too.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from orthon.core.errors import ConfigError
from orthon.core.net import wait_until_healthy


def router_binary() -> str:
    found = shutil.which("sglang-router") or str(Path(sys.executable).with_name("sglang-router"))
    if not Path(found).exists():
        raise ConfigError("sglang-router is not installed: pip install 'orthon[rl]' (or pip install sglang-router)")
    return found


class Router:
    def __init__(self, proc: subprocess.Popen, url: str, timeout_s: float):
        self.proc, self.url, self.timeout_s = proc, url, timeout_s

    @classmethod
    def start(cls, worker_urls: list[str], port: int, host: str = "127.0.0.1", policy: str = "manual",
              assignment_mode: str = "random", timeout_s: float = 60.0, log_dir: str | None = None) -> "Router":
        """Launch the router over ``worker_urls`` and wait until it answers and knows every worker."""
        command = [router_binary(), "launch", "--host", host, "--port", str(port), "--policy", policy,
                   "--worker-urls", *worker_urls, "--log-level", "warn",
                   "--health-check-interval-secs", "1", "--worker-startup-timeout-secs", str(int(timeout_s))]
        if policy == "manual":
            command += ["--assignment-mode", assignment_mode]
        log = open(Path(log_dir) / f"router_{port}.log", "ab") if log_dir else subprocess.DEVNULL
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        router = cls(proc, f"http://{host}:{port}", timeout_s)
        try:
            wait_until_healthy(router.url + "/workers", timeout_s, alive=lambda: proc.poll() is None)
            router.wait_for(set(worker_urls))
        except Exception:
            router.stop()
            raise
        return router

    def workers(self) -> dict[str, str]:
        """{url: worker id} of the workers the router holds."""
        answer = requests.get(self.url + "/workers", timeout=10)
        answer.raise_for_status()
        return {w["url"]: w["id"] for w in answer.json()["workers"]}

    def wait_for(self, urls: set[str], present: bool = True) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            held = set(self.workers())
            if (urls <= held) if present else not (urls & held):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {self.url}: workers {sorted(urls)} not {'added' if present else 'removed'} "
                                   f"after {self.timeout_s:.0f}s")
            time.sleep(0.2)

    def add_worker(self, url: str) -> None:
        requests.post(self.url + "/workers", json={"url": url}, timeout=10).raise_for_status()
        self.wait_for({url})

    def remove_worker(self, url: str) -> None:
        worker_id = self.workers().get(url)
        if worker_id is None:
            return
        requests.delete(f"{self.url}/workers/{worker_id}", timeout=10).raise_for_status()
        self.wait_for({url}, present=False)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
