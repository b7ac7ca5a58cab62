"""The asynchronous loop in one process: producer threads generate while the trainer trains; every
prompt is trained on once, staleness stays bounded, and a crash + resume loses and repeats nothing."""
import json

import pytest
import torch
import yaml

from orthon.core.errors import DataError
from orthon.data.tokenizer import load_tokenizer
from orthon.pretrain.weights import load_config
from orthon.rl.recipe import load_rl_recipe
from orthon.rl.trainer import RLTrainer
from test_rl_loop import _pretrain_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(tmp_path, pre, iterations, **rl):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump({
        "train": {"run_dir": str(tmp_path / "run"), "checkpoint_interval": 2, "progress": False,
                  "micro_batch_size": 8, "init_from": str(pre / "final")},
        "schedule": {"peak_lr": 1e-3, "floor_lr": 1e-3},
        "rl": {"iterations": iterations, "prompts_per_iteration": 3, "max_new_tokens": 6, "eval_interval": 0,
               "task_args": {"difficulty": 1, "eval_size": 4}, "eval_samples": 1,
               "buffer": {"num_repeat_per_sample": 2}, "mode": "async", "rollout_workers": 2, **rl}}))
    recipe = load_rl_recipe(path)
    recipe.model = load_config(pre / "final")
    tokenizer = load_tokenizer(yaml.safe_load((pre / "config.yaml").read_text())["data"]["tokenizer"])
    trainer = RLTrainer(recipe, tokenizer, log=lambda *a: None)
    trained = []
    train_on = trainer.train_on

    def recording(groups):
        trained.extend(g[0].instance_id for g in groups)
        return train_on(groups)

    trainer.train_on = recording
    return trainer, trained


def _left_over(trainer) -> list[str]:
    """Prompts drawn but not trained: queued, in flight at the checkpoint, or in the buffer."""
    state = trainer.rollout.state_dict()
    buffer = state["buffer"]
    return ([p["instance_id"] for _, p in state["queue"]] + list(buffer["pending"])
            + [key for key, _ in buffer["ready"]])


def test_async_trains_every_prompt_once_with_bounded_staleness(tmp_path):
    pre = _pretrain_dir(tmp_path)
    trainer, trained = _trainer(tmp_path, pre, 4, max_staleness=1, stale_groups="keep")
    trainer.fit()
    assert len(trained) == 4 * 3 and len(set(trained)) == len(trained)
    drawn = trainer.rollout.drawn
    # Nothing drawn is lost: what was not trained is still queued or buffered, and the producers ran
    # ahead of the trainer (async), but no further than max_ahead_groups (2 x 3) allows.
    assert sorted(trained + _left_over(trainer)) == sorted(f"train-{i}" for i in range(drawn))
    assert 12 < drawn <= 12 + 6
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness_max"] <= 3 for r in records if "staleness_max" in r)
    assert [r["policy_version"] for r in records if "policy_version" in r] == [1, 2, 3, 4]
    # The prompt tokens the engine ran and took from its prefix cache, so far: a group's second sample
    # repeats its first's prompt in the same call, so at least half of them came from the cache.
    counted = [r for r in records if "prompt_tokens" in r][-1]
    assert counted["prompt_tokens"] > counted["prompt_tokens_cached"] >= counted["prompt_tokens"] / 2 > 0


def test_async_drops_stale_groups_and_counts_them(tmp_path):
    pre = _pretrain_dir(tmp_path)
    trainer, trained = _trainer(tmp_path, pre, 3, max_staleness=0, stale_groups="drop", max_ahead_groups=9)
    trainer.fit()
    counters = trainer.rollout.counters
    # With 9 groups generated ahead and 3 trained per version, groups from older versions exist and are
    # dropped: each one counted, none trained.
    assert counters["stale_groups_drop"] > 0
    assert len(trained) == 9 and len(set(trained)) == 9


def test_async_crash_and_resume_loses_and_repeats_nothing(tmp_path):
    pre = _pretrain_dir(tmp_path)
    first, trained_first = _trainer(tmp_path, pre, 4)
    iterate = first.iterate

    def crash_in_third():
        if first.iteration == 2:
            raise KeyboardInterrupt("killed")
        return iterate()

    first.iterate = crash_in_third
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    # The checkpoint at iteration 2 holds what was trained until then; the resumed run trains on.
    second, trained_second = _trainer(tmp_path, pre, 4)
    assert second.resume() and second.iteration == 2 and second.weight_version == 2
    second.fit()
    history = trained_first[:6] + trained_second
    assert len(history) == 12 and len(set(history)) == 12
    assert sorted(history + _left_over(second)) == sorted(f"train-{i}" for i in range(second.rollout.drawn))


