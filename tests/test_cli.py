"""What the command line prints when things go wrong: one line, never a traceback."""
import json
import signal
import subprocess
import sys
import time

import pytest

from pretrain_support import ROOT, env, make_stores, orthon, write_recipe
from orthon.launch.threads import pick_threads


def _one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_orthon_errors_are_one_line_with_exit_code_2(tmp_path):
    proc = orthon("generate", tmp_path / "nosuch", check=False)
    assert proc.returncode == 2
    assert _one_line(proc) == (f"orthon generate: {tmp_path / 'nosuch'}: no such run directory (give the "
                               f"train.run_dir of a finished run, e.g. runs/tiny after `orthon pretrain -c configs/tiny.yaml`)")
    proc = orthon("generate", tmp_path / "nosuch", "--prompt", "", check=False)
    assert proc.returncode == 2
    assert _one_line(proc) == 'orthon generate: --prompt: empty; give some text to continue, e.g. --prompt "def "'
    proc = orthon("export", tmp_path / "nosuch", "--out", tmp_path / "x", check=False)
    assert proc.returncode == 2 and _one_line(proc) == f"orthon export: {tmp_path / 'nosuch'}: no such weights directory"
    proc = orthon("pretrain", "--resume", tmp_path / "nosuch", check=False)
    assert proc.returncode == 2 and "no such run directory" in _one_line(proc)


@pytest.mark.parametrize("command", ["pretrain", "smoke", "ablate"])
def test_a_model_building_command_without_recipe_names_one(command):
    proc = orthon(command, check=False)
    assert proc.returncode == 2
    line = _one_line(proc)
    assert line.startswith(f"orthon {command}: no recipe given") and f"orthon {command} -c configs/tiny.yaml" in line


def test_a_model_too_large_for_the_machine_is_refused_before_allocation():
    start = time.perf_counter()
    proc = orthon("pretrain", "-c", ROOT / "configs/glm5.yaml", check=False)
    assert proc.returncode == 2
    line = _one_line(proc)
    assert "743.91B parameters" in line and "model.hidden_size" in line and "ORTHON_NO_MEMORY_CHECK" in line
    assert time.perf_counter() - start < 120  # counted on the meta device, nothing built


def test_a_model_too_large_to_load_whole_is_refused_before_reading_weights(tmp_path):
    """generate and the long-context evaluation load the model whole in one process: GLM-5's config.json
    (no tensors beside it) is refused from its parameter count, before any file of weights is read."""
    import json

    from orthon.pretrain.recipe import load_recipe

    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text(json.dumps(load_recipe(ROOT / "configs/glm5.yaml").model.to_hf_dict()))
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    for command, args in (("generate", [final]), ("midtrain", ["--eval", tmp_path / "run"])):
        proc = orthon(command, *args, check=False)
        assert proc.returncode == 2, proc.stderr
        line = _one_line(proc)
        assert "743.91B parameters need about 2,975.6 GB to " in line and "ORTHON_NO_MEMORY_CHECK" in line, line
    # Post-training from it: refused at its first stage, before the tokenizer (there is none) is looked for.
    proc = orthon("posttrain", "-c", ROOT / "configs/posttrain_glm5.yaml", "--from", tmp_path / "run", check=False)
    assert proc.returncode == 2
    assert "743.91B parameters need about 11,902.6 GB to post-train (stage sft)" in _one_line(proc)


