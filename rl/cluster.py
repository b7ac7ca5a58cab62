"""RL on Ray: the same loop as ``orthon rl`` with its parts in different processes (slime's layout).

Actors: the trainer (RLTrainer: the policy, its optimizer, checkpoints; ``rl.cluster.trainer_ranks``
actors training data parallel in one process group, rank 0 with the engine fleet, its health monitor
and weight sync), the rollout manager (the Data Buffer, the prompt stream, the
rollout plug-in; it reaches the engines through the router), the engine servers (``orthon serve``
under small supervising actors) and, optionally, reward workers. The driver only wires them up and
waits; ``rl.mode`` chooses synchronous or asynchronous training exactly as in one process.

``ray.init()`` starts a local cluster unless ``rl.cluster.address`` names one (``ray start --head`` on
the first machine, ``ray start --address HEAD:6379`` on the others, then ``address: auto``).
"""
from __future__ import annotations

import collections
import os
import threading

from orthon.rl.rollout_manager import RolloutManager


class ActorProxy:
    """A Ray actor called like the object it holds: ``proxy.method(*args)`` blocks for the result, at
    most ``timeout_s`` (a dead or hung actor raises instead of stalling the loop)."""

    def __init__(self, handle, timeout_s: float | None = None):
        self._handle, self._timeout_s = handle, timeout_s

    def __getattr__(self, name):
        import ray

        method = getattr(self._handle, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs), timeout=self._timeout_s)


class RewardWorker:
    """Runs the reward function in its own process (a code or sandbox reward must not stall rollouts)."""

    def __init__(self, reward_config, task):
        from orthon.core.plugins import resolve
        from orthon.rl.rewards.registry import SafeReward

        # The bare function: the rollout manager's SafeReward (around RemoteRewardFn) times and counts it.
        self.fn = SafeReward.from_config(reward_config).fn if reward_config else resolve(task, "rl.task").reward_fn

    def score(self, response: str, label):
        return self.fn(response, label)


class RemoteRewardFn:
    """A reward function that scores on a pool of RewardWorkers, round robin. The rollout manager wraps
    it in SafeReward as any reward, so timeouts and errors (a worker's exception) are counted there."""

    def __init__(self, workers):
        self.workers, self._next, self._lock = workers, 0, threading.Lock()
        self.__name__ = "remote_reward"

    def __call__(self, response: str, label):
        import ray

        with self._lock:
            worker = self.workers[self._next % len(self.workers)]
            self._next += 1
        return ray.get(worker.score.remote(response, label))


class _RolloutActor(RolloutManager):
    """The RolloutManager as a Ray actor: its producer threads run inside it, and it reaches the engines
    through one HTTP client (of the router)."""

    def __init__(self, cfg, tokenizer_path: str, engine_url: str, seed: int, reward_workers):
        from orthon.data.tokenizer import load_tokenizer
        from orthon.engine.client import HTTPEngine
        from orthon.rl.rewards.registry import SafeReward

        reward = None
        if reward_workers:
            reward = SafeReward(RemoteRewardFn(reward_workers), timeout_s=cfg.reward.timeout_s if cfg.reward else 30.0)
        engine = HTTPEngine(engine_url, timeout_s=cfg.cluster.request_timeout_s)
        super().__init__(cfg, load_tokenizer(tokenizer_path), engine, seed, reward=reward)


