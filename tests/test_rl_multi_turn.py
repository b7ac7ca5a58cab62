"""Tool-integrated multi-turn rollouts: the chat format and its parser, the token-exact session tree
with forks on re-tokenisation drift, and the rollout plug-in's handling of tools and bad output."""
import time

import pytest
import torch

from orthon.engine.protocol import GenerationResult
from orthon.engine.sampling import SamplingParams
from orthon.rl.chat import Message, ParseError, ToolCall, parse_tool_call, render, split_assistant
from orthon.rl.multi_turn import tool_rollout
from orthon.rl.rewards.registry import SafeReward
from orthon.rl.rollout import RolloutContext
from orthon.rl.sample import SampleStatus, branches
from orthon.rl.tasks import Prompt, arithmetic_reward
from orthon.rl.trajectory import Trajectory


# ------------------------------------------------------------------ the chat format
def test_render_keeps_or_clears_thinking():
    messages = [Message("system", "You can run python."), Message("user", "Q: 2+2=?"),
                Message("assistant", "```python tool_name=python\nprint(2+2)\n```", thinking="compute"),
                Message("observation", "4"), Message("assistant", "4", thinking="done")]
    assert render(messages, generation_prompt=False) == (
        "<|system|>\nYou can run python.<|user|>\nQ: 2+2=?<|assistant|>\n<think>compute</think>```python "
        "tool_name=python\nprint(2+2)\n```<|observation|>\n4<|assistant|>\n<think>done</think>4")
    cleared = render(messages, clear_thinking=True)
    assert "<think></think>```python" in cleared and "<think>done</think>4<|assistant|>\n" in cleared
    with pytest.raises(ValueError, match="role"):
        Message("tool", "x")


def test_split_assistant_takes_thinking_and_the_end_token_off():
    m = split_assistant("<think>a</think>```python tool_name=python\nx\n```<|observation|>")
    assert (m.thinking, m.content) == ("a", "```python tool_name=python\nx\n```")
    assert split_assistant("42<|user|>").content == "42" and split_assistant("42").thinking is None


@pytest.mark.parametrize("text,expected", [
    ("The answer is 4", None),
    ("```python\nprint(1)\n```", None),  # code shown, no tool named: not a call
    ("see\n```python tool_name=python\nprint(1)\n```\n", ToolCall("python", "print(1)\n")),
    ("```python  tool_name = calc \n1+1\n```", ToolCall("calc", "1+1\n")),
])
def test_parser_finds_calls(text, expected):
    assert parse_tool_call(text) == expected


@pytest.mark.parametrize("text,message", [
    ("```python tool_name=python\nprint(1)", "not closed"),
    ("```python tool_name=nosuch\n1\n```", "no tool named 'nosuch'"),
    ("```python tool_name=python\n   \n```", "empty"),
    ("tool_name=python\n```python\nprint(1)\n```", "header line"),
    (None, "expected text"),
])
def test_parser_turns_malformed_calls_into_errors(text, message):
    out = parse_tool_call(text, tools={"python"})
    assert isinstance(out, ParseError) and message in out.message


# ------------------------------------------------------------------ the session tree
def test_trajectory_extends_by_ids_and_forks_on_drift():
    t = Trajectory([1, 2, 3], "s")
    t.add_generated([10, 11], torch.tensor([-0.1, -0.2]))
    assert t.continue_with([1, 2, 3, 10, 11, 20, 21]) == [1, 2, 3, 10, 11, 20, 21] and t.forks == 0
    t.add_generated([12], torch.tensor([-0.3]))
    main_ids = t.ids()
    # The next context re-tokenises the first generated turn differently ([10, 11] -> [9]).
    t.continue_with([1, 2, 3, 9, 20, 21, 12, 30])
    assert t.forks == 1 and t.ids() == [1, 2, 3, 9, 20, 21, 12, 30]
    t.add_generated([13, 14], torch.tensor([-0.4, -0.5]))
    closed, head = t.branches()
    assert t.ids(closed) == main_ids  # the generated path's ids are untouched
    owned = set()
    first, second = t.branch_sample(closed, owned), t.branch_sample(head, owned)
    assert first["tokens"] == main_ids and first["loss_mask"] == [1, 1, 0, 0, 1]
    assert first["rollout_log_probs"].tolist() == pytest.approx([-0.1, -0.2, 0, 0, -0.3])
    # In the new branch only what was generated in it is trained: [9, 20, 21, 12, 30] were given.
    assert second["tokens"][3:] == [9, 20, 21, 12, 30, 13, 14] and second["loss_mask"] == [0] * 5 + [1, 1]


