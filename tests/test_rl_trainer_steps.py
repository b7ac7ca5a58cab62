"""The trainer's step options: several optimizer steps per rollout, and dropping zero-std groups."""
import pytest
import torch

from orthon.data.tokenizer import load_tokenizer
from orthon.rl.config import BufferConfig
from orthon.rl.logprobs import sequence_log_probs
from orthon.rl.sample import Sample, SampleStatus
from orthon.rl.train_config import RLConfig
from orthon.rl.trainer import RLTrainer
from test_rl_loop import _pretrain_dir

pytestmark = pytest.mark.usefixtures("one_thread")

G = 4


def _trainer(tmp_path, name, **overrides):
    pre = _pretrain_dir(tmp_path / name)
    cfg = RLConfig(run_dir=str(tmp_path / name / "rl"), lr=1e-3, progress=False, micro_batch_size=3,
                   buffer=BufferConfig(num_repeat_per_sample=G, task_type="arithmetic"), **overrides)
    import yaml

    tokenizer = load_tokenizer(yaml.safe_load((pre / "config.yaml").read_text())["data"]["tokenizer"])
    return RLTrainer(cfg, pre / "final", tokenizer, tmp_path / name / "rl")


def _groups(trainer, rewards):
    """Groups of G samples with the given rewards; rollout log-probs are the trainer's own (rescore)."""
    g = torch.Generator().manual_seed(0)
    groups = []
    for i, row in enumerate(rewards):
        seqs = [torch.randint(3, 500, (9,), generator=g).tolist() for _ in row]
        with torch.no_grad():
            lp = sequence_log_probs(trainer.model, seqs, [4] * len(row)).log_probs
        groups.append([Sample(f"p{i}", s, response_length=4, loss_mask=[1] * 4, rollout_log_probs=lp[j].clone(),
                              reward=r, status=SampleStatus.COMPLETED) for j, (s, r) in enumerate(zip(seqs, row))])
    return groups


def _steps(trainer) -> int:
    return max((int(s["step"]) for s in trainer.optimizer.state.values()), default=0)


def test_updates_per_iteration_take_that_many_steps(tmp_path):
    trainer = _trainer(tmp_path, "a", updates_per_iteration=2)
    stats = trainer.train_on(_groups(trainer, [[1, 0, 0, 1], [0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 1, 1]]))
    assert _steps(trainer) == 2
    # The first step runs on the rollout's weights: no mismatch; the second is off-policy.
    assert stats["logp_mismatch_max"] == 0.0
    assert stats["logp_abs_diff"] > 0


def test_zero_std_groups_are_dropped_exactly(tmp_path):
    rewards = [[1, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    dropping = _trainer(tmp_path, "a", drop_zero_std_groups=True)
    groups = _groups(dropping, rewards)
    stats = dropping.train_on(groups)
    assert stats["groups_all_equal"] == 0.5 and stats["reward_mean"] == pytest.approx(7 / 16)
    # The same step as training on the informative groups alone (the normaliser counts their tokens only).
    alone = _trainer(tmp_path, "b")
    alone.train_on([groups[1], groups[3]])
    for p, q in zip(dropping.model.parameters(), alone.model.parameters()):
        assert torch.equal(p, q)
    # Keeping them changes the step: their tokens dilute the token-mean loss.
    keeping = _trainer(tmp_path, "c")
    keeping.train_on(groups)
    assert any(not torch.equal(p, q) for p, q in zip(keeping.model.parameters(), alone.model.parameters()))


def test_nothing_to_learn_takes_no_step(tmp_path):
    trainer = _trainer(tmp_path, "a", drop_zero_std_groups=True)
    before = [p.clone() for p in trainer.model.parameters()]
    stats = trainer.train_on(_groups(trainer, [[1, 1, 1, 1], [0, 0, 0, 0]]))
    assert _steps(trainer) == 0 and stats["groups_all_equal"] == 1.0 and "logp_mismatch_max" not in stats
    assert all(torch.equal(p, q) for p, q in zip(before, trainer.model.parameters()))
