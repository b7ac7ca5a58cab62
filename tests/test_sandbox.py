"""The sandbox for model-written code (orthon.rl.sandbox): what a job gets back, what it cannot reach, the
limits it runs under, warm pools, the CLI, and the hostile corpus.

The machine is shared (other workers, this test run), so the limits that contain the fork bomb and the
10 GB allocation are first shown to hold with harmless probes (200 sleeping processes under a process
limit of 32, an allocation over a 64 MB address space, the PID namespace); the bombs take the
``limits_hold`` fixture and never run when a probe failed."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orthon.core.errors import ConfigError, DataError, OrthonError
from orthon.rl.sandbox import Job, SandboxLimits, SandboxPool, run_code, run_shell, sandbox_problem
from orthon.rl.sandbox.check import require_runtime
from orthon.rl.sandbox.hostile import CORPUS, PROBE_NPROC, check_limits, corpus_limits, processes_with
from orthon.rl.sandbox.process import SandboxProcess
from orthon.rl.sandbox.result import SandboxResult, classify, observation
from pretrain_support import ROOT, orthon

pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")


def _marker() -> str:
    return f"{4000 + os.getpid() % 1000}.{time.monotonic_ns() % 10**9}"


def _gone(marker: str, within_s: float = 5.0) -> bool:
    """No host process carries ``marker`` (the namespace's last processes end just after bwrap does)."""
    deadline = time.monotonic() + within_s
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not processes_with(marker)


# ---------------------------------------------------------------- pure parts


def test_limits_are_checked_and_sent_to_the_boot():
    assert SandboxLimits(timeout_s=2.5, memory_mb=64, nproc=8, file_mb=3).for_boot() == {
        "cpu_s": 3, "memory_bytes": 64 << 20, "nproc": 8, "file_bytes": 3 << 20, "nofile": 256}
    assert SandboxLimits(timeout_s=9, cpu_s=0.2).for_boot()["cpu_s"] == 1
    for bad in ({"timeout_s": 0}, {"memory_mb": -1}, {"output_bytes": float("nan")}, {"nproc": True}, {"cpu_s": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SandboxLimits(**bad)
    with pytest.raises(ConfigError, match="nproc must be >= 2"):
        SandboxLimits(nproc=1)


@pytest.mark.parametrize("exit_code, timed_out, status, sig", [
    (0, False, "ok", None), (1, False, "error", None), (3, False, "error", None),
    (139, False, "killed", "SIGSEGV"), (137, False, "killed", "SIGKILL"), (152, False, "timeout", "SIGXCPU"),
    (None, True, "timeout", None), (0, True, "timeout", None), (200, False, "error", None),
])
def test_classify(exit_code, timed_out, status, sig):
    assert classify(exit_code, timed_out) == (status, sig)


def test_observation_keeps_head_and_tail_within_its_budget():
    failed = SandboxResult("error", 1, "a" * 10, "Traceback\nZeroDivisionError\n", 0.1, False)
    assert observation(failed, 1000) == ("aaaaaaaaaa\nTraceback\nZeroDivisionError\n[exit code 1]", False)
    assert observation(SandboxResult("ok", 0, "hi\n", "", 0.1, False), 100) == ("hi\n", False)
    assert observation(SandboxResult("killed", 139, "", "", 0.1, False, "SIGSEGV"), 100) == ("[killed by SIGSEGV]", False)
    # 120 = 8 head + 42 note + 9 tail + 61 for the two end lines; cut by the sandbox as well, so counted.
    long = SandboxResult("timeout", None, "0123456789" * 10, "", 10.0, True)
    assert observation(long, 120) == ("01234567\n[... 100 characters, the middle cut ...]\n123456789\n"
                                      "[output cut at the sandbox's limit]\n[timed out after 10.0 s]", True)
    assert observation(SandboxResult("ok", 0, "x" * 50, "", 0.1, False), 10) == ("", True)


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "perl"}, "kind must be one of"),
    ({"files": {"/etc/x": "1"}}, "relative path"),
    ({"files": {"a/../../x": "1"}}, "relative path"),
    ({"collect": ("sub/out.txt",)}, "no directory part"),
    ({"collect": ("..",)}, "relative path"),
])
def test_bad_jobs_are_refused_by_name(kwargs, message):
    with pytest.raises(DataError, match=message):
        Job(**{"kind": "python", "source": "pass", **kwargs})


# ---------------------------------------------------------------- what a job gets back


