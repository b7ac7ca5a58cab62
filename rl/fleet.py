"""The engine fleet: `orthon serve` processes on Ray, the router in front, a health monitor, weight sync.

Each engine server is an ``orthon serve`` process supervised by a small Ray actor on its node (slime
starts its SGLang servers the same way), so an engine can die, hang or be killed without taking an
actor's state with it. The fleet lives in the trainer's process, beside the weights it hands out:

- ``start()``: the servers (one placement-group bundle each), then sglang-router over them.
- ``sync(model, version)``: the configured weight-sync path to every engine (orthon.rl.weight_sync;
  ``form(version)``: what trainer ranks that hold shards hand over instead of the whole model); a sync
  and a restart never interleave.
- the monitor thread polls every engine's ``/health`` each ``health_interval_s``; after
  ``health_failures`` failed polls in a row the engine is taken out of the router, its process killed
  and started again, brought to the current weights (a full copy from disk) and added back; where the
  last sync was streamed (nothing on disk to copy), it joins the router after the next sync instead.
  Requests it had in flight fail at the router; the rollout manager queues their prompts again, whole.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

from orthon.core.net import free_port, service_host, wait_until_healthy


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when its supervisor dies (Linux), so no server outlives
    its actor, whatever killed that."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _tail(path: Path, lines: int = 5) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class EngineServer:
    """Supervises one ``orthon serve`` process (wrapped in ``ray.remote`` by the fleet)."""

    def __init__(self, weights_dir: str, log_dir: str, threads: int = 1, max_batch_size: int = 64,
                 network: str = "local", startup_timeout_s: float = 180.0, prefix_cache_tokens: int = 65536):
        self.weights_dir, self.log_dir, self.threads = weights_dir, Path(log_dir), threads
        # Its address as this node has it (resolved here, on the engine's node): ClusterConfig.network.
        self.max_batch_size, self.host, self.startup_timeout_s = max_batch_size, service_host(network), startup_timeout_s
        self.prefix_cache_tokens = prefix_cache_tokens
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, attempts: int = 3) -> str:
        """Start the server on a free port. The port is free when chosen but the server binds it later, and
        another process may take it in between (the run's Ray workers, gloo stores): such a start is
        retried on a new port, ``attempts`` times in all."""
        for attempt in range(attempts):
            try:
                return self._start_on(free_port(self.host))
            except RuntimeError as exc:
                if "address already in use" not in str(exc).lower() or attempt == attempts - 1:
                    raise

    def _start_on(self, port: int) -> str:
        self.url_ = f"http://{self.host}:{port}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"engine_{port}.log"
        log = open(log_path, "ab")
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orthon.launch.cli", "serve", self.weights_dir, "--host", self.host,
             "--port", str(port), "--max-batch-size", str(self.max_batch_size),
             "--prefix-cache-tokens", str(self.prefix_cache_tokens)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        try:
            wait_until_healthy(self.url_ + "/health", self.startup_timeout_s, alive=lambda: self.proc.poll() is None)
        except RuntimeError as exc:  # it exited: say why, from the end of its log
            self.stop()
            raise RuntimeError(f"{exc}; the end of {log_path}:\n{_tail(log_path)}") from None
        except Exception:
            self.stop()
            raise
        return self.url_

    def url(self) -> str:
        return self.url_

    def pid(self) -> int:
        return self.proc.pid

    def restart(self) -> str:
        self.stop()
        return self.start()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


class EngineFleet:
    def __init__(self, cluster, weights_dir: str, run_dir: Path, sync, client_factory, placement=None, log=print):
        """``cluster``: the ClusterConfig; ``weights_dir``: what new engines start from; ``sync``: the
        WeightSync (push / full); ``client_factory(url) -> Engine`` (an HTTP engine client);
        ``placement(i)``: the Ray scheduling strategy of engine i (a placement-group bundle)."""
        self.placement = placement
        self.cfg, self.weights_dir, self.run_dir = cluster, weights_dir, Path(run_dir)
        self.sync_path, self.client_factory, self.log = sync, client_factory, log
        self.actors, self.urls, self.router = [], [], None
        self.version, self.model = 0, None  # what the engines hold; the model they were synced from
        self.waiting: set[str] = set()  # restarted engines out of the router until a sync brings them up to date
        self.counters = Counter()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    # ------------------------------------------------------------ life cycle
    def start(self) -> str:
        """Start the engines (and the router); returns the URL rollouts send requests to."""
        import ray

        server = ray.remote(num_cpus=self.cfg.engine_threads)(EngineServer)
        args = (self.weights_dir, str(self.run_dir / "engines"), self.cfg.engine_threads,
                self.cfg.engine_max_batch_size, self.cfg.network, self.cfg.startup_timeout_s,
                self.cfg.engine_prefix_cache_tokens)
        self._server = lambda i: (server.options(scheduling_strategy=self.placement(i)) if self.placement else server).remote(*args)
        self.actors = [self._server(i) for i in range(self.cfg.engines)]
        self.urls = ray.get([a.url.remote() for a in self.actors])
        if self.cfg.router:
            from orthon.engine.router import Router

            host = service_host(self.cfg.network)  # the rollout manager may run on another node
            self.router = Router.start(self.urls, free_port(host), policy="manual", host=host)
        self._monitor = threading.Thread(target=self._watch, name="engine-monitor", daemon=True)
        self._monitor.start()
        self.log(f"engines: {', '.join(self.urls)}" + (f" behind the router at {self.router.url}" if self.router else ""))
        return self.router.url if self.router else self.urls[0]

    def stop(self) -> None:
        import ray

        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(self.cfg.health_interval_s * 3)
        if self.router is not None:
            self.router.stop()
        ray.get([a.stop.remote() for a in self.actors])

    def pids(self) -> list[int]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    # ------------------------------------------------------------ weights
    def form(self, version: int):
        """What trainer ranks that hold shards hand over as ``version`` (WeightSync.form): a whole copy
        while a restarted engine waits (it holds no version a delta could start from)."""
        return self.sync_path.form(version, full=bool(self.waiting))

    def sync(self, model, version: int) -> None:
        """The weights (the model, a state dict gathered from FSDP2's shards, or what ``form`` asked for)
        to every engine; an engine that could not take them is restarted with them. A streamed sync that
        failed raises IncompleteSync (after the engines are resumed) for the trainer's full copy."""
        from orthon.rl.weight_sync import IncompleteSync, ShardDeltas, StageParts, WeightParts

        with self._lock:
            streamed = isinstance(model, (WeightParts, ShardDeltas, StageParts))
            # Parts are used up as they are sent: a restart then waits for the next sync.
            self.version, self.model = version, None if streamed else model
            if isinstance(model, WeightParts):
                self.counters["streamed_parts"] += len(model.loaders)
            elif isinstance(model, ShardDeltas):
                self.counters["delta_payloads"] += len(model.paths)
            try:
                dead = self.sync_path.push(model, version, [self.client_factory(u) for u in self.urls])
            except IncompleteSync:
                self.counters["failed_syncs"] += 1
                raise
            if isinstance(model, StageParts):  # each stage over its own group
                self.counters["streamed_parts"] += model.sent
                self.counters["stage_groups"] = model.stages
            for url in dead:
                self.counters["failed_syncs"] += 1
                self.replace(self.urls.index(url), url)
            for url in self.waiting & set(self.urls):
                if self.router is not None:
                    self.router.add_worker(url)
                self.log(f"engine {url} joins with weight version {version}")
            self.waiting.clear()

    # ------------------------------------------------------------ health
    def _healthy(self, url: str) -> bool:
        try:
            return bool(self.client_factory(url).health().get("ok", False))
        except Exception:
            return False

    def _watch(self) -> None:
        failures = Counter()
        while not self._stop.wait(self.cfg.health_interval_s):
            for i, url in enumerate(list(self.urls)):
                if self._healthy(url):
                    failures[i] = 0
                    continue
                failures[i] += 1
                self.counters["failed_polls"] += 1
                if failures[i] >= self.cfg.health_failures and not self._stop.is_set():
                    self.replace(i, url)
                    failures[i] = 0

    def replace(self, i: int, old: str) -> str:
        """Take engine ``i`` (at ``old``) out, restart it, bring it to the current weights, put it back.
        Nothing to do when it was replaced already (the monitor and a failed sync both saw it die)."""
        import ray

        with self._lock:
            if self.urls[i] != old:
                return self.urls[i]
            self.log(f"engine {old} is not answering: restarting it")
            if self.router is not None:
                self.router.remove_worker(old)
            try:
                url = ray.get(self.actors[i].restart.remote(), timeout=self.cfg.startup_timeout_s + 30)
            except Exception:  # the supervising actor itself is gone: a new one
                ray.kill(self.actors[i], no_restart=True)
                self.actors[i] = self._server(i)
                url = ray.get(self.actors[i].url.remote(), timeout=self.cfg.startup_timeout_s + 30)
            self.urls[i] = url
            self.counters["engine_restarts"] += 1
            if self.model is None and self.version > 0:  # the last sync was streamed: nothing to copy
                self.waiting.add(url)
                self.log(f"engine restarted at {url}; it joins at the next weight sync")
                return url
            if self.model is not None:
                self.sync_path.full(self.model, self.version, self.client_factory(url))
            if self.router is not None:
                self.router.add_worker(url)
            self.log(f"engine restarted at {url} with weight version {self.version}")
            return url
