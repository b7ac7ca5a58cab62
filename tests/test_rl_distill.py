"""On-policy distillation: prompts mixed from the teachers' sets by ratio, every prompt scored by the
teacher of its set only, the form-2 advantage is the teacher's log-ratio, and the student's reverse
KL to its teacher falls over a short run."""
import json
from collections import Counter

import pytest
import torch
import yaml

from orthon.core.config import build
from orthon.data.tokenizer import load_tokenizer
from orthon.engine.in_process import InProcessEngine
from orthon.engine.sampling import SamplingParams
from orthon.pretrain import GLMForCausalLM, ModelConfig, RuntimeOptions
from orthon.pretrain.logprobs import sequence_log_probs
from orthon.pretrain.weights import load_config, load_weights, save_weights
from orthon.rl.distill import MixedTask, opd_rollout
from orthon.rl.recipe import load_rl_recipe
from orthon.rl.rewards.registry import SafeReward
from orthon.rl.rollout import RolloutContext
from orthon.rl.trainer import RLTrainer
from orthon.rl.train_config import RLConfig
from pretrain_support import MODEL
from test_rl_loop import _pretrain_dir

pytestmark = pytest.mark.usefixtures("one_thread")
SETS = [{"name": "reasoning", "task": "orthon.rl.tasks.ArithmeticTask", "task_args": {"difficulty": 2}, "ratio": 3},
        {"name": "general", "task": "orthon.rl.tasks.ArithmeticTask", "task_args": {"difficulty": 1}, "ratio": 1}]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A pretraining-run directory (student) and two teachers with other weights."""
    root = tmp_path_factory.mktemp("opd")
    pre = _pretrain_dir(root)
    config = load_config(pre / "final")
    teachers = {}
    for seed, name in ((11, "reasoning"), (12, "general")):
        torch.manual_seed(seed)
        teacher = GLMForCausalLM(config, runtime=RuntimeOptions(sparse_attention=True))
        with torch.no_grad():  # a confident teacher: far from the (near-uniform) random student
            teacher.lm_head.weight.mul_(40.0)
        save_weights(teacher, root / name)
        teachers[name] = str(root / name)
    tokenizer = load_tokenizer(yaml.safe_load((pre / "config.yaml").read_text())["data"]["tokenizer"])
    return pre, teachers, tokenizer


def test_mixed_task_draws_by_ratio_and_resumes(world):
    _, _, tok = world
    task = MixedTask(tok, seed=3, sets=SETS)
    prompts = task.sample(400)
    counts = Counter(p.source for p in prompts)
    assert abs(counts["reasoning"] / 400 - 0.75) < 0.06
    assert all(p.instance_id.startswith(p.source + "/") and p.label[0] == p.source for p in prompts)
    state = task.state_dict()
    again = MixedTask(tok, seed=3, sets=SETS)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert [p.instance_id for p in again.sample(20)] == [p.instance_id for p in task.sample(20)]
    assert task.reward_fn(" 5", ["general", "5"]) == 1.0


def test_every_prompt_is_scored_by_its_own_teacher(world):
    pre, teachers, tok = world
    student = load_weights(pre / "final")
    task = MixedTask(tok, seed=5, sets=SETS)
    ctx = RolloutContext(InProcessEngine(student), tok, SafeReward(task.reward_fn),
                         SamplingParams(max_new_tokens=5, seed=1, stop_token_ids=()), 1,
                         options={"teachers": teachers})
    prompts = task.sample(8)
    samples = opd_rollout(ctx, prompts)
    models = {name: load_weights(path) for name, path in teachers.items()}
    assert {s.metadata["teacher"] for s in samples} == {"reasoning", "general"}
    for prompt, sample in zip(prompts, samples):
        assert sample.metadata["teacher"] == prompt.source
        own = sequence_log_probs(models[prompt.source], [sample.tokens], [sample.response_length]).log_probs[0]
        other = sequence_log_probs(models[({"reasoning", "general"} - {prompt.source}).pop()],
                                   [sample.tokens], [sample.response_length]).log_probs[0]
        # (scored in a batch of its set, here alone: equal to float round-off, not bit for bit)
        torch.testing.assert_close(sample.teacher_log_probs, own, rtol=1e-5, atol=1e-3)
        assert (sample.teacher_log_probs - other).abs().max() > 1.0


def test_missing_teacher_is_a_clear_error(world):
    pre, teachers, tok = world
    task = MixedTask(tok, seed=5, sets=SETS)
    ctx = RolloutContext(InProcessEngine(load_weights(pre / "final")), tok, SafeReward(task.reward_fn),
                         SamplingParams(max_new_tokens=3, seed=1), 1, options={"teachers": {"reasoning": teachers["reasoning"]}})
    with pytest.raises(Exception, match="no teacher"):
        opd_rollout(ctx, [p for p in task.sample(16) if p.source == "general"][:1])


def test_opd_config_sets_the_stage_up():
    cfg = build(RLConfig, {"opd": {"teachers": [{"name": "a", "weights": "x"}, {"name": "b", "weights": "y", "ratio": 2}]}})
    assert cfg.task == "orthon.rl.distill.MixedTask" and cfg.rollout == "orthon.rl.distill.opd_rollout"
    assert cfg.buffer.num_repeat_per_sample == 1 and cfg.rollout_args["teachers"] == {"a": "x", "b": "y"}
    assert [s["ratio"] for s in cfg.task_args["sets"]] == [1.0, 2.0]
    # GLM-5's batch: 1024 samples of group size 1 an iteration, whatever prompts_per_iteration said.
    assert (cfg.prompts_per_iteration, cfg.buffer.num_repeat_per_sample) == (1024, 1)


def test_opd_batch_size_sets_the_prompts_an_iteration():
    teachers = [{"name": "a", "weights": "x"}]
    cfg = build(RLConfig, {"prompts_per_iteration": 7, "opd": {"batch_size": 12, "group_size": 3, "teachers": teachers}})
    assert (cfg.prompts_per_iteration, cfg.buffer.num_repeat_per_sample) == (4, 3)
    with pytest.raises(Exception, match="opd.batch_size: must be a multiple of opd.group_size"):
        build(RLConfig, {"opd": {"batch_size": 10, "group_size": 3, "teachers": teachers}})


def _opd_trainer(tmp_path, world, form, iterations=8):
    pre, teachers, tok = world
    path = tmp_path / "opd.yaml"
    path.write_text(yaml.safe_dump({
        "train": {"run_dir": str(tmp_path / "run"), "progress": False, "micro_batch_size": 16,
                  "init_from": str(pre / "final"), "checkpoint_interval": 100},
        "schedule": {"peak_lr": 3e-3, "floor_lr": 3e-3},
        "rl": {"iterations": iterations, "prompts_per_iteration": 16, "max_new_tokens": 6, "eval_interval": 0,
               "eval_samples": 1, "task_args": {"eval_size": 2},
               "opd": {"form": form, "batch_size": 16, "teachers": [{**s, "weights": teachers[s["name"]]} for s in SETS]}}}))
    recipe = load_rl_recipe(path)
    recipe.model = load_config(pre / "final")
    return RLTrainer(recipe, tok, log=lambda *a: None)


def test_form2_gradient_is_the_reverse_kl_gradient():
    """Form 2 with the student's own samples estimates the gradient of KL(student || teacher): with
    4000 samples of one context the step's gradient points along the exact one (reverse KL, mode seeking)."""
    import copy
    from types import SimpleNamespace

    from orthon.rl.config import LossConfig, OPDConfig
    from orthon.rl.loss import full_vocab_kl
    from orthon.rl.sample import Sample, SampleStatus
    from orthon.rl.steps import PolicyStep

    torch.manual_seed(0)
    model = GLMForCausalLM(ModelConfig(**{**MODEL, "vocab_size": 512}))
    teacher = copy.deepcopy(model)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(4.0)  # the student's own distribution, sharper
        context = torch.tensor([[5, 17, 33, 60]])
        student_logits, teacher_logits = model(context).logits[0, -1].float(), teacher(context).logits[0, -1].float()
    tokens = torch.multinomial(student_logits.softmax(-1), 4000, replacement=True, generator=torch.Generator().manual_seed(1))
    s_lp, t_lp = student_logits.log_softmax(-1)[tokens], teacher_logits.log_softmax(-1)[tokens]
    batch = [(Sample("x", [5, 17, 33, 60, int(t)], 1, [1], s_lp[i : i + 1].clone(), 0.0, status=SampleStatus.COMPLETED,
                     teacher_log_probs=t_lp[i : i + 1].clone()), 0.0) for i, t in enumerate(tokens)]

    class OneRank:
        device, world, rank, data_world, data_rank = torch.device("cpu"), 1, 0, 1, 0
        cfg = SimpleNamespace(micro_batch_size=1000)

    step = PolicyStep(LossConfig(), opd=OPDConfig())
    step.begin(OneRank(), batch)
    for micro in step.micro_batches(batch, 1000, "cpu"):
        step.loss(model, micro)[0].backward()
    estimate = model.lm_head.weight.grad.flatten().clone()
    model.zero_grad()
    full_vocab_kl(model(context).logits[0, -1:], teacher_logits[None]).sum().backward()
    exact = model.lm_head.weight.grad.flatten()
    assert torch.nn.functional.cosine_similarity(estimate, exact, dim=0) > 0.9
    # The metric is the sampled estimate of that KL.
    kl = float(full_vocab_kl(student_logits[None], teacher_logits[None]))
    assert float((s_lp - t_lp).mean()) == pytest.approx(kl, rel=0.15)


