"""The program that runs inside the sandbox: the system python3 runs this file's text (``-I -c``), waits
for one job on stdin, puts the job's resource limits on itself, then becomes the job: Python source runs
in this process as ``__main__``, a shell command replaces it (``/bin/sh -c``). Limits set here hold for
every process the job starts, because they are set before any of the job's code runs.

Waiting first is what makes a warm sandbox: the namespaces, the mounts and the interpreter are ready before
the job arrives. Standard library only, no orthon: nothing of the project is reachable in the sandbox.

Protocol: once up it writes READY (one byte) to stdout, so the host knows the sandbox started (and
that it started at all) before any of the job's output can follow. Then on stdin: the header's length in
decimal and a newline, the header (JSON: kind, source, limits), then the job's own stdin until EOF.
Without a job (EOF first) it exits 0.
"""
# Everything a job needs from here is imported before READY: part of the warm-up, not of the job.
import builtins
import json
import linecache
import os
import resource
import sys
import traceback
import types

WORKSPACE = "/sandbox"
MAIN = "main.py"  # the name tracebacks give the job's source
READY = b"\x06"


def read_exact(count):
    data = b""
    while len(data) < count:
        chunk = os.read(0, count - len(data))
        if not chunk:
            sys.exit(0)
        data += chunk
    return data


def read_header():
    # Byte by byte up to the newline: the bytes after the header are the job's stdin and must stay unread.
    line = b""
    while not line.endswith(b"\n"):
        line += read_exact(1)
    return json.loads(read_exact(int(line)))


def set_limits(limits):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(usage.ru_utime + usage.ru_stime) + int(limits["cpu_s"])  # the boot's own start-up is not the job's
    pairs = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
        resource.RLIMIT_AS: (limits["memory_bytes"],) * 2,
        resource.RLIMIT_NPROC: (limits["nproc"],) * 2,
        resource.RLIMIT_FSIZE: (limits["file_bytes"],) * 2,
        resource.RLIMIT_NOFILE: (limits["nofile"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, pair in pairs.items():
        resource.setrlimit(which, pair)


def run_python(source):
    # Tracebacks show the job's lines without a file on disk; an entry without mtime is never invalidated.
    linecache.cache[MAIN] = (len(source), None, source.splitlines(True), MAIN)
    main = types.ModuleType("__main__")
    main.__file__ = MAIN
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [MAIN]
    sys.path.insert(0, WORKSPACE)
    try:
        exec(compile(source, MAIN, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # as the interpreter reports an uncaught exception, without this frame
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)


def main():
    os.write(1, READY)
    job = read_header()
    set_limits(job["limits"])
    if job["kind"] == "shell":
        sys.stdout.flush()
        os.execv("/bin/sh", ["sh", "-c", job["source"]])
    run_python(job["source"])


if __name__ == "__main__":
    main()