def test_python_job_output_exit_code_traceback_and_stdin():
    result = run_code("import sys\nprint(sys.stdin.read().upper())\nprint('to err', file=sys.stderr)\n", stdin="abc")
    assert (result.status, result.exit_code, result.stdout, result.stderr) == ("ok", 0, "ABC\n", "to err\n")
    assert not result.truncated and result.signal is None
    result = run_code("def f():\n    return 1 / 0\n\nf()\n")
    assert (result.status, result.exit_code) == ("error", 1)
    # The interpreter's own report, with the job's lines and no frame of the boot program.
    assert result.stderr.splitlines()[1:4] == ['  File "main.py", line 4, in <module>', "    f()",
                                               '  File "main.py", line 2, in f']
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero") and "boot" not in result.stderr
    assert run_code("raise SystemExit(7)").exit_code == 7
    assert run_code("print(1)", stdin=b"y" * (4 << 20)).stdout == "1\n"  # stdin it never reads: no hang
    result = run_code("x = (")
    assert result.status == "error" and "SyntaxError" in result.stderr


def test_shell_job_workspace_files_in_and_out():
    result = run_shell("cat in/a.txt | tr a-z A-Z > up.txt; pwd; printf 'x' > second.txt; exit 4",
                       files={"in/a.txt": "hello\n"}, collect=("up.txt", "second.txt", "missing.txt"))
    assert (result.status, result.exit_code, result.stdout) == ("error", 4, "/sandbox\n")
    assert result.files == {"up.txt": b"HELLO\n", "second.txt": b"x"}


def test_collecting_never_follows_a_link_out_or_blocks_on_a_fifo():
    # As root the host could read anything a link points at: /etc/hostname exists on the host, not inside.
    result = run_shell("ln -s /etc/hostname link.txt; mkfifo fifo.txt; echo ok > plain.txt",
                       collect=("link.txt", "fifo.txt", "plain.txt"))
    assert result.status == "ok" and result.files == {"plain.txt": b"ok\n"}


def test_output_and_collected_files_are_cut_at_the_cap():
    result = run_code("import sys\nprint('a' * 100)\nprint('b' * 100, file=sys.stderr)\nopen('f', 'w').write('c' * 50)",
                      output_bytes=10, collect=("f",))
    assert (result.status, result.stdout, result.stderr, result.files) == ("ok", "a" * 10, "b" * 10, {"f": b"c" * 10})
    assert result.truncated
    assert not run_code("print('a' * 9)", output_bytes=10).truncated


def test_only_the_workspace_is_writable_and_the_host_is_invisible(monkeypatch):
    monkeypatch.setenv("ORTHON_TEST_SECRET", "hunter2")
    probe = (
        "import os\n"
        "for path in ['/x', '/usr/x', '/etc/x', '/dev/x', '/dev/shm/x', '/proc/x', '/tmp/t', '/sandbox/s', 'here']:\n"
        "    try:\n        open(path, 'w').close()\n        print('wrote', path)\n"
        "    except OSError:\n        print('refused', path)\n"
        "print(os.getcwd(), sorted(os.listdir('/')))\nprint(dict(os.environ))\n"
    )
    result = run_code(probe, collect=("t", "s", "here"))
    lines = result.stdout.splitlines()
    assert lines[:9] == ["refused /x", "refused /usr/x", "refused /etc/x", "refused /dev/x", "refused /dev/shm/x",
                         "refused /proc/x", "wrote /tmp/t", "wrote /sandbox/s", "wrote here"]
    assert set(result.files) == {"t", "s", "here"}  # /tmp is the workspace too
    cwd, top = lines[9].split(" ", 1)
    assert cwd == "/sandbox" and not {"'root'", "'home'", "'work'", "'opt'", "'var'"} & set(top.strip("[]").split(", "))
    assert "hunter2" not in result.stdout and "ORTHON" not in result.stdout
    assert not os.path.exists("/usr/x") and not os.path.exists("/x")


def test_a_job_that_closes_its_pipes_still_times_out():
    # End of output is not the end of the job: the wall timeout still applies.
    result = run_code("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)\n", timeout_s=1)
    assert result.status == "timeout" and result.exit_code is None
    assert result.wall_s < 15  # it stopped at the timeout, not after the sleep


def test_cpu_limit_ends_a_busy_job_as_a_timeout():
    result = run_code("while True:\n    pass\n", timeout_s=20, cpu_s=1)
    assert (result.status, result.signal) in (("timeout", "SIGXCPU"), ("killed", "SIGKILL"))
    assert result.wall_s < 15