def test_form1_runs_with_the_teacher_models(tmp_path, world):
    trainer = _opd_trainer(tmp_path, world, "kl_penalty", iterations=2)
    before = [p.clone() for p in trainer.model.parameters()]
    trainer.fit()
    assert any(not torch.equal(p, q) for p, q in zip(before, trainer.model.parameters()))


def _tagging_rollout(ctx, prompts):
    """A rollout plug-in for the dispatch test: one Sample per request, recording the settings it got."""
    from orthon.rl.sample import Sample, SampleStatus

    return [Sample(p.instance_id, list(p.ids) + [7], response_length=1, loss_mask=[1], status=SampleStatus.COMPLETED,
                   rollout_log_probs=torch.tensor([-0.5]),
                   metadata={"set": p.source, "settings": dict(ctx.options)})
            for p in prompts for _ in range(ctx.group_size)]


def test_each_set_is_answered_through_its_own_rollout_in_prompt_order():
    """A tool set's prompts go through its multi-turn rollout with its settings, the others single-turn,
    and the samples come back in the prompts' order (each prompt's group together)."""
    from orthon.rl.distill import student_samples
    from orthon.rl.tasks import Prompt

    prompts = [Prompt(f"{name}/{i}", "q", [1, 2], "3", source=name)
               for i, name in enumerate(["tools", "plain", "tools", "plain"])]
    ctx = RolloutContext(engine=None, tokenizer=None, reward=None, sampling=None, group_size=2,
                         options={"teachers": {"tools": "w1", "plain": "w2"},
                                  "rollouts": {"tools": ["test_rl_distill._tagging_rollout", {"max_turns": 3}],
                                               "plain": ["test_rl_distill._tagging_rollout", {}]}})
    samples = student_samples(ctx, prompts)
    assert [s.instance_id for s in samples] == ["tools/0", "tools/0", "plain/1", "plain/1",
                                                "tools/2", "tools/2", "plain/3", "plain/3"]
    assert all(s.metadata["settings"] == ({"max_turns": 3} if s.metadata["set"] == "tools" else {}) for s in samples)


def test_teacher_rollout_settings_reach_the_rollout_options():
    cfg = build(RLConfig, {"opd": {"teachers": [
        {"name": "tools", "weights": "w", "task": "orthon.rl.tool_tasks.ToolArithmeticTask",
         "rollout": "orthon.rl.multi_turn.tool_rollout", "rollout_args": {"max_turns": 2}},
        {"name": "plain", "weights": "v"}]}})
    assert cfg.rollout == "orthon.rl.distill.opd_rollout"
    assert cfg.rollout_args["rollouts"] == {"tools": ["orthon.rl.multi_turn.tool_rollout", {"max_turns": 2}],
                                            "plain": ["orthon.rl.rollout.single_turn", {}]}
