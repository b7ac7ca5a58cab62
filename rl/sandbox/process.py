"""One sandbox process: bwrap around boot.py with a fresh workspace, started at once, then given one job.

Starting and running are separate so that a pool can start sandboxes ahead of time (pool.py); a cold
call starts one and gives it the job at once. The host side reads stdout and stderr with a cap (the rest
is read and thrown away, so the job never blocks on a full pipe) and stops waiting at the wall timeout:
then it kills bwrap's process group, and with it (--die-with-parent) the PID namespace's init, whose end
kills every process left in the namespace.
"""
from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

from orthon.core.errors import DataError
from orthon.rl.sandbox.bwrap import Runtime, SandboxUnavailable, bwrap_argv
from orthon.rl.sandbox.limits import SandboxLimits
from orthon.rl.sandbox.result import SandboxResult, classify

_CHUNK = 1 << 16
READY = b"\x06"  # what boot.py writes once it is up
START_TIMEOUT_S = 60.0  # a sandbox that is not up by then is broken, not slow
KINDS = ("python", "shell")


def _plain_relative(path: str, what: str, allow_dirs: bool) -> None:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or (len(parts) > 1 and not allow_dirs):
        raise DataError(f"sandbox job: {what} {path!r} must be a relative path inside the workspace"
                        + ("" if allow_dirs else " with no directory part"))


@dataclass
class Job:
    kind: str  # "python": source runs as __main__; "shell": /bin/sh -c source
    source: str
    stdin: bytes = b""
    files: dict[str, bytes | str] = field(default_factory=dict)  # written into the workspace first
    collect: tuple[str, ...] = ()  # workspace files read back into SandboxResult.files (top level only)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DataError(f"sandbox job: kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise DataError(f"sandbox job: source must be a str, got {type(self.source).__name__}")
        if isinstance(self.stdin, str):
            self.stdin = self.stdin.encode()
        for path in self.files:
            _plain_relative(path, "file", allow_dirs=True)
        for name in self.collect:
            # Top level only: a directory part could be a symlink the job planted, and the host (maybe root)
            # would follow it; the last part is opened with O_NOFOLLOW.
            _plain_relative(name, "collected file", allow_dirs=False)


