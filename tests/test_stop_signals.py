"""A stop signal (SIGTERM: preemption, a job's time limit, torchrun shutting its workers down) ends a run
after the step it arrived in, with a checkpoint of that step from which the run continues exactly; under
torchrun every rank stops after the same step, even when only one received the signal."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain_support import ROOT, env, free_port, losses, make_stores, orthon, resumed_from, write_recipe
from orthon.core.errors import ConfigError
from orthon.core.interrupts import StopRequested, stop_signals_recorded
from orthon.pretrain.checkpoint import Checkpointer, verify
from orthon.pretrain.train_config import TrainConfig


def test_signals_are_recorded_inside_and_the_handlers_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with stop_signals_recorded(["SIGUSR1", "SIGUSR2"]) as received:
        assert received() == 0
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert received() == signal.SIGUSR2  # the first one; the process lives on
    assert signal.getsignal(signal.SIGUSR1) is before
    assert StopRequested("SIGTERM", 7).exit_code == 143 and str(StopRequested("SIGTERM", 7)) == (
        "stopped by SIGTERM after step 7, checkpoint saved")


@pytest.mark.parametrize("names, message", [(["SIGTERM", "SIGNOPE"], "'SIGNOPE' is not a signal name"),
                                            (["SIGINT"], "SIGINT cannot be a stop signal"),
                                            (["SIGKILL"], "SIGKILL cannot be a stop signal")])
def test_bad_stop_signals_are_refused(names, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(stop_signals=names)


def _steps_logged(run: Path, key: str = "loss") -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    return max((r["step"] for r in map(json.loads, path.read_text().splitlines()) if key in r), default=0)


def _start(cmd: list, run: Path, after_steps: int, key: str = "loss", timeout: float = 300) -> subprocess.Popen:
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while _steps_logged(run, key) < after_steps and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be stopped:\n{proc.communicate()[1][-3000:]}"
    return proc


def _stopped_at(run: Path) -> int:
    """The one checkpoint of a run whose checkpoint interval it never reached: the stop's."""
    dirs = Checkpointer(run).step_dirs()
    assert len(dirs) == 1, dirs
    verify(dirs[0])
    return int(dirs[0].name.split("_")[1])


@pytest.mark.parametrize("background", [pytest.param(False, id="foreground-save"),
                                        pytest.param(True, id="background-save", marks=pytest.mark.slow)])