# ---------------------------------------------------------------- limits: harmless probes first


@pytest.fixture(scope="module")
def limits_hold():
    """The probes (orthon.rl.sandbox.hostile.probes) pass, or every test that needs them fails unrun."""
    marker = _marker()
    problems = check_limits(marker)
    left = _gone(marker)
    if problems or not left:
        pytest.fail(f"the sandbox's limits do not hold: {problems}; sleepers left: {processes_with(marker)}")
    return True


def test_harmless_probes_show_the_limits_hold(limits_hold):
    assert limits_hold
    # The process count is the namespace's own: 30 more sleepers under a limit of 32 with init and the job.
    marker = _marker()
    result = run_code("import subprocess\nn = 0\nfor _ in range(200):\n    try:\n"
                      f"        subprocess.Popen(['sleep', '{marker}'])\n        n += 1\n    except OSError:\n"
                      "        pass\nprint(n)\n", nproc=PROBE_NPROC, timeout_s=20)
    assert result.stdout == f"{PROBE_NPROC - 2}\n"
    assert _gone(marker)


# ---------------------------------------------------------------- the hostile corpus


@pytest.fixture(scope="module")
def host():
    """What the snippets are aimed at: a listener on 127.0.0.1, a host process that must survive, the
    project's own files, a marker to find left-behind processes by."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    sentinel = subprocess.Popen(["sleep", "600"])
    context = {"port": listener.getsockname()[1], "marker": _marker(), "project_file": str(ROOT / "README.md")}
    yield context, listener, sentinel
    sentinel.kill()
    sentinel.wait()
    listener.close()


@pytest.mark.parametrize("item", CORPUS, ids=[item.name for item in CORPUS])
def test_hostile_snippet_is_contained(item, host, request):
    if item.bomb:
        request.getfixturevalue("limits_hold")
    context, listener, sentinel = host
    limits = corpus_limits(item)
    start = time.monotonic()
    sandbox = SandboxProcess(require_runtime())
    tag = os.path.basename(sandbox.workspace)  # on the command line of every process of this sandbox
    result = sandbox.run(Job("python", item.source.format(**context)), limits)
    assert result.status == item.status, result
    assert _gone(tag) and not os.path.exists(sandbox.workspace)  # nothing of it outlives the call
    assert time.monotonic() - start < limits.timeout_s + 20  # bounded: a generous margin over its timeout
    assert sentinel.poll() is None  # the host's processes are untouched
    if item.name.startswith("read") or item.name == "list /root":
        assert "FileNotFoundError" in result.stderr and result.stdout == ""
    if item.name == "write outside its directory":
        assert "Read-only file system" in result.stderr
        assert not os.path.exists(f"/usr/orthon_escape_{context['marker']}")
    if item.name.startswith("socket"):
        assert ("ConnectionRefusedError" if "127" in item.name else "Network is unreachable") in result.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's listener
    if item.name == "print 1 GB":
        assert result.truncated and result.stdout == "x" * limits.output_bytes
    if item.name == "ctypes crash":
        assert result.signal == "SIGSEGV" and result.exit_code == 128 + signal.SIGSEGV
    if item.name == "os.kill of its parent":
        assert result.stdout == "still here\n"  # its parent is the namespace's init, which ignores it
    if item.name == "10 GB allocation":
        assert result.stderr.rstrip().endswith("MemoryError")
    if item.name == "sleeping child left behind":
        assert result.stdout == "left it\n" and _gone(context["marker"])


def test_killing_the_host_kills_its_sandboxes():
    # A host that dies without cleaning up (SIGKILL) still takes its sandboxes along: --die-with-parent.
    # Only its workspace stays behind (nobody is left to remove it): here in a directory of the test's own,
    # one the sandbox's user can reach as it can /tmp.
    import shutil
    import tempfile

    marker = _marker()  # through the environment: the host's own command line must not carry it
    workspaces = tempfile.mkdtemp(prefix="orthon_test_host_")
    os.chmod(workspaces, 0o755)
    script = "import os\nfrom orthon.rl.sandbox import run_shell\nrun_shell('sleep ' + os.environ['MARKER'], timeout_s=120)\n"
    host = subprocess.Popen([sys.executable, "-c", script],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "MARKER": marker, "TMPDIR": workspaces})
    try:
        deadline = time.monotonic() + 60
        while not processes_with(marker) and time.monotonic() < deadline and host.poll() is None:
            time.sleep(0.05)
        assert processes_with(marker), "the sandboxed sleep never started"
    finally:
        host.kill()
        host.wait()
        gone = _gone(marker, within_s=10)
        shutil.rmtree(workspaces, ignore_errors=True)
    assert gone


# ---------------------------------------------------------------- warm pool


def test_pool_runs_each_job_in_a_fresh_warm_sandbox():
    with SandboxPool(2) as pool:
        assert pool.wait_ready(60)
        first = pool.run(Job("python", "import builtins\nbuiltins.leak = 1\nopen('left.txt', 'w').write('x')\n"
                                       "import subprocess\nsubprocess.Popen(['sleep', '600'])\nprint('one')"),
                         SandboxLimits(timeout_s=20))
        assert pool.wait_ready(60)
        second = pool.run(Job("python", "import builtins, os\nprint(hasattr(builtins, 'leak'), os.listdir('.'))\n"
                                        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"),
                          SandboxLimits(timeout_s=20))
        assert (first.status, first.stdout) == ("ok", "one\n")
        assert (second.status, second.stdout) == ("ok", "False []\n[1, 2]\n")  # no state, file or process of the first
        assert (pool.warm_calls, pool.cold_calls) == (2, 0)
        idle = list(pool._idle)
        workspaces = [s.workspace for s in idle]
    assert idle and all(not s.alive() for s in idle) and not any(os.path.exists(w) for w in workspaces)


def test_pool_from_many_threads_and_short_lived_callers():
    # Warm sandboxes are started by the pool's own thread: callers that come and go do not kill them.
    import threading

    with SandboxPool(2) as pool:
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(
            pool.run(Job("python", f"print({i} * 2)"), SandboxLimits(timeout_s=30)))) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r.stdout for r in results) == sorted(f"{2 * i}\n" for i in range(6))
        assert all(r.status == "ok" for r in results)
        assert pool.wait_ready(60)
        assert pool.run(Job("shell", "echo warm"), SandboxLimits()).stdout == "warm\n"
        assert pool.warm_calls >= 1 and pool.warm_calls + pool.cold_calls == 7


def test_a_forked_child_never_uses_or_ends_the_parents_pool():
    import orthon.rl.sandbox.run as run_module

    shared = run_module.shared_pool()
    with SandboxPool(1) as pool:
        assert pool.wait_ready(60)
        pid = os.fork()
        if pid == 0:  # the child: the parent's pool refuses, closing it is a no-op, the shared pool is forgotten
            code = 1
            try:
                try:
                    pool.run(Job("python", "pass"), SandboxLimits())
                except OrthonError as exc:
                    code = 0 if "belongs to the parent" in str(exc) and run_module._shared is None else 2
                pool.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert pool.run(Job("python", "print(1)"), SandboxLimits()).stdout == "1\n"  # still the parent's, warm
        assert (pool.warm_calls, pool.cold_calls) == (1, 0)
    assert run_module.shared_pool() is shared


# ---------------------------------------------------------------- CLI


def test_cli_prints_one_json_object(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\nraise SystemExit(3)\n")
    (tmp_path / "in.txt").write_text("1 2 39")
    proc = orthon("sandbox", "run", program, "--stdin", tmp_path / "in.txt", "--timeout", "20", "--memory", "128")
    out = json.loads(proc.stdout)
    assert out == {"status": "error", "exit_code": 3, "signal": None, "stdout": "42\n", "stderr": "",
                   "wall_s": out["wall_s"], "truncated": False}
    proc = orthon("sandbox", "run", tmp_path / "nosuch.py", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"orthon sandbox: {tmp_path / 'nosuch.py'}: cannot read the file to run (No such file or directory)")
    proc = orthon("sandbox", "run", program, "--memory", "0", check=False)
    assert proc.returncode == 2 and "memory_mb must be a positive number" in proc.stderr


def test_the_project_is_not_reachable_from_the_sandbox():
    # Whatever the interpreter, nothing of the repository or its venv is mounted.
    result = run_code(f"import os\nprint(os.path.exists({str(ROOT)!r}), os.path.exists({str(Path(sys.prefix))!r}))\n"
                      "import importlib.util\nprint(importlib.util.find_spec('orthon'), importlib.util.find_spec('torch'))")
    assert result.stdout == "False False\nNone None\n"
