"""RL on a local Ray cluster: two `orthon serve` engines behind sglang-router, the rollout manager and
the trainer as actors. Asynchronous training survives an engine killed mid-run (the monitor restarts
it with the current weights; every prompt is trained on exactly once), a SIGKILLed run resumes with
nothing lost or repeated, and every weight-sync path leaves the engines holding the trainer's bytes."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

pytest.importorskip("ray")
pytest.importorskip("sglang_router")

from orthon.rl.recipe import load_rl_recipe  # noqa: E402
from orthon.pretrain.weights import load_config, load_runtime  # noqa: E402
from test_rl_loop import _pretrain_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "ray_session")


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray cluster for the module's runs (each run's actors come and go)."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()

P, G = 3, 2


def _write_recipe(tmp_path, run_dir, iterations, **rl):
    cluster = {"enabled": True, "engines": 2, "health_interval_s": 0.5, "request_timeout_s": 30,
               **rl.pop("cluster", {})}
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump({
        "train": {"run_dir": str(run_dir), "checkpoint_interval": 2, "progress": False, "micro_batch_size": 8},
        "schedule": {"peak_lr": 1e-3, "floor_lr": 1e-3},
        "rl": {"iterations": iterations, "prompts_per_iteration": P, "max_new_tokens": 6, "eval_interval": 0,
               "task_args": {"difficulty": 1, "eval_size": 4}, "eval_samples": 1,
               "buffer": {"num_repeat_per_sample": G}, "mode": "async", "rollout_workers": 2,
               "max_staleness": 100, "stale_groups": "keep", "cluster": cluster, **rl}}))
    return path


def _recipe(tmp_path, pre, iterations, **rl):
    from dataclasses import replace

    recipe = load_rl_recipe(_write_recipe(tmp_path, tmp_path / "run", iterations, **rl))
    policy = pre / "final"
    return replace(recipe, model=load_config(policy), runtime=load_runtime(policy),
                   train=replace(recipe.train, init_from=str(policy)))


def _tokenizer(pre):
    return yaml.safe_load((pre / "config.yaml").read_text())["data"]["tokenizer"]


def _trained_ids(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [i for r in records for i in r.get("trained_ids", [])]


def test_async_run_survives_a_killed_engine(tmp_path):
    from orthon.rl.cluster import RLCluster

    pre = _pretrain_dir(tmp_path)
    recipe = _recipe(tmp_path, pre, 6)
    lines = []
    with RLCluster(recipe, _tokenizer(pre), log=lines.append) as cluster:
        cluster.start()
        victim = cluster.engine_pids()[0]
        metrics = tmp_path / "run" / "metrics.jsonl"

        finished = threading.Event()

        def kill_after_second_iteration():
            while not finished.wait(0.2):
                if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                    os.kill(victim, signal.SIGKILL)
                    return

        killer = threading.Thread(target=kill_after_second_iteration)
        killer.start()
        try:
            result = cluster.fit()
        finally:
            finished.set()
            killer.join()
        pids = cluster.engine_pids()
    assert result["iterations"] == 6
    assert result["fleet"].get("engine_restarts", 0) >= 1 and victim not in pids
    trained = _trained_ids(tmp_path / "run")
    assert len(trained) == 6 * P and len(set(trained)) == len(trained)
    # The actors' log lines reach the driver (Ray keeps an actor's own output in its log files).
    text = "\n".join(lines)
    assert "behind the router at http://" in text and "iteration 0: held-out reward" in text
    assert "is not answering: restarting it" in text and "engine restarted at http://" in text, text


@pytest.mark.slow  # about 90 s: two runs with their own Ray clusters (the logic is tested in one process in test_rl_async)
def test_killed_run_resumes_with_nothing_lost_or_repeated(tmp_path):
    pre = _pretrain_dir(tmp_path)
    recipe = _write_recipe(tmp_path, tmp_path / "run", 6)
    command = [sys.executable, "-m", "orthon.launch.cli", "rl", "-c", str(recipe), "--from", str(pre)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(checkpoints.glob("step_*[0-9]")):
        time.sleep(0.2)
    time.sleep(1.0)  # into the iterations after the checkpoint
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    done = subprocess.run(command + ["--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = _trained_ids(tmp_path / "run")
    assert len(trained) == 6 * P and len(set(trained)) == len(trained)


@pytest.mark.parametrize("path,delta", [
    pytest.param("disk", False, marks=pytest.mark.slow), pytest.param("disk", True, marks=pytest.mark.slow),
    pytest.param("distributed", False, marks=pytest.mark.slow), ("distributed", True), pytest.param("shared", True, marks=pytest.mark.slow)])
def test_every_sync_path_leaves_the_engines_with_the_trainers_bytes(tmp_path, path, delta):
    from orthon.rl.cluster import run

    pre = _pretrain_dir(tmp_path)
    recipe = _recipe(tmp_path, pre, 2, mode="sync", cluster={"weight_sync": path, "delta": delta,
                                                             "check_weights": True, "router": False})
    result = run(recipe, _tokenizer(pre), log=lambda *a: None)  # check_weights raises on any difference
    assert result["iterations"] == 2


def test_a_cluster_on_its_nodes_addresses(tmp_path):
    """``rl.cluster.network: node`` (what a Ray cluster of several machines takes, here on one): the engines
    listen on the node's address, the router too, the weight-update group meets there and each member's
    gloo device is its interface towards it; training runs and every sync leaves the engines holding the
    trainer's bytes; nothing listens on 127.0.0.1."""
    import ray

    from orthon.rl.cluster import run

    node = ray.util.get_node_ip_address()
    if node.startswith("127."):
        pytest.skip("this machine's Ray node address is loopback")
    pre = _pretrain_dir(tmp_path)
    lines = []
    recipe = _recipe(tmp_path, pre, 2, mode="sync", cluster={"weight_sync": "distributed", "delta": False,
                                                             "check_weights": True, "network": "node"})
    result = run(recipe, _tokenizer(pre), log=lines.append)  # check_weights raises on any difference
    assert result["iterations"] == 2
    engines = next(str(line) for line in lines if str(line).startswith("engines: "))
    assert engines.count(f"http://{node}:") == 3 and "127.0.0.1" not in engines  # two engines and the router