def _exchange(proc: subprocess.Popen, payload: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Feed ``payload`` to stdin and read stdout / stderr until both end and the process exits, or the
    deadline passes. Returns (stdout, stderr, truncated, timed_out)."""
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    kept = {out_fd: bytearray(), err_fd: bytearray()}
    truncated = timed_out = False
    os.set_blocking(in_fd, False)
    view, sent = memoryview(payload), 0
    with selectors.DefaultSelector() as selector:
        selector.register(out_fd, selectors.EVENT_READ)
        selector.register(err_fd, selectors.EVENT_READ)
        selector.register(in_fd, selectors.EVENT_WRITE)
        reading = 2
        while reading:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(remaining):
                if key.fd == in_fd:
                    try:
                        sent += os.write(in_fd, view[sent:sent + _CHUNK])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the job ended or closed its stdin: the rest is not wanted
                        sent = len(view)
                    if sent >= len(view):
                        selector.unregister(in_fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    reading -= 1
                    continue
                buffer = kept[key.fd]
                room = cap - len(buffer)
                if len(chunk) > room:
                    truncated = True
                    chunk = chunk[:max(room, 0)]
                buffer += chunk
    if not timed_out:
        try:  # both pipes ended; the job closing them is not the job ending
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    return bytes(kept[out_fd]), bytes(kept[err_fd]), truncated, timed_out


def _read_back(workspace: str, names: tuple[str, ...], cap: int) -> tuple[dict[str, bytes], bool]:
    """Regular files the job left, each cut at ``cap`` bytes; never through a symlink, never blocking on a FIFO."""
    files, cut = {}, False
    for name in names:
        try:
            fd = os.open(os.path.join(workspace, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            data = bytearray()
            while len(data) <= cap and (chunk := os.read(fd, _CHUNK)):
                data += chunk
        finally:
            os.close(fd)
        cut |= len(data) > cap
        files[name] = bytes(data[:cap])
    return files, cut


def _make_removable(root: str) -> None:
    """A job may leave directories without write or search permission; the root user ignores that, anyone
    else has to give them back first. Symlinks are skipped: chmod would follow them out of the workspace."""
    for path, dirs, _ in os.walk(root):
        for name in dirs:
            child = os.path.join(path, name)
            if not os.path.islink(child):
                try:
                    os.chmod(child, 0o700)
                except OSError:
                    pass


class SandboxProcess:
    """A started sandbox waiting for its one job; ``close`` (or the end of ``run``) kills and cleans it."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.workspace = tempfile.mkdtemp(prefix="orthon_sandbox_")
        kwargs = {}
        if runtime.run_as is not None:
            os.chown(self.workspace, *runtime.run_as)
            if not runtime.setpriv:
                kwargs = {"user": runtime.run_as[0], "group": runtime.run_as[1], "extra_groups": []}
        try:
            self.proc = subprocess.Popen(bwrap_argv(runtime, self.workspace), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                         start_new_session=True, **kwargs)
        except BaseException:
            shutil.rmtree(self.workspace, ignore_errors=True)
            raise
        self.used = False
        self.ready = False
        self._stderr_tail = b""
        self._ready_lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def poll_ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the sandbox is up, waiting up to ``timeout_s`` for it; raises SandboxUnavailable (and
        cleans up) when it ended instead, with bwrap's own message."""
        with self._ready_lock:  # a pool may ask while a caller is about to use it
            return self._poll_ready(timeout_s)

    def _poll_ready(self, timeout_s: float) -> bool:
        if not self.ready:
            with selectors.DefaultSelector() as selector:
                selector.register(self.proc.stdout.fileno(), selectors.EVENT_READ)
                if not selector.select(timeout_s):
                    return False
            first = os.read(self.proc.stdout.fileno(), 1)
            if first != READY:
                self._stop(read_stderr=True)
                message = self._stderr_tail.decode(errors="replace").strip()
                self.close()
                raise SandboxUnavailable(f"the sandbox did not start (exit code {self.proc.returncode}): {message!r}")
            self.ready = True
        return True

    def _seed(self, files: dict[str, bytes | str]) -> None:
        # Before the job runs, the workspace holds only what this process put there: no link to follow.
        for path, content in files.items():
            target = os.path.join(self.workspace, path)
            parent = os.path.dirname(target)
            if parent != self.workspace and not os.path.isdir(parent):
                os.makedirs(parent)
                if self.runtime.run_as is not None:
                    for part in _parents_below(self.workspace, parent):
                        os.chown(part, *self.runtime.run_as)
            with open(target, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
            if self.runtime.run_as is not None:
                os.chown(target, *self.runtime.run_as)

    def run(self, job: Job, limits: SandboxLimits) -> SandboxResult:
        if self.used:
            raise RuntimeError("a sandbox runs one job; start another")
        self.used = True
        try:
            if not self.poll_ready(START_TIMEOUT_S):
                raise SandboxUnavailable(f"the sandbox was not up after {START_TIMEOUT_S:.0f} s")
            self._seed(job.files)
            header = json.dumps({"kind": job.kind, "source": job.source, "limits": limits.for_boot()}).encode()
            start = time.monotonic()
            out, err, truncated, timed_out = _exchange(self.proc, b"%d\n" % len(header) + header + job.stdin,
                                                       start + limits.timeout_s, limits.output_bytes)
            wall = time.monotonic() - start
            exit_code = None if timed_out else self.proc.returncode
            status, signal_name = classify(exit_code, timed_out)
            self._stop()
            files, cut = _read_back(self.workspace, job.collect, limits.output_bytes)
            return SandboxResult(status, exit_code, out.decode(errors="replace"), err.decode(errors="replace"),
                                 wall, truncated or cut, signal_name, files)
        finally:
            self.close()

    def _stop(self, read_stderr: bool = False) -> None:
        if self.proc.poll() is None:
            try:  # bwrap's group; the namespace's init follows it (die-with-parent) and takes the rest along
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        if read_stderr:  # bwrap has ended: its stderr reaches EOF unless something in it lives on
            with selectors.DefaultSelector() as selector:
                selector.register(self.proc.stderr.fileno(), selectors.EVENT_READ)
                if selector.select(1.0):
                    self._stderr_tail = os.read(self.proc.stderr.fileno(), 4096)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._stop()
        if os.path.isdir(self.workspace):
            if os.geteuid() != 0:
                _make_removable(self.workspace)
            shutil.rmtree(self.workspace, ignore_errors=True)


def _parents_below(root: str, path: str) -> list[str]:
    out = []
    while path != root:
        out.append(path)
        path = os.path.dirname(path)
    return out
