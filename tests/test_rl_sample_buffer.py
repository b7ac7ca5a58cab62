"""Sample validation and the Data Buffer's group life cycle, counters and thread safety."""
import threading

import numpy as np
import pytest
import torch

from orthon.core.config import ConfigError, build
from orthon.rl.buffer import DataBuffer
from orthon.rl.config import BufferConfig
from orthon.rl.sample import Sample, SampleStatus


def done(instance_id, n_resp=2, **kw):
    kw.setdefault("status", SampleStatus.COMPLETED)
    return Sample(
        instance_id=instance_id,
        tokens=[5, 6, 7] + [8] * n_resp,
        response_length=n_resp,
        loss_mask=[1] * n_resp,
        rollout_log_probs=[-0.5] * n_resp,
        **kw,
    )


# ---------------------------------------------------------------- Sample


def test_sample_fields_and_fp32_log_probs():
    s = Sample("p1", [1, 2, 3, 4, 5], response_length=2, loss_mask=[1, 0],
               rollout_log_probs=[-0.1, -2.5], status="truncated", reward=1, metadata={"task_type": "math"})
    assert s.status is SampleStatus.TRUNCATED
    assert s.rollout_log_probs.dtype == torch.float32
    assert s.prompt_tokens == [1, 2, 3] and s.response_tokens == [4, 5] and s.prompt_length == 3
    assert s.num_loss_tokens == 1 and s.reward == 1.0 and isinstance(s.reward, float)
    s2 = Sample("p1", [1], response_length=1, loss_mask=[1],
                rollout_log_probs=np.array([-1.0], dtype=np.float32), status=SampleStatus.COMPLETED)
    assert s2.rollout_log_probs.tolist() == [-1.0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokens=[1, 2], response_length=3, loss_mask=[1, 1, 1]), "response_length"),
        (dict(tokens=[1, 2], response_length=2, loss_mask=[1], status="aborted"), "loss_mask has 1"),
        (dict(tokens=[1, 2], response_length=1, loss_mask=[2], status="aborted"), "0 or 1"),
        (dict(tokens=[1, -2]), "non-negative"),
        (dict(tokens=[1, 2], response_length=1, loss_mask=[1], status="completed"), "needs rollout_log_probs"),
        (dict(tokens=[1, 2], response_length=1, loss_mask=[1]), "pending sample has no response"),
        (dict(tokens=[1, 2], response_length=1, loss_mask=[1], status="completed",
              rollout_log_probs=torch.tensor([-1.0], dtype=torch.float64)), "float32"),
        (dict(tokens=[1, 2], response_length=1, loss_mask=[1], status="completed",
              rollout_log_probs=[-1.0, -1.0]), "rollout_log_probs has 2"),
        (dict(tokens=[1, 2], response_length=1, loss_mask=[1], status="completed",
              rollout_log_probs=[0.5]), "<= 0"),
        (dict(tokens=[1], reward=float("nan")), "reward"),
        (dict(tokens=[1], reward=True), "reward"),
        (dict(tokens=[1], status="lost"), "status"),
        (dict(tokens=[1], policy_version=-1), "policy_version"),
    ],
)
def test_sample_validation_names_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sample("p", **kwargs)


def test_pending_sample_gets_a_response():
    prompt = Sample("p7", [3, 4], session_id="s1", metadata={"label": "12"})
    assert prompt.status is SampleStatus.PENDING and prompt.response_length == 0
    s = prompt.with_response([9, 10, 11], [-0.1, -0.2, -0.3], policy_version=4)
    assert s.tokens == [3, 4, 9, 10, 11] and s.loss_mask == [1, 1, 1]
    assert s.status is SampleStatus.COMPLETED and s.policy_version == 4 and s.session_id == "s1"
    assert s.metadata == {"label": "12"} and s.metadata is not prompt.metadata
    with pytest.raises(ValueError, match="already completed"):
        s.with_response([1], [-1.0])
    empty = prompt.with_response([], [])  # an empty response is valid data
    assert empty.response_length == 0 and empty.rollout_log_probs.numel() == 0


# ---------------------------------------------------------------- DataBuffer


