"""sglang-router, launched and driven from Python: SGLang's Rust gateway in front of engine servers
(`orthon serve` here, SGLang servers on a GPU cluster). orthon writes no router of its own.

``Router.start(worker_urls, port, policy="manual")`` starts ``python -m sglang_router.launch_router``
and returns once the router answers and lists every worker healthy. With the manual policy a
request's ``X-SMG-Routing-Key`` header (HTTPEngine sends each request's routing key there) pins its
session to one engine: every request with the key goes to the engine the key's first request went
to, and keys move only when their engine leaves. ``add_worker`` / ``remove_worker`` go through the
router's /workers API (queued jobs there; both wait until the change shows in ``workers()``).

Every wait has a timeout; the router's output goes to ``log_path`` (a temporary file by default),
whose tail is in the error when it does not start.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

from orthon.core.errors import ConfigError, EngineUnavailable
from orthon.core.net import free_port

POLICIES = ("manual", "random", "round_robin", "cache_aware", "power_of_two")


def _normal(url: str) -> str:
    return url.rstrip("/")


class Router:
    def __init__(self, process: subprocess.Popen, url: str, log_path: Path, timeout_s: float, log_start: int = 0):
        self.process, self.url, self.log_path, self.timeout_s = process, url, Path(log_path), timeout_s
        self.log_start = log_start  # where this process's output begins in the log (a retried start appends)

    @classmethod
    def start(cls, worker_urls, port: int, policy: str = "manual", host: str = "127.0.0.1", timeout_s: float = 120.0,
              log_path=None, attempts: int = 3) -> "Router":
        """Launch sglang-router on ``host:port`` over ``worker_urls``; returns once all are healthy there. Its
        metrics port is one free when chosen, which another process may take before the router binds it (a
        run's Ray workers, gloo stores): such a start is retried on a new one, ``attempts`` times in all."""
        if policy not in POLICIES:
            raise ConfigError(f"router policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
        try:
            import sglang_router  # noqa: F401  (only to say what is missing)
        except ImportError:
            raise ConfigError("sglang-router is not installed (pip install 'orthon[rl]')") from None
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="sglang-router-", suffix=".log")
            os.close(handle)
        for attempt in range(attempts):
            try:
                return cls._launch([_normal(u) for u in worker_urls], port, policy, host, timeout_s, Path(log_path))
            except EngineUnavailable as exc:
                if "address already in use" not in str(exc).lower() or attempt == attempts - 1:
                    raise

    @classmethod
    def _launch(cls, workers: list[str], port: int, policy: str, host: str, timeout_s: float, log_path: Path) -> "Router":
        command = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
                   "--policy", policy, "--log-level", "warn", "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(free_port()), "--worker-startup-timeout-secs", str(max(1, int(timeout_s))),
                   "--request-timeout-secs", "600", "--shutdown-grace-period-secs", "5"]
        if workers:
            command += ["--worker-urls", *workers]
        start = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        router = cls(process, f"http://{host}:{port}", log_path, timeout_s, log_start=start)
        try:
            router._wait(lambda: set(workers) <= set(router.workers(healthy_only=True)), timeout_s,
                         f"the router did not list {workers} as healthy")
        except BaseException:
            router.stop()
            raise
        return router

    # ------------------------------------------------------------ the /workers API
    def _api(self, method: str, path: str, payload=None, timeout_s: float = 10.0):
        body = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=body, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as exc:
            raise EngineUnavailable(f"router {self.url}: {method} {path} answered {exc.code}: "
                                    f"{exc.read()[:300].decode(errors='replace')}") from None
        except (OSError, urllib.error.URLError) as exc:
            raise EngineUnavailable(f"router {self.url}: {method} {path}: {exc}") from None
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            raise EngineUnavailable(f"router {self.url}: {method} {path} answered garbage: {raw[:200]!r}") from None

    def _listing(self) -> list[dict]:
        data = self._api("GET", "/workers")
        return data.get("workers", []) if isinstance(data, dict) else []

    def workers(self, healthy_only: bool = False) -> list[str]:
        """The URLs of the workers the router holds (only those it counts healthy, if asked)."""
        return [_normal(w["url"]) for w in self._listing() if not healthy_only or w.get("is_healthy", True)]

    def add_worker(self, url: str, timeout_s: float | None = None) -> None:
        """Register ``url`` and wait until the router routes to it."""
        url = _normal(url)
        self._api("POST", "/workers", {"url": url})
        self._wait(lambda: url in self.workers(healthy_only=True), timeout_s or self.timeout_s,
                   f"worker {url} was not added")

    def remove_worker(self, url: str, timeout_s: float | None = None) -> None:
        """Take ``url`` out of the router (no new requests go to it) and wait until it is gone."""
        url = _normal(url)
        ids = [w.get("id") for w in self._listing() if _normal(w["url"]) == url]
        if not ids:
            return
        for worker_id in ids:  # this router's API names workers by id; older ones by url
            self._api("DELETE", f"/workers/{quote(worker_id or url, safe='')}")
        self._wait(lambda: url not in self.workers(), timeout_s or self.timeout_s, f"worker {url} was not removed")

    def _wait(self, done, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        last = None
        while True:
            if self.process.poll() is not None:
                raise EngineUnavailable(f"sglang-router exited ({self.process.returncode}); {self.log_path}:\n{self._tail()}")
            try:
                if done():
                    return
            except EngineUnavailable as exc:  # not listening yet
                last = exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {timeout_s:g} s ({last or 'no error'}); {self.log_path}:\n{self._tail()}")
            time.sleep(0.2)

    def _tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[self.log_start:].decode(errors="replace")[-chars:]
        except OSError:
            return ""

    # ------------------------------------------------------------ life cycle
    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (the router drains for a few seconds), then SIGKILL if it is still there."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout_s)
        except ProcessLookupError:
            pass