@pytest.mark.parametrize("parallel,experts,path,delta", [
    ("fsdp", 2, "distributed", False), pytest.param("fsdp", 1, "distributed", False, marks=pytest.mark.slow),
    pytest.param("fsdp", 2, "disk", False, marks=pytest.mark.slow),
    pytest.param("fsdp", 2, "disk", True, marks=pytest.mark.slow), ("fsdp", 2, "distributed", True),
    pytest.param("ddp", 1, "disk", True, marks=pytest.mark.slow)])
def test_trainer_ranks_train_what_one_process_does(tmp_path, parallel, experts, path, delta):
    """Two trainer ranks on Ray (one process group: FSDP2 shards with expert parallelism, or DDP) train on
    saved rollouts to the weights one process reaches on them, and every sync leaves the engine holding
    the trainer's bytes (check_weights raises otherwise). Where the ranks hold shards, without delta, the
    engines get each version part by part as the ranks gather it (distributed) or the directory the ranks
    wrote a shard at a time (disk; orthon.pretrain.gathered_weights); with delta the state dict gathered
    whole on rank 0. The expert stacks (64 kB) stream two experts a part."""
    from dataclasses import replace

    from orthon.data.tokenizer import load_tokenizer
    from orthon.rl.cluster import run
    from orthon.rl.trainer import RLTrainer
    from test_rl_parallel import _trained_apart, _weights

    pre = _pretrain_dir(tmp_path)
    rollouts = str(tmp_path / "rollouts")

    def recipe(name, debug, **rl):
        loaded = _recipe(tmp_path, pre, 2, mode="sync", debug=debug, rollouts_dir=rollouts,
                         dp_schedule={"micro_batch_tokens": 48}, **rl)
        return replace(loaded, train=replace(loaded.train, run_dir=str(tmp_path / name), parallel=parallel,
                                             expert_parallel=experts))

    def in_process(name, debug, **rl):
        RLTrainer(recipe(name, debug, cluster={"enabled": False}, **rl), load_tokenizer(_tokenizer(pre))).fit()

    # Groups a random policy earns some reward on, so that the steps train (only this run scores them).
    in_process("rollouts", "rollout_only", reward={"name": "test_rl_parallel.first_letter_reward"})
    in_process("one", "train_only")
    cluster = {"engines": 1, "router": False, "check_weights": True, "trainer_ranks": 2, "delta": delta,
               "weight_sync": path, "part_bytes": 50_000}  # the tiny model's ~0.4 MB in several parts
    lines = []
    result = run(recipe("two", "train_only", cluster=cluster), _tokenizer(pre), log=lines.append)
    assert result["iterations"] == 2
    text = "\n".join(lines)
    assert parallel != "fsdp" or "model built sharded (FSDP2 over 2 ranks)" in text
    assert experts == 1 or "expert parallelism: 2 of the 4 experts of each MoE layer on each rank" in text
    start, one, two = _weights(pre / "final"), _weights(tmp_path / "one" / "final"), _weights(tmp_path / "two" / "final")
    assert max((one[k].float() - start[k].float()).abs().max().item() for k in start) > 1e-4  # it trained
    assert _trained_apart(one, two, start) == []
    # Three syncs (versions 0, 1, 2), streamed in parts of 50 kB on the distributed path; with delta where the
    # ranks hold shards, versions 1 and 2 as each rank's delta of its rows (two payloads a version).
    parts, payloads = result["fleet"].get("streamed_parts", 0), result["fleet"].get("delta_payloads", 0)
    assert parts % 3 == 0 and (parts >= 3 * 5) == (path == "distributed" and not delta), result["fleet"]
    assert payloads == (2 * 2 if delta and parallel == "fsdp" else 0), result["fleet"]
    # Directories the engines loaded: on disk without delta versions 1 and 2 (the newest two kept), each a
    # weights directory the ranks wrote (the sidecar beside the HF layout; a state dict gathered on rank 0
    # is written as model.safetensors alone); with deltas only the first full copy; streamed: none.
    versions = sorted(p.name for p in (tmp_path / "two" / "weights").glob("v*"))
    assert versions == {"distributed": [], "disk": ["v00000001", "v00000002"]}[path] if not delta else ["v00000000"]
    assert delta or path != "disk" or (tmp_path / "two" / "weights" / versions[-1] / "orthon.json").is_file()