def test_group_ready_at_g_and_consumed_once():
    buf = DataBuffer(group_size=3, task_type="math")
    assert buf.add(done("a")) and buf.add(done("a")) and buf.add(done("b"))
    c = buf.counters()
    assert (c.pending_groups, c.ready_groups, c.consumed_groups) == (2, 0, 0)
    assert buf.take_ready() == []
    assert buf.add(done("a"))
    assert buf.counters().ready_groups == 1 and buf.counters().pending_groups == 1
    assert not buf.add(done("a"))  # a full group takes no surplus
    (group,) = buf.take_ready()
    assert len(group) == 3 and {s.instance_id for s in group} == {"a"}
    assert buf.take_ready() == []  # consumed once
    assert not buf.add(done("a"))  # a straggler of a consumed group is refused
    c = buf.counters()
    assert (c.pending_groups, c.ready_groups, c.consumed_groups, c.rejected_samples) == (1, 0, 1, 2)
    assert len(buf) == 1


def test_ready_groups_come_out_in_the_order_they_completed():
    buf = DataBuffer(group_size=2, task_type="code")
    for key in ["x", "y", "z"]:
        buf.add(done(key))
    for key in ["z", "x", "y"]:
        buf.add(done(key))
    assert [g[0].instance_id for g in buf.take_ready(2)] == ["z", "x"]
    assert [g[0].instance_id for g in buf.take_ready()] == ["y"]


def test_drop_rebuild_and_task_type():
    buf = DataBuffer(build(BufferConfig, {"num_repeat_per_sample": 2}).num_repeat_per_sample, "math")
    buf.add(done("a"))
    buf.add(done("b"))
    buf.add(done("b"))
    assert buf.drop("a") and not buf.drop("a") and not buf.drop("missing")
    assert not buf.add(done("a"))
    with pytest.raises(ValueError, match="task_type 'code'"):
        buf.add(done("c", metadata={"task_type": "code"}))
    with pytest.raises(ValueError, match="pending"):
        buf.add(Sample("c", [1]))
    buf.add(done("c"))  # pending when the task changes
    old = buf.rebuild("code")
    # b (ready) and c (pending) were discarded by the rebuild, a was dropped before.
    assert (old.dropped_groups, old.consumed_groups, old.rejected_samples) == (3, 0, 1)
    assert buf.counters().as_dict() == dict(
        pending_groups=0, ready_groups=0, consumed_groups=0, dropped_groups=0, rejected_samples=0
    )
    assert buf.task_type == "code"
    assert buf.add(done("a", metadata={"task_type": "code"}))  # a fresh buffer knows no history
    with pytest.raises(ValueError, match="group_size"):
        DataBuffer(0, "math")
    with pytest.raises(ConfigError, match="num_repeat_per_sample"):
        build(BufferConfig, {"num_repeat_per_sample": 0})
    assert build(BufferConfig, {}).num_repeat_per_sample == 32


def test_concurrent_producers_and_a_blocking_consumer():
    G, prompts, producers = 4, 60, 4
    buf = DataBuffer(group_size=G, task_type="math")
    consumed = []

    def produce(worker):
        # every worker makes one sample of every prompt, in its own order
        rng = np.random.default_rng(worker)
        for p in rng.permutation(prompts):
            buf.add(done(f"p{p}", metadata={"worker": worker}))

    def consume():
        while len(consumed) < prompts:
            groups = buf.wait_ready(5, timeout=10)
            assert groups, "timed out waiting for ready groups"
            consumed.extend(groups)

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(producers)]
    consumer = threading.Thread(target=consume)
    consumer.start()
    for t in threads:
        t.start()
    for t in threads + [consumer]:
        t.join(30)
    assert sorted(g[0].instance_id for g in consumed) == sorted(f"p{p}" for p in range(prompts))
    for g in consumed:
        assert len(g) == G and len({s.instance_id for s in g}) == 1
        assert sorted(s.metadata["worker"] for s in g) == list(range(producers))
    c = buf.counters()
    assert (c.consumed_groups, c.pending_groups, c.ready_groups, c.rejected_samples) == (prompts, 0, 0, 0)


def test_wait_ready_times_out_with_what_is_ready():
    buf = DataBuffer(group_size=1, task_type="math")
    buf.add(done("only"))
    groups = buf.wait_ready(3, timeout=0.05)
    assert [g[0].instance_id for g in groups] == ["only"]
    assert buf.wait_ready(1, timeout=0.01) == []
