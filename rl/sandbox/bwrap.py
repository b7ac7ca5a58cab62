"""The bubblewrap command line of a sandbox, and whether this machine can run one.

What the sandbox sees: /usr and the interpreter read-only, a few /etc files (the loader cache, the
time zone, the alternatives links that name awk and friends), a fresh /dev and /proc, and its workspace
at /sandbox (also /tmp), the one writable place. Not /root, /home, the project or any other /etc file.
Its own user, PID, network (loopback only), IPC, UTS and cgroup namespaces; no nested user namespaces;
a new session (no terminal to inject keys into); SIGKILL when bwrap or bwrap's parent dies, and the
PID namespace's init going away kills everything in it.

Run as root, RLIMIT_NPROC is not enforced at all (the kernel exempts uid 0 and CAP_SYS_RESOURCE), even
inside a user namespace, whose uid 0 is the host's; so root starts bwrap as ``nobody`` (SANDBOX_UID),
an unprivileged user whose process count inside each sandbox's own user namespace is the job's alone.
It switches through util-linux's ``setpriv`` when there is one: Popen's own ``user=`` would fork the
caller (no vfork with a uid change), about 9 ms from a process with torch loaded against 1.5 ms.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from orthon.core.errors import OrthonError

SANDBOX_UID = SANDBOX_GID = 65534  # nobody: who runs the sandbox when the host runs as root
WORKSPACE = "/sandbox"  # the workspace inside; boot.py names it too
BOOT_SOURCE = (Path(__file__).with_name("boot.py")).read_text()
_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # merged-/usr links, or directories
_ETC = ("ld.so.cache", "localtime", "alternatives")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "TMPDIR": WORKSPACE, "USER": "sandbox",
        "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}


class SandboxUnavailable(OrthonError):
    """This machine cannot run the sandbox (no bwrap, no usable user namespaces, no python3)."""


@dataclass(frozen=True)
class Runtime:
    bwrap: str
    python: str  # the interpreter sandboxed Python runs on
    python_prefix: str | None  # bound read-only when the interpreter lives outside /usr
    run_as: tuple[int, int] | None  # (uid, gid) bwrap is started as; None: the caller's own
    setpriv: str | None  # switches to run_as in front of bwrap; None: Popen(user=...) does


def _python() -> tuple[str, str | None]:
    """The system python3 when there is one: nothing of the project's venv is then reachable. Else this
    interpreter's base installation (not the venv), bound read-only."""
    chosen = os.environ.get("ORTHON_SANDBOX_PYTHON") or ("/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "")
    if chosen:
        real = os.path.realpath(chosen)
        return chosen, None if real.startswith("/usr/") else os.path.dirname(os.path.dirname(real))
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return base, os.path.realpath(sys.base_prefix)


def find_runtime() -> Runtime:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("the sandbox needs bubblewrap: `bwrap` is not on PATH (Debian/Ubuntu: "
                                 "apt-get install bubblewrap)")
    python, prefix = _python()
    if not os.access(python, os.X_OK):
        raise SandboxUnavailable(f"the sandbox's interpreter {python} is not executable (set ORTHON_SANDBOX_PYTHON)")
    run_as = (SANDBOX_UID, SANDBOX_GID) if os.geteuid() == 0 else None
    return Runtime(bwrap, python, prefix, run_as, shutil.which("setpriv") if run_as else None)


def bwrap_argv(runtime: Runtime, workspace: str) -> list[str]:
    """The command that starts one sandbox around boot.py with ``workspace`` (a host directory) as /sandbox."""
    argv = []
    if runtime.run_as is not None and runtime.setpriv:
        uid, gid = runtime.run_as
        argv = [runtime.setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    argv += [runtime.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in _TOP_LEVEL:
        host = "/" + name
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    if runtime.python_prefix:
        argv += ["--ro-bind", runtime.python_prefix, runtime.python_prefix]
    for name in _ETC:
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    argv += ["--dev", "/dev", "--proc", "/proc", "--bind", workspace, WORKSPACE, "--symlink", WORKSPACE, "/tmp",
             "--chdir", WORKSPACE, "--clearenv"]
    for key, value in _ENV.items():
        argv += ["--setenv", key, value]
    # Last: the root and /dev (tmpfs that bwrap builds) read-only, once everything is mounted on them.
    # The workspace's name after the boot source: every process the job forks carries it on its command
    # line, so the host can tell whether anything of this sandbox outlived it (tests, bench/sandbox_hostile.py).
    argv += ["--remount-ro", "/", "--remount-ro", "/dev", runtime.python, "-I", "-c", BOOT_SOURCE,
             os.path.basename(workspace)]
    return argv