class TrainerActor:
    """One rank of the policy's trainer (RLTrainer). Rank 0 also runs the engine fleet and talks to the
    rollout manager; with ``rl.cluster.trainer_ranks`` > 1 the ranks form one torch.distributed group
    (gloo on CPU, NCCL on GPU; rank 0's node and a free port there) and train data parallel, as the
    ranks torchrun starts do."""

    def __init__(self, recipe, group=None, rank: int = 0):
        from dataclasses import replace

        from orthon.engine.client import HTTPEngine
        from orthon.rl.fleet import EngineFleet
        from orthon.rl.weight_sync import WeightSync

        # The driver draws the progress bar and prints the log lines (progress()): an actor's own output
        # goes to Ray's log files, not to the user's terminal.
        self.recipe = replace(recipe, train=replace(recipe.train, progress=False))
        self.rank = rank
        # Appended by the engine monitor's thread and the loop's while progress() drains it: a deque's
        # append and popleft are atomic, so no line is lost between a drain and an append.
        self.messages: collections.deque[str] = collections.deque()
        self.fleet = self.trainer = None
        self.engine_url = None
        if rank == 0:
            cluster = recipe.rl.cluster
            first_engine = cluster.trainer_ranks + 1  # the bundles: trainer ranks, the rollout manager, engines
            self.fleet = EngineFleet(cluster, recipe.train.init_from, recipe.train.run_dir,
                                     WeightSync(cluster, recipe.train.run_dir),
                                     lambda url: HTTPEngine(url, timeout_s=cluster.request_timeout_s),
                                     placement=(lambda i: bundle(group, first_engine + i)) if group is not None else None,
                                     log=self.log)
            self.engine_url = self.fleet.start()

    def master(self) -> tuple[str, int]:
        """Where the trainer ranks meet (rank 0's): this node's address and a port free on it now."""
        import ray

        from orthon.core.net import free_port

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def url(self) -> str:
        return self.engine_url

    def attach(self, rollout_handle, master: tuple[str, int] | None = None) -> None:
        """Build this rank's RLTrainer (rank 0 with the rollout manager's handle; every rank at once when
        there are several: they meet at ``master``) and give the engines the policy's exact bytes."""
        from orthon.rl.trainer import RLTrainer

        ranks = self.recipe.rl.cluster.trainer_ranks
        if ranks > 1:  # torch.distributed's env:// rendezvous, as torchrun sets it (one GPU an actor: LOCAL_RANK 0)
            os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                              WORLD_SIZE=str(ranks), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        rollout = None
        if rollout_handle is not None:
            # A rollout call returns within its own timeouts (collect_timeout_s, the engines' request
            # timeout): past those and a margin, the rollout actor is dead or hung.
            timeout = self.recipe.rl.collect_timeout_s + 4 * self.recipe.rl.cluster.request_timeout_s
            rollout = ActorProxy(rollout_handle, timeout)
        self.trainer = RLTrainer(self.recipe, None, rollout=rollout,
                                 weight_sync=self.fleet.sync if self.fleet else None,
                                 sync_form=self.fleet.form if self.fleet else None, log=self.log)
        self.trainer.hand_over()  # weight version 0: every engine holds the policy's exact bytes

    def resume(self) -> bool:
        return self.trainer.resume()

    def fit(self) -> dict:
        result = self.trainer.fit()
        if self.fleet is not None:
            result["fleet"] = dict(self.fleet.counters)
        return result

    def engine_pids(self) -> list[int]:
        return self.fleet.pids()

    def log(self, message) -> None:
        print(message, flush=True)  # Ray's log file keeps it too
        self.messages.append(str(message))

    def progress(self) -> tuple[int, dict, list[str]]:
        """The iterations done, the last iteration's statistics ({} before the first; with the latest
        held-out reward as ``eval_reward`` when that iteration did not evaluate: a poll sees only some
        iterations) and the log lines since the last call (called while fit() runs)."""
        messages = [self.messages.popleft() for _ in range(len(self.messages))]
        if self.trainer is None:
            return 0, {}, messages
        stats = dict(self.trainer.last_stats)
        if self.trainer.held_out is not None:
            stats.setdefault("eval_reward", self.trainer.held_out)
        return self.trainer.iteration, stats, messages

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()