# ------------------------------------------------------------------ the rollout plug-in
class ScriptedEngine:
    """Speaks the Engine protocol; answers each session's turns from a script (the rollout's handling of
    tools, masks and forks is what is tested, not a model)."""

    def __init__(self, tokenizer, script, ids=None):
        self.tok, self.script, self.ids, self.calls, self.keys = tokenizer, script, ids or {}, [], []
        self.weight_version = 3

    def generate(self, prompts, sampling=None, routing_keys=None):
        self.calls.append([list(p) for p in prompts])
        self.keys.append(list(routing_keys))
        results = []
        for prompt, key in zip(prompts, routing_keys):
            turn = sum(key in keys for keys in self.keys) - 1
            text = self.script[turn]
            tokens = self.ids.get(turn) or self.tok.encode(text)
            results.append(GenerationResult(list(prompt), tokens, -0.5 * torch.ones(len(tokens)), "stop", 3))
        return results


def _ctx(tok, engine, **options):
    return RolloutContext(engine, tok, SafeReward(arithmetic_reward), SamplingParams(max_new_tokens=32, seed=5), 2,
                          options={"tools": {"calculator": "orthon.rl.tools.calculator"}, **options})


def _prompt(tok):
    text = "Q: 123*456=? A:"
    return Prompt("p0", text, tok.encode(text), "56088")


def test_tool_call_observation_answer(chat_tokenizer):
    tok = chat_tokenizer
    script = ["```python tool_name=calculator\nprint(123*456)\n```<|observation|>", "56088<|user|>"]
    engine = ScriptedEngine(tok, script)
    ctx = _ctx(tok, engine)
    samples = tool_rollout(ctx, [_prompt(tok)])
    assert len(samples) == 2 and [s.reward for s in samples] == [1.0, 1.0]
    s = samples[0]
    assert s.status is SampleStatus.COMPLETED and s.metadata["tool_calls"] == 1 and s.policy_version == 3
    # Tokens: the prompt, the call as generated, the observation turn (given), the answer as generated.
    gen1, gen2 = tok.encode(script[0]), tok.encode(script[1])
    observation = tok.encode("<|observation|>\n56088<|assistant|>\n")
    assert s.tokens[s.prompt_length:] == gen1 + observation + gen2
    assert s.loss_mask == [1] * len(gen1) + [0] * len(observation) + [1] * len(gen2)
    assert (s.rollout_log_probs == torch.tensor([-0.5] * len(gen1) + [0.0] * len(observation) + [-0.5] * len(gen2))).all()
    # Every request of a session carried its routing key; both turns of a session went as its own key.
    assert engine.keys == [["p0/0", "p0/1"], ["p0/0", "p0/1"]]
    # Second turn's prompt is the first turn's context + its generated ids exactly (token in, token out).
    assert engine.calls[1][0][: len(engine.calls[0][0]) + len(gen1)] == engine.calls[0][0] + gen1


def test_bad_calls_slow_tools_and_long_outputs_become_observations(chat_tokenizer):
    tok = chat_tokenizer
    cases = {
        "```python tool_name=calculator\nprint(1+1)<|observation|>": "not closed",
        "```python tool_name=shell\nls\n```<|observation|>": "no tool named 'shell'",
        "```python tool_name=slow\n1\n```<|observation|>": "no result after 0.2s",
        "```python tool_name=calculator\nimport os\n```<|observation|>": "tool error",
        "```python tool_name=calculator\n7**5000\n```<|observation|>": "[output truncated]",
    }
    for first, expected in cases.items():
        engine = ScriptedEngine(tok, [first, "2<|user|>"])
        ctx = _ctx(tok, engine, tool_timeout_s=0.2, max_observation_tokens=40,
                   tools={"calculator": "orthon.rl.tools.calculator", "slow": "test_rl_multi_turn.slow_tool"})
        ctx.stats = __import__("collections").Counter()
        start = time.monotonic()
        samples = tool_rollout(ctx, [_prompt(tok)])
        assert time.monotonic() - start < 10
        observation = tok.decode(samples[0].tokens[samples[0].prompt_length + len(tok.encode(first)):])
        assert expected in observation, (first, observation)
        assert samples[0].status is SampleStatus.COMPLETED
    assert ctx.stats["observations_truncated"] == 2  # the last case, both sessions


def slow_tool(code):
    time.sleep(5)
    return "late"


def test_turn_limit_truncates(chat_tokenizer):
    tok = chat_tokenizer
    call = "```python tool_name=calculator\n1+1\n```<|observation|>"
    samples = tool_rollout(_ctx(tok, ScriptedEngine(tok, [call] * 3), max_turns=3), [_prompt(tok)])
    assert all(s.status is SampleStatus.TRUNCATED and s.metadata["tool_calls"] == 3 and s.reward == 0.0 for s in samples)