@pytest.mark.parametrize("layout,path,delta", [
    ("tensor_parallel", "distributed", False), ("pipeline_parallel", "distributed", False),
    ("pipeline_parallel", "distributed", True), pytest.param("expert_parallel", "disk", False, marks=pytest.mark.slow),
    pytest.param("tensor_parallel", "disk", True, marks=pytest.mark.slow)])
def test_megatron_trainer_ranks_hand_the_engines_their_parts(tmp_path, layout, path, delta):
    """Two trainer ranks on Ray holding megatron's tensor-, pipeline- or expert-parallel parts of the policy
    train on saved rollouts to the weights megatron reaches on them in one process, and no process gathers
    the whole model to hand it over: the engines get each version part by part as the ranks gather it
    (distributed; the 64 kB expert stacks a window of whole experts at a time; with pipeline stages each
    stage's leader gathers its stage's parts and broadcasts them over a group of its own), the directory the ranks
    wrote a shard at a time (disk), or with delta each rank's delta of the parts it keeps (two payloads a
    version); every sync leaves the engine holding the trainer's bytes (check_weights raises otherwise)."""
    pytest.importorskip("megatron.core")
    from dataclasses import replace

    from megatron_support import megatron_on_cpu

    from orthon.data.tokenizer import load_tokenizer
    from orthon.rl.cluster import run
    from orthon.rl.trainer import RLTrainer
    from test_rl_parallel import _trained_apart, _weights

    pre = _pretrain_dir(tmp_path)
    rollouts = str(tmp_path / "rollouts")

    def recipe(name, debug, megatron=None, **rl):
        loaded = _recipe(tmp_path, pre, 2, mode="sync", debug=debug, rollouts_dir=rollouts,
                         dp_schedule={"micro_batch_tokens": 48}, **rl)
        loaded = replace(loaded, train=replace(loaded.train, run_dir=str(tmp_path / name)))
        return loaded if megatron is None else replace(  # megatron runs dense MLA (pretraining's attention)
            loaded, backend="megatron", megatron=replace(loaded.megatron, **megatron),
            runtime=replace(loaded.runtime, sparse_attention=False))

    def in_process(name, debug, **kw):
        RLTrainer(recipe(name, debug, cluster={"enabled": False}, **kw), load_tokenizer(_tokenizer(pre))).fit()

    in_process("rollouts", "rollout_only", reward={"name": "test_rl_parallel.first_letter_reward"})
    with megatron_on_cpu():  # megatron's process group and CPU patches in this process, torn down after
        in_process("one", "train_only", megatron={})
    cluster = {"engines": 1, "router": False, "check_weights": True, "trainer_ranks": 2, "delta": delta,
               "weight_sync": path, "part_bytes": 50_000}
    result = run(recipe("two", "train_only", megatron={layout: 2}, cluster=cluster), _tokenizer(pre),
                 log=lambda *a: None)
    assert result["iterations"] == 2
    start, one, two = _weights(pre / "final"), _weights(tmp_path / "one" / "final"), _weights(tmp_path / "two" / "final")
    assert max((one[k].float() - start[k].float()).abs().max().item() for k in start) > 1e-4  # it trained
    assert _trained_apart(one, two, start) == []
    parts, payloads = result["fleet"].get("streamed_parts", 0), result["fleet"].get("delta_payloads", 0)
    assert parts % 3 == 0 and (parts >= 3 * 5) == (path == "distributed" and not delta), result["fleet"]
    assert payloads == (2 * 2 if delta else 0), result["fleet"]
    pipelined = layout == "pipeline_parallel" and path == "distributed" and not delta
    assert result["fleet"].get("stage_groups", 0) == (2 if pipelined else 0), result["fleet"]
    versions = sorted(p.name for p in (tmp_path / "two" / "weights").glob("v*"))
    assert versions == ({"distributed": [], "disk": ["v00000001", "v00000002"]}[path] if not delta else ["v00000000"])