def test_debug_modes_save_rollouts_then_train_on_them(tmp_path):
    pre = _pretrain_dir(tmp_path)
    # A reward a random policy earns about half the time: groups with an advantage, on any CPU's numbers
    # (the task's own reward is 0 for nearly every answer of a random model).
    reward = {"name": "test_rl_parallel.first_letter_reward"}
    saver, trained = _trainer(tmp_path / "a", pre, 2, mode="sync", debug="rollout_only",
                              rollouts_dir=str(tmp_path / "rollouts"), reward=reward)
    before = [p.clone() for p in saver.model.parameters()]
    saver.fit()
    assert trained == [] and all(torch.equal(p, q) for p, q in zip(before, saver.model.parameters()))
    files = sorted((tmp_path / "rollouts").iterdir())
    assert [f.name for f in files] == ["iteration_000000.jsonl", "iteration_000001.jsonl"]
    saved = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert len(saved) == 2 * 3 * 2  # iterations x prompts x G
    trainer, trained = _trainer(tmp_path / "b", pre, 2, mode="sync", debug="train_only",
                                rollouts_dir=str(tmp_path / "rollouts"), reward=reward)
    trainer.fit()
    assert trained == list(dict.fromkeys(s["instance_id"] for s in saved))
    # The saved groups train: the weights move exactly when some group's rewards differ (an advantage).
    rewards = {}
    for s in saved:
        rewards.setdefault(s["instance_id"], set()).add(s["reward"])
    advantaged = any(len(r) > 1 for r in rewards.values())
    assert advantaged == any(not torch.equal(p, q) for p, q in zip(before, trainer.model.parameters()))
    # Nothing saved for an iteration: a clear error naming the file.
    missing, _ = _trainer(tmp_path / "c", pre, 3, mode="sync", debug="train_only", rollouts_dir=str(tmp_path / "rollouts"))
    with pytest.raises(DataError, match="iteration_000002.jsonl"):
        missing.fit()


def test_no_engine_answers_stops_with_an_error_not_a_hang(tmp_path):
    from orthon.core.errors import EngineUnavailable
    from orthon.core.net import free_port
    from orthon.engine.client import HTTPEngine
    from orthon.rl.rollout_manager import RolloutManager
    from orthon.rl.train_config import RLConfig

    pre = _pretrain_dir(tmp_path)
    tokenizer = load_tokenizer(yaml.safe_load((pre / "config.yaml").read_text())["data"]["tokenizer"])
    cfg = RLConfig(mode="async", rollout_workers=2, prompts_per_iteration=2, task_args={"difficulty": 1, "eval_size": 2})
    manager = RolloutManager(cfg, tokenizer, HTTPEngine(f"http://127.0.0.1:{free_port()}", timeout_s=1), seed=0,
                             log=lambda *a: None)
    manager.start()
    try:
        with pytest.raises(EngineUnavailable, match="no group ready after 2s"):
            manager.collect_groups(0, timeout=2)
    finally:
        manager.stop()
    # Nothing was lost: the prompts that failed wait in the queue for a working engine.
    assert manager.counters["engine_retries"] > 0 and len(manager.state_dict()["queue"]) >= 1


def test_evaluation_asks_for_no_log_probs_so_a_rescoring_engine_skips_it(tmp_path, monkeypatch):
    """Held-out rewards read no log-probs: an engine that rescores its samples (a Ray engine, orthon
    serve) runs no rescoring forward for them; a training round's samples are rescored."""
    import orthon.engine.in_process as in_process
    from orthon.pretrain.weights import load_weights
    from orthon.rl.rollout_manager import RolloutManager
    from orthon.rl.train_config import RLConfig

    rescored = []
    real = in_process.sequence_log_probs
    monkeypatch.setattr(in_process, "sequence_log_probs",
                        lambda m, seqs, counts, **kw: rescored.append(len(seqs)) or real(m, seqs, counts, **kw))
    pre = _pretrain_dir(tmp_path)
    tokenizer = load_tokenizer(yaml.safe_load((pre / "config.yaml").read_text())["data"]["tokenizer"])
    engine = in_process.InProcessEngine(load_weights(pre / "final"), in_process.EngineConfig(logprobs="rescore"))
    cfg = RLConfig(prompts_per_iteration=2, max_new_tokens=4, eval_samples=2,
                   task_args={"difficulty": 1, "eval_size": 2})
    manager = RolloutManager(cfg, tokenizer, engine, seed=0, log=lambda *a: None)
    manager.evaluate()
    assert engine.stats.generated_tokens > 0 and rescored == []
    manager.generate(2)
    assert sum(rescored) > 0


def test_rollouts_end_at_the_recipes_stop_strings(tmp_path):
    """rl.stop reaches the engine (the trainer's own has the tokenizer to read text): a response ends at
    the first token whose text completes a stop string, and no shorter prefix of it holds one."""
    pre = _pretrain_dir(tmp_path)
    stops = ("e", "a")
    trainer, _ = _trainer(tmp_path / "stop", pre, 1, mode="sync", stop=list(stops), max_new_tokens=12)
    manager = trainer.rollout
    assert manager.sampling().stop == stops and trainer.engine.tokenizer is manager.tokenizer
    samples = manager.roll_round(manager._draw(4))
    decode = manager.tokenizer.decode
    ended = 0
    for s in samples:
        tokens = list(s.response_tokens)
        assert not any(t in decode(tokens[:n]) for n in range(1, len(tokens)) for t in stops)
        ended += any(t in decode(tokens) for t in stops)
    assert ended >= len(samples) // 2  # most random responses of 12 tokens hold an "e" or an "a"