def test_retokenisation_drift_forks_and_keeps_generated_ids(chat_tokenizer):
    tok = chat_tokenizer
    call = "```python tool_name=calculator\nprint(123*456)\n```<|observation|>"
    canonical = tok.encode(call)
    # The engine sampled the call as other ids that decode to the same text (one piece split in two).
    piece = next(i for i, t in enumerate(canonical) if len(tok.decode([t])) >= 3 and not tok.decode([t]).startswith("<"))
    text = tok.decode([canonical[piece]])
    split = tok.encode(text[0]) + tok.encode(text[1:])
    assert tok.decode(split) == text and split != [canonical[piece]]
    drifted = canonical[:piece] + split + canonical[piece + 1:]
    # Without drift, re-rendering reproduces the generated ids: no fork.
    same = tool_rollout(_ctx(tok, ScriptedEngine(tok, [call, "56088<|user|>"]), render_each_turn=True), [_prompt(tok)])
    assert same[0].metadata["forks"] == [] and sum(same[0].loss_mask) == len(canonical) + len(tok.encode("56088<|user|>"))
    engine = ScriptedEngine(tok, [call, "56088<|user|>"], ids={0: drifted})
    samples = tool_rollout(_ctx(tok, engine, render_each_turn=True), [_prompt(tok)])
    s = samples[0]
    assert len(s.metadata["forks"]) == 1
    main, fork = branches(s)[1], branches(s)[0]
    # The forked-away branch holds the generated ids exactly, trained; the continuing branch holds the
    # re-tokenised call as given context (mask 0) and trains only on the answer.
    assert main.tokens[main.prompt_length:main.prompt_length + len(drifted)] == drifted
    assert main.loss_mask == [1] * len(drifted)
    answer = tok.encode("56088<|user|>")
    assert fork.tokens[-len(answer):] == answer and sum(fork.loss_mask) == len(answer)
    assert fork.loss_mask[-len(answer):] == [1] * len(answer)


def test_python_tool_runs_in_the_sandbox():
    from orthon.rl.sandbox import sandbox_problem
    from orthon.rl.tools import calculator, python_tool

    problem = sandbox_problem()
    if problem:
        pytest.skip(f"no sandbox here: {problem}")
    assert python_tool("print(123456*789)") == "97406784\n"
    assert "ZeroDivisionError" in python_tool("1/0") and "[exit code 1]" in python_tool("1/0")
    assert calculator("print(123456*789)") == "97406784"
    with pytest.raises(ValueError, match="exponent"):
        calculator("2**100000")


class ToolUser:
    """Speaks the Engine protocol as a perfect tool user would: its first turn calls the calculator on
    the question's expression, its second copies the observation."""

    weight_version = 1

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def generate(self, prompts, sampling=None, routing_keys=None):
        results = []
        for prompt in prompts:
            text = self.tok.decode(list(prompt))
            if "<|observation|>" in text:
                answer = text.rsplit("<|observation|>", 1)[1].split("<|assistant|>")[0].strip()
                reply = f"{answer}<|user|>"
            else:
                expression = text.split("Q: ", 1)[1].split("=?", 1)[0]
                reply = f"```python tool_name=calculator\nprint({expression})\n```<|observation|>"
            tokens = self.tok.encode(reply)
            results.append(GenerationResult(list(prompt), tokens, -0.1 * torch.ones(len(tokens)), "stop", 1))
        return results


def test_evaluation_answers_through_the_rollout_plug_in(chat_tokenizer):
    """A tool task's held-out reward is measured with its tools, as training rolls out (it was single-turn:
    the call's text scored 0 whatever the model did)."""
    from orthon.rl.rollout_manager import RolloutManager
    from orthon.rl.train_config import RLConfig

    cfg = RLConfig(task="orthon.rl.tool_tasks.ToolArithmeticTask", task_args={"eval_size": 3}, eval_samples=2,
                   max_new_tokens=40, rollout="orthon.rl.multi_turn.tool_rollout",
                   rollout_args={"tools": {"calculator": "orthon.rl.tools.calculator"}, "max_turns": 3})
    manager = RolloutManager(cfg, chat_tokenizer, ToolUser(chat_tokenizer), seed=0)
    assert manager.evaluate() == {"eval_reward": 1.0, "eval_greedy": 1.0}
    assert not manager.counters  # evaluation's tool counters stay out of training's
    single = RolloutManager(RLConfig(task="orthon.rl.tool_tasks.ToolArithmeticTask", task_args={"eval_size": 3}),
                            chat_tokenizer, ToolUser(chat_tokenizer), seed=0)
    assert single.evaluate() == {"eval_reward": 0.0, "eval_greedy": 0.0}  # a call is not an answer