def test_an_engine_restarted_after_a_streamed_sync_joins_at_the_next(tmp_path):
    """Where the last sync was streamed (the parts are used up, nothing on disk to copy), a restarted engine
    stays out of the router until the next sync brings it the whole current version; then it joins, holding
    the trainer's bytes (HF-layout hashes, routed experts one tensor each) at that version."""
    from orthon.engine.client import HTTPEngine
    from orthon.engine.tensor_bytes import tensor_hashes
    from orthon.pretrain.gathered_weights import gathered_parts
    from orthon.pretrain.weights import load_weights
    from orthon.rl.config import ClusterConfig
    from orthon.rl.fleet import EngineFleet
    from orthon.rl.weight_sync import WeightParts, WeightSync, _named
    from server_support import tiny_weights

    start = tiny_weights(tmp_path / "start")
    # The monitor polls once a minute: the test restarts the engine itself, at a known point.
    cluster = ClusterConfig(enabled=True, engines=2, weight_sync="distributed", delta=False, part_bytes=20_000,
                            health_interval_s=60, request_timeout_s=30)
    fleet = EngineFleet(cluster, str(start), tmp_path / "run", WeightSync(cluster, tmp_path / "run"),
                        lambda url: HTTPEngine(url, timeout_s=30), log=lambda *a: None)
    fleet.start()
    try:
        # Versions 1 and 2 both differ from what a restarted engine starts from.
        models = {v: load_weights(tiny_weights(tmp_path / f"v{v}", seed=10 + v)) for v in (1, 2)}
        fleet.sync(WeightParts(gathered_parts(models[1], 0, cluster.part_bytes)), 1)
        old = fleet.urls[0]
        os.kill(fleet.pids()[0], signal.SIGKILL)
        new = fleet.replace(0, old)
        assert fleet.waiting == {new} and new not in fleet.router.workers()
        assert HTTPEngine(new).get_weight_version() == 0  # the directory it started from
        fleet.sync(WeightParts(gathered_parts(models[2], 0, cluster.part_bytes)), 2)
        assert fleet.waiting == set() and sorted(fleet.router.workers()) == sorted(fleet.urls)
        want = tensor_hashes(_named(models[2]))
        for url in fleet.urls:
            assert HTTPEngine(url).weight_hashes() == want and HTTPEngine(url).get_weight_version() == 2
        assert fleet.counters["engine_restarts"] == 1 and fleet.counters["streamed_parts"] > 2 * 2
    finally:
        fleet.stop()