def test_rl_refuses_a_policy_whose_whole_weights_cannot_reach_the_engines(monkeypatch, tmp_path):
    """1,024 FSDP2 trainer ranks of 40 GB hold GLM-5's training state (11.6 GB each), but on the shared path
    the engines take the weights gathered whole on trainer rank 0: 4 bytes a parameter in its RAM (2 TB
    here). On disk or distributed, with deltas or without, the ranks hand each version over a part at a time
    (or each its rows' delta), and nothing is refused."""
    from dataclasses import replace

    from orthon.core.errors import ConfigError
    from orthon.launch import args
    from orthon.pretrain.recipe import load_recipe
    from orthon.rl.recipe import load_rl_recipe

    monkeypatch.delenv("ORTHON_NO_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(args, "machine_memory", lambda: (40e9, "memory"))  # a trainer rank a machine of 40 GB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr("orthon.core.allocator.physical_memory", lambda: 2e12)  # and 2 TB of RAM
    model = load_recipe(ROOT / "configs/glm5.yaml").model
    recipe = load_rl_recipe(ROOT / "configs/rl_tiny.yaml", ["rl.cluster.enabled=true", "rl.cluster.trainer_ranks=1024",
                                                             "train.parallel=fsdp", "train.expert_parallel=256"])
    args.check_model_fits(model, recipe.train, "train with RL", world=1024)  # the training state fits

    def cluster(**changes):
        return replace(recipe, rl=replace(recipe.rl, cluster=replace(recipe.rl.cluster, **changes)))

    with pytest.raises(ConfigError, match=r"2,975\.6 GB to train with RL \(weight_sync shared gathers the "
                                          r"whole model on trainer rank 0; disk or distributed"):
        args.check_rl_fits(model, cluster(weight_sync="shared"), "train with RL")
    for path in ("disk", "distributed"):
        for delta in (True, False):
            args.check_rl_fits(model, cluster(weight_sync=path, delta=delta), "train with RL")
    # OPD form 1's teachers: one of the policy's architecture is placed as the policy (sharded: not
    # refused), whole under DDP's trainer ranks (refused, named); one of another architecture is whole
    # everywhere, weighed by its own size.
    from orthon.rl.config import OPDConfig, TeacherConfig
    from orthon.pretrain import hf_io

    same, small = tmp_path / "same", tmp_path / "small"
    for directory, config in ((same, model), (small, load_recipe(ROOT / "configs/tiny.yaml").model)):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(hf_io.config_with_dtype(config, None)))

    def distilling(teachers, parallel="fsdp"):
        opd = OPDConfig(form="kl_penalty", teachers=[TeacherConfig(name=p.name, weights=str(p)) for p in teachers])
        return replace(recipe, rl=replace(recipe.rl, opd=opd), train=replace(recipe.train, parallel=parallel))

    args.check_rl_fits(model, distilling([same, small]), "distil")
    # a frozen copy placed as the policy adds its share, 4 bytes a parameter: 11.6 GB + 2.9 GB on 13 GB
    monkeypatch.setattr(args, "machine_memory", lambda: (13e9, "memory"))
    args.check_rl_fits(model, cluster(weight_sync="disk"), "train with RL")
    with pytest.raises(ConfigError, match=r"about 14\.5 GB to train with RL \(16 bytes each: .*; 4 more for each "
                                          r"of 1 frozen copies placed as it\)"):
        args.check_rl_fits(model, replace(recipe, rl=replace(recipe.rl, loss=replace(recipe.rl.loss, kl_coef=0.1),
                                                             cluster=replace(recipe.rl.cluster, weight_sync="disk"))),
                           "train with RL")
    monkeypatch.setattr(args, "check_model_fits", lambda *a, **k: None)  # DDP's training state aside
    with pytest.raises(ConfigError, match=r"\(the OPD teacher same is loaded whole\)"):
        args.check_rl_fits(model, replace(distilling([same]), train=replace(recipe.train, parallel="ddp",
                                                                            expert_parallel=1)), "distil")
    monkeypatch.setenv("WORLD_SIZE", "1024")  # torchrun's ranks, each with an in-process engine
    with pytest.raises(ConfigError, match=r"\(the in-process engine holds the whole model\)"):
        args.check_rl_fits(model, replace(recipe, rl=replace(recipe.rl, cluster=replace(recipe.rl.cluster, enabled=False))),
                           "train with RL")


def test_ctrl_c_stops_with_one_line_naming_resume(tmp_path):
    stores = make_stores(tmp_path / "data")
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", stores, run_dir, train={"max_steps": 400, "checkpoint_interval": 2})
    # SIGINT's default disposition in the child, as in a foreground terminal: a test run started in the
    # background of a shell without job control inherits SIGINT ignored, and the run would finish unstopped.
    proc = subprocess.Popen([sys.executable, "-m", "orthon.launch.cli", "pretrain", "-c", str(recipe)], cwd=ROOT,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    target = run_dir / "checkpoints" / "step_00000002"
    deadline = time.time() + 300
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith(f"orthon pretrain: interrupted; resume with: orthon pretrain --resume {run_dir} "
                               f"(newest checkpoint: step "), lines[0]
    # The printed command works.
    command = lines[0].split("resume with: ")[1].split(" (")[0].split()
    newest = int(lines[0].split("newest checkpoint: step ")[1].rstrip(")"))
    assert command[:3] == ["orthon", "pretrain", "--resume"]
    out = orthon(*command[1:], f"train.max_steps={newest + 2}")
    assert f"at step {newest}" in out.stdout and not out.stderr


def test_thread_choice():
    assert pick_threads(3, {"OMP_NUM_THREADS": "2"})[0] == 3
    assert pick_threads(None, {"OMP_NUM_THREADS": "2"}) == (2, "OMP_NUM_THREADS", False)
    assert pick_threads(None, {}, measure=lambda: (2, 1.95)) == (2, "1.9 of 2 cores idle", False)  # quiet: every core
    assert pick_threads(None, {}, measure=lambda: (2, 1.05)) == (1, "1.1 of 2 cores idle", True)  # the idle core only
    assert pick_threads(None, {}, measure=lambda: (2, 0.1))[0] == 1
    assert pick_threads(None, {}, measure=lambda: (8, None))[0] == 8


def test_idle_cores_sees_a_busy_core():
    import os

    from orthon.launch.threads import idle_cores

    cores, idle = idle_cores(0.1)
    if idle is None or not hasattr(os, "sched_getaffinity"):
        pytest.skip("no per-core CPU times here")
    assert cores == len(os.sched_getaffinity(0)) and 0.0 <= idle <= cores + 0.01


def test_overrides_may_come_before_and_after_options():
    import argparse

    from orthon.launch import cmd_data, cmd_rl
    from orthon.launch.cli import parse_command_args

    rl = argparse.ArgumentParser()
    cmd_rl.register(rl, "rl")
    args = parse_command_args(rl, ["--resume", "train.run_dir=/x", "-c", "rl.yaml", "rl.iterations=2"])
    assert args.resume and args.config == "rl.yaml" and args.overrides == ["train.run_dir=/x", "rl.iterations=2"]
    data = argparse.ArgumentParser()  # sub-commands: argparse's plain parse
    cmd_data.register(data, "data")
    args = parse_command_args(data, ["inspect", "somewhere", "--verify"])
    assert args.action == "inspect" and args.store == "somewhere" and args.verify