def test_sigterm_saves_the_step_and_the_run_continues_exactly(tmp_path, background):
    """With train.async_checkpoint the stop's checkpoint is written in the background, and the run
    completes it before it exits."""
    stores = make_stores(tmp_path / "data")
    # No interval checkpoint before step 1000: the only checkpoint is the one the signal makes.
    train = {"max_steps": 400, "checkpoint_interval": 1000, "eval_interval": 0}
    run = tmp_path / "run"
    proc = _start([sys.executable, "-m", "orthon.launch.cli", "pretrain", "-c",
                   write_recipe(tmp_path / "r.yaml", stores, run, train={**train, "async_checkpoint": background})],
                  run, after_steps=3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    step = _stopped_at(run)
    assert 3 <= step < 400
    lines = stderr.strip().splitlines()
    assert lines[-1] == (f"orthon pretrain: stopped by SIGTERM after step {step}, checkpoint saved; resume with: "
                         f"orthon pretrain --resume {run} (newest checkpoint: step {step})"), stderr
    assert "Traceback" not in stderr
    assert max(losses(run)) == step  # every finished step logged, none after

    # Resumed from that checkpoint, the next steps are the uninterrupted run's.
    out = orthon("pretrain", "--resume", run, f"train.max_steps={step + 2}")
    assert resumed_from(out.stdout + out.stderr)[1] == step
    reference = tmp_path / "reference"
    orthon("pretrain", "-c", write_recipe(tmp_path / "ref.yaml", stores, reference,
                                          train={**train, "max_steps": step + 2}))
    assert losses(run) == losses(reference)


def _worker_of_rank(torchrun_pid: int, rank: int, timeout: float = 60) -> int:
    """The pid of torchrun's worker process with RANK=rank (from /proc)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        children = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split()
        for pid in children:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no worker with RANK={rank} under torchrun {torchrun_pid}")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds torchrun's workers through /proc")
def test_one_rank_signalled_stops_every_rank_after_the_same_step(tmp_path):
    stores = make_stores(tmp_path / "data")
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", stores, run,
                          train={"max_steps": 400, "checkpoint_interval": 1000, "eval_interval": 0,
                                 "micro_batch_size": 2})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "orthon.launch.cli", "pretrain", "-c", recipe]
    proc = _start(cmd, run, after_steps=3)
    os.kill(_worker_of_rank(proc.pid, 1), signal.SIGTERM)  # rank 1 only; rank 0 hears of it from the all-reduce
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode != 0  # torchrun reports its workers' exit code 143 as a failure
    step = _stopped_at(run)  # one checkpoint, both ranks' shares in it (the DCP save is collective)
    assert f"orthon pretrain: stopped by SIGTERM after step {step}, checkpoint saved" in stderr, stderr[-3000:]
    assert (f"resume with: orthon pretrain --resume {run} through the same launch (orthon launch torchrun ... -- "
            f"pretrain --resume {run})") in stderr, stderr[-3000:]
    assert "exitcode  : 143" in stderr, stderr[-3000:]
    out = orthon("pretrain", "--resume", run, f"train.max_steps={step + 1}", "train.micro_batch_size=4")
    assert resumed_from(out.stdout + out.stderr)[1] == step


@pytest.mark.slow  # about 30 s; the RL loop reaches the same stop_if_signalled as the step loop
def test_rl_stops_after_the_iteration_with_a_checkpoint(tmp_path):
    import yaml

    from test_rl_loop import _pretrain_dir, _recipe

    pre, run = _pretrain_dir(tmp_path), tmp_path / "rl"
    recipe = _recipe(tmp_path, run, 200)
    config = yaml.safe_load(recipe.read_text())
    config["train"]["checkpoint_interval"] = 1000
    recipe.write_text(yaml.safe_dump(config))
    proc = _start([sys.executable, "-m", "orthon.launch.cli", "rl", "-c", recipe, "--from", pre], run,
                  after_steps=1, key="reward_mean")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    iteration = _steps_logged(run, "reward_mean")
    assert 1 <= iteration < 200
    assert stderr.strip().splitlines()[-1] == (f"orthon rl: stopped by SIGTERM after iteration {iteration}, checkpoint "
                                               f"saved; resume with: orthon rl -c {recipe} --resume"), stderr[-3000:]
    verify(Checkpointer(run).step_dirs()[-1])
    # Two more iterations: a stop after the first leaves a run of 2 optimizer steps at 1 + 1, which the
    # recipe's 2 warmup steps do not fit (refused as a config error).
    out = orthon("rl", "-c", recipe, "--resume", f"rl.iterations={iteration + 2}")
    assert f"resumed RL at iteration {iteration}" in out.stdout + out.stderr


def test_no_stop_signals_means_no_handler_and_no_check():
    from orthon.core.step_loop import stop_if_signalled

    before = signal.getsignal(signal.SIGTERM)
    with stop_signals_recorded([]) as received:
        assert received is None and signal.getsignal(signal.SIGTERM) is before
        stop_if_signalled(received, None, 3, lambda: False, lambda: pytest.fail("nothing to save"))
    with stop_signals_recorded(["SIGUSR1"]) as received:
        os.kill(os.getpid(), signal.SIGUSR1)
        saved = []
        with pytest.raises(StopRequested, match="stopped by SIGUSR1 after iteration 3") as stop:
            stop_if_signalled(received, None, 3, lambda: False, lambda: saved.append(3), unit="iteration")
        assert saved == [3] and stop.value.exit_code == 128 + signal.SIGUSR1
