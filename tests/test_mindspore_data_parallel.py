"""`orthon launch msrun --worker-num 2 --run -- pretrain ... backend=mindspore` trains data parallel on two
MindSpore CPU workers: each takes half of every global batch, the gradients are summed across them, and
the run is the one a single process makes on the same global batches (losses, held-out loss, final
weights); rank 0 alone writes. Also the launcher's and the torch backend's refusals of a command msrun
cannot run."""
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed (extra: pip install 'orthon[mindspore]')")
if shutil.which("msrun") is None:
    pytest.skip("msrun (MindSpore's launcher) is not on the PATH", allow_module_level=True)

from pretrain_support import free_port, losses, make_stores, orthon, write_recipe  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

STEPS = 3


@pytest.mark.slow  # about 110 s on 2 cores (msrun's scheduler and two MindSpore workers start): the default
def test_two_msrun_workers_train_as_one_process(tmp_path):  # run's longest test by 4x
    stores = make_stores(tmp_path / "data")
    train = {"max_steps": STEPS, "checkpoint_interval": 2, "eval_interval": STEPS, "log_sample_ids": False}
    runs = {"two": tmp_path / "two", "one": tmp_path / "one"}
    two = write_recipe(tmp_path / "two.yaml", stores, runs["two"], train={**train, "micro_batch_size": 2},
                       optim={"ns_dtype": "fp32"})
    one = write_recipe(tmp_path / "one.yaml", stores, runs["one"], train={**train, "micro_batch_size": 4},
                       optim={"ns_dtype": "fp32"})
    proc = orthon("launch", "msrun", "--worker-num", 2, "--master-port", free_port(), "--log-dir", tmp_path / "log",
                  "--cluster-time-out", 120, "--run", "--", "pretrain", "-c", two, "backend=mindspore", "--sample", "")
    assert proc.returncode == 0
    worker_logs = {p.name: p.read_text() for p in (tmp_path / "log").glob("worker_*.log")}
    assert f"done: step {STEPS}" in worker_logs["worker_0.log"] and "done:" not in worker_logs["worker_1.log"]
    orthon("pretrain", "-c", one, "backend=mindspore", "--sample", "")

    records = [json.loads(line) for line in (runs["two"] / "metrics.jsonl").read_text().splitlines()]
    # 2 workers x 2 micro-batches of 2 sequences x 32 tokens: the 256-token global batch of each step
    assert [(r["batch_tokens"], r["micro_batches"]) for r in records if "loss" in r] == [(256, 2)] * STEPS
    reference = losses(runs["one"])
    assert sorted(losses(runs["two"])) == sorted(reference) == list(range(1, STEPS + 1))
    for step, loss in losses(runs["two"]).items():
        assert loss == pytest.approx(reference[step], abs=1e-5), step
    assert reference[STEPS] < reference[1] - 0.3  # the steps did train
    held_out = [[r["final_eval_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                 if "final_eval_loss" in r] for run in (runs["two"], runs["one"])]
    assert held_out[0] == pytest.approx(held_out[1], abs=1e-5) and len(held_out[0]) == 1
    ours, theirs = (load_file(run / "final" / "model.safetensors") for run in (runs["two"], runs["one"]))
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], atol=2e-5, rtol=0, err_msg=name)
    assert sorted(p.name for p in (runs["two"] / "checkpoints").iterdir()) == ["step_2", f"step_{STEPS}"]


def test_msrun_refuses_what_its_workers_cannot_run(tmp_path, capsys):
    from orthon.launch.cli import main

    assert main(["launch", "msrun", "--worker-num", "2", "--", "pretrain", "-c", "configs/tiny.yaml"]) == 2
    assert "backend: msrun's workers run the MindSpore backend; add backend=mindspore" in capsys.readouterr().err
    assert main(["launch", "msrun", "--worker-num", "2", "--", "rl", "-c", "configs/rl_tiny.yaml"]) == 2
    assert "got 'rl' (mid-training and RL run on torch: orthon launch torchrun)" in capsys.readouterr().err
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("10.0.0.1 192.168.1.1 192.168.1.2\n")
    table = tmp_path / "rank_table.json"
    assert main(["launch", "msrun", "--hosts", str(hosts), "--rank-table", str(table), "--", "pretrain", "-c",
                 "configs/tiny.yaml", "backend=mindspore"]) == 2
    assert "only Ascend NPUs read; add mindspore.device_target=Ascend" in capsys.readouterr().err
    assert not table.exists()  # nothing written for a refused command
    assert main(["launch", "msrun", "--worker-num", "2", "--", "pretrain", "-c", "configs/tiny.yaml", "backend=mindspore",
                 "train.expert_parallel=2"]) == 2
    assert "train.expert_parallel = 2: the MindSpore backend's workers are data parallel only" in capsys.readouterr().err
    assert main(["launch", "msrun", "--worker-num", "2", "--", "pretrain", "-c", "configs/tiny.yaml", "backend=mindspore",
                 "train.context_parallel=2"]) == 2
    assert "train.context_parallel = 2: the MindSpore backend's workers are data parallel only" in capsys.readouterr().err
    assert main(["launch", "msrun", "--hosts", str(hosts), "--rank-table", str(table), "--", "pretrain", "-c",
                 "configs/tiny.yaml", "backend=mindspore", "mindspore.device_target=Ascend"]) == 0
    assert table.is_file()


def test_torch_backend_under_msrun_is_refused(tmp_path):
    """A torch run started by msrun would train one full copy a worker into one run directory."""
    stores = make_stores(tmp_path / "data")
    recipe = write_recipe(tmp_path / "r.yaml", stores, tmp_path / "run", train={"max_steps": 1})
    proc = orthon("pretrain", "-c", recipe, check=False, env_extra={"MS_ROLE": "MS_WORKER", "RANK_ID": "0"})
    assert proc.returncode == 2
    assert "started by msrun (MindSpore's launcher), which runs the MindSpore backend: add backend=mindspore" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _worker_pid(marker: str, rank: int) -> int | None:
    """The pid of msrun's worker ``rank`` of the command containing ``marker`` (from /proc: its RANK_ID)."""
    from pathlib import Path

    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or marker not in (proc / "cmdline").read_bytes().decode(errors="replace"):
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"MS_ROLE=MS_WORKER" in environ and f"RANK_ID={rank}".encode() in environ:
            return int(proc.name)
    return None


@pytest.mark.slow
def test_a_stop_signal_to_one_worker_stops_both_after_the_same_step_and_resumes(tmp_path):
    """SIGTERM to worker 1 alone: both workers finish the step, rank 0 saves it and says how to resume;
    `--resume` under msrun continues with the losses of the uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from pretrain_support import ROOT, env

    stores = make_stores(tmp_path / "data")
    train = {"max_steps": 40, "checkpoint_interval": 0, "eval_interval": 0, "log_sample_ids": False,
             "micro_batch_size": 2}
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "stop.yaml", stores, run, train=train, optim={"ns_dtype": "fp32"})
    launch = [sys.executable, "-m", "orthon.launch.cli", "launch", "msrun", "--worker-num", "2", "--master-port",
              str(free_port()), "--log-dir", str(tmp_path / "log"), "--cluster-time-out", "120", "--run", "--"]
    proc = subprocess.Popen(launch + ["pretrain", "-c", str(recipe), "backend=mindspore", "--sample", ""], cwd=ROOT,
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    metrics = run / "metrics.jsonl"
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count('"loss"') >= 2):
        time.sleep(0.5)
    pid = _worker_pid(str(recipe), 1)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    proc.wait(timeout=300)
    log0 = (tmp_path / "log" / "worker_0.log").read_text()
    stopped = [line for line in log0.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stopped) == 1
    step = int(stopped[0].split("after step ")[1].split(",")[0])
    assert f"resume with: orthon pretrain --resume {run} through the same launch (orthon launch msrun ... -- pretrain " \
           f"--resume {run}) (newest checkpoint: step {step})" in stopped[0]
    assert "stopped by" not in (tmp_path / "log" / "worker_1.log").read_text()  # rank 0 speaks
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{step}"]
    first = losses(run)
    assert sorted(first) == list(range(1, step + 1))

    subprocess.run(launch + ["pretrain", "--resume", str(run), f"train.max_steps={step + 2}", "--sample", ""], cwd=ROOT,
                   env=env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, step + 3))
    uninterrupted = tmp_path / "straight"
    straight = write_recipe(tmp_path / "straight.yaml", stores, uninterrupted,
                            train={**train, "max_steps": step + 2, "micro_batch_size": 4}, optim={"ns_dtype": "fp32"})
    orthon("pretrain", "-c", straight, "backend=mindspore", "--sample", "")
    reference = losses(uninterrupted)
    for s in resumed:
        assert resumed[s] == pytest.approx(reference[s], abs=1e-5), s