class RLCluster:
    """The actors of one RL run: ``start()`` places them, ``fit()`` runs the loop, ``stop()`` ends all.

    One placement group holds a bundle per trainer rank, one for the rollout manager and one per engine
    (PACK: on one node when it fits, spread otherwise)."""

    def __init__(self, recipe, tokenizer_path: str, log=print):
        self.recipe, self.tokenizer_path, self.log = recipe, tokenizer_path, log
        self.trainers, self.rollout, self.group = [], None, None
        self.owns_ray = False

    @property
    def trainer(self):
        """Rank 0's trainer actor: the engines' owner, and the one that reports progress."""
        return self.trainers[0] if self.trainers else None

    def start(self, resume: bool = False) -> "RLCluster":
        import ray
        from ray.util.placement_group import placement_group

        cluster = self.recipe.rl.cluster
        wanted = bundles(cluster)
        if not ray.is_initialized():
            needed = sum(b["CPU"] for b in wanted)
            kwargs = {} if cluster.address else {"num_cpus": max(needed, os.cpu_count() or 1), "include_dashboard": False}
            ray.init(address=cluster.address, log_to_driver=False, **kwargs)
            self.owns_ray = True
        self.group = placement_group(wanted, strategy="PACK")
        ray.get(self.group.ready(), timeout=cluster.startup_timeout_s)
        rl, ranks = self.recipe.rl, cluster.trainer_ranks
        self.trainers = [ray.remote(TrainerActor).options(
            num_cpus=cluster.trainer_threads, num_gpus=1 if cluster.trainer_gpus else 0, max_concurrency=4,
            scheduling_strategy=bundle(self.group, rank)).remote(self.recipe, self.group, rank) for rank in range(ranks)]
        url = ray.get(self.trainer.url.remote())
        # A reward call mostly waits (a sandbox, a judge): each worker takes reward.concurrency at once.
        concurrency = rl.reward.concurrency if rl.reward else 1
        workers = [ray.remote(RewardWorker).options(num_cpus=0, max_concurrency=concurrency).remote(rl.reward, rl.task)
                   for _ in range(cluster.reward_workers)]
        rollout = ray.remote(_RolloutActor).options(num_cpus=1, max_concurrency=8,
                                                    scheduling_strategy=bundle(self.group, ranks))
        self.rollout = rollout.remote(rl, self.tokenizer_path, url, self.recipe.train.seed, workers)
        master = ray.get(self.trainer.master.remote()) if ranks > 1 else None
        # Every rank at once: they meet in one process group, and the first weight sync is a collective.
        ray.get([t.attach.remote(self.rollout if rank == 0 else None, master) for rank, t in enumerate(self.trainers)])
        if resume and not ray.get([t.resume.remote() for t in self.trainers])[0]:
            self.log(f"no usable RL checkpoint in {self.recipe.train.run_dir}; starting at iteration 0")
        return self

    def fit(self, poll_s: float = 1.0) -> dict:
        """Runs the loop in the trainer actors; meanwhile shows rank 0's progress and prints its log lines.
        A rank that fails ends the run at once with its error (the others would wait in a collective)."""
        import ray

        from orthon.rl.trainer import ProgressPostfix

        done = [t.fit.remote() for t in self.trainers]
        postfix = ProgressPostfix()
        bar = None
        if self.recipe.train.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.recipe.rl.iterations, desc="rl", unit="it")
        try:
            while True:
                finished, pending = ray.wait(done, num_returns=len(done), timeout=poll_s)
                iteration, stats, messages = ray.get(self.trainer.progress.remote(),
                                                     timeout=self.recipe.rl.cluster.startup_timeout_s)
                for message in messages:
                    (bar.write if bar is not None else self.log)(message)
                if bar is not None and iteration > bar.n:
                    bar.update(iteration - bar.n)
                    bar.set_postfix(postfix(stats))
                ray.get(finished)  # raises a finished rank's error
                if not pending:
                    return ray.get(done[0])
        finally:
            if bar is not None:
                bar.close()

    def engine_pids(self) -> list[int]:
        import ray

        return ray.get(self.trainer.engine_pids.remote())

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.trainer is not None:
            try:
                ray.get(self.trainer.stop.remote(), timeout=60)
            except Exception as exc:  # already gone: its engines die with their supervisors
                self.log(f"stopping the trainer: {exc}")
        if self.group is not None:  # ends every actor placed in it
            remove_placement_group(self.group)
        if self.owns_ray:
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def bundles(cluster) -> list[dict]:
    """The placement group's bundles: one per trainer rank (its CPUs, and a GPU with ``trainer_gpus``),
    the rollout manager's, one per engine."""
    trainer = {"CPU": cluster.trainer_threads, **({"GPU": 1} if cluster.trainer_gpus else {})}
    return [dict(trainer) for _ in range(cluster.trainer_ranks)] + [{"CPU": 1}] + \
        [{"CPU": cluster.engine_threads} for _ in range(cluster.engines)]


def bundle(group, index: int):
    """Scheduling into bundle ``index`` of placement group ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)


def run(recipe, tokenizer_path: str, resume: bool = False, log=print) -> dict:
    """Start (or join) the Ray cluster, place the actors, run the loop; returns RLTrainer.fit's summary."""
    with RLCluster(recipe, tokenizer_path, log) as cluster:
        return cluster.start(resume).fit()
