"""The terminal-style environment (orthon.rl.sandbox.terminal): each kind of task is solved by its reference
command and failed by near misses, the checker reads what the sandbox left, and TerminalTask behaves as
ArithmeticTask does (deterministic eval set, resumable training stream, one-line answers)."""
import json
import random

import pytest

from orthon.core.errors import DataError
from orthon.data.tokenizer import load_tokenizer
from orthon.rl.sandbox import SandboxPool, sandbox_problem
from orthon.rl.sandbox.terminal import (
    KINDS,
    TerminalSpec,
    TerminalTask,
    check,
    execute,
    extract_command,
    make_spec,
    terminal_reward,
)
from test_data_support import train_tiny_tokenizer

needs_sandbox = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")


def _near_miss(spec: TerminalSpec) -> str:
    """A command that does almost what the task asks: a count one off, a file one character short."""
    if spec.expected_stdout is not None:
        return f"echo {int(spec.expected_stdout) + 1}"
    (name, want), = spec.expected_files.items()
    return f"printf '%s\\n' '{want.rstrip()[:-1]}' > {name}"


@needs_sandbox
@pytest.mark.parametrize("kind", KINDS)
def test_reference_solves_and_near_misses_fail(kind):
    with SandboxPool(2) as pool:
        for seed in range(2):
            spec = make_spec(random.Random(seed), kind)
            result = execute(spec.reference, spec, pool=pool)
            assert check(spec, result), (spec, result)
            missed = execute(_near_miss(spec), spec, pool=pool)
            assert missed.status == "ok" and not check(spec, missed)
            # The seeded files are there for the command and gone for the next task.
            assert execute("ls", spec, pool=pool).stdout.split() == sorted(spec.files)


def test_specs_hold_what_their_checker_needs():
    rng = random.Random(5)
    spec = make_spec(rng, "count_matches")
    level = spec.instruction.split()[-1].rstrip(".")
    assert spec.expected_stdout == str(sum(level in line for line in spec.files["log.txt"].splitlines()))
    assert int(spec.expected_stdout) >= 1  # grep -c exits 1 on no match; a task always has one
    spec = make_spec(rng, "sum_column")
    assert spec.expected_stdout == str(sum(int(row.split(",")[1]) for row in spec.files["data.csv"].splitlines()))
    spec = make_spec(rng, "sort_unique")
    words = spec.files["words.txt"].split()
    assert spec.expected_files["sorted.txt"].split() == sorted(set(words))
    assert TerminalSpec.from_label(spec.to_label()) == spec
    with pytest.raises(DataError, match="unknown kind"):
        make_spec(rng, "rm_rf")
    for bad in ("not json", json.dumps({"kind": "x", "nope": 1})):
        with pytest.raises(DataError, match="not a TerminalSpec"):
            TerminalSpec.from_label(bad)


@pytest.mark.parametrize("response, command", [
    ("wc -l log.txt\nand then some text", "wc -l log.txt"),
    ("  grep -c ERROR log.txt  ", "grep -c ERROR log.txt"),
    ("Use this:\n```bash\nsort -u words.txt > sorted.txt\n```\n", "sort -u words.txt > sorted.txt"),
    ("```python\nprint(1)\n```\n```sh\necho 2\n```", "echo 2"),
    ("", ""),
    ("\n\n", ""),
])
def test_extract_command(response, command):
    assert extract_command(response) == command


@needs_sandbox
def test_reward_is_binary_and_holds_against_hostile_commands():
    spec = make_spec(random.Random(1), "count_words")
    label = spec.to_label()
    assert terminal_reward(spec.reference, label) == 1.0
    assert terminal_reward(f"```bash\n{spec.reference}\n```", label) == 1.0
    assert terminal_reward("", label) == 0.0
    assert terminal_reward(f"echo {spec.expected_stdout}; exit 1", label) == 0.0  # right output, failed command
    assert terminal_reward("cat /etc/shadow; cat /root/.bashrc", label) == 0.0
    assert terminal_reward("while :; do :; done", label) == 0.0  # times out (TIMEOUT_S), scored 0
    spec = make_spec(random.Random(2), "write_file")
    name = next(iter(spec.expected_files))
    assert terminal_reward(f"ln -s /etc/passwd {name}", spec.to_label()) == 0.0  # never read through a link


def test_task_interface_matches_arithmetic_task(tmp_path):
    tokenizer = load_tokenizer(train_tiny_tokenizer(tmp_path / "tok"))
    task = TerminalTask(tokenizer, seed=3, eval_size=6, kinds=["count_words", "sum_column"])
    assert task.task_type == "terminal" and task.reward_fn is terminal_reward
    assert task.stop_token_ids and all("\n" in tokenizer.decode([i]) for i in task.stop_token_ids)
    first = task.sample(4)
    assert [p.instance_id for p in first] == ["train-0", "train-1", "train-2", "train-3"]
    for prompt in first:
        spec = TerminalSpec.from_label(prompt.label)
        assert spec.kind in ("count_words", "sum_column")
        assert prompt.text.endswith("\n$ ") and spec.instruction in prompt.text
        assert tokenizer.decode(prompt.ids) == prompt.text
    state = task.state_dict()
    after = task.sample(3)
    resumed = TerminalTask(tokenizer, seed=3, eval_size=6, kinds=["count_words", "sum_column"])
    resumed.load_state_dict(state)
    assert [p.label for p in resumed.sample(3)] == [p.label for p in after]
    assert [p.label for p in task.eval_set()] == [p.label for p in resumed.eval_set()]
    assert {p.label for p in task.eval_set()}.isdisjoint(p.label for p in first + after)
    with pytest.raises(DataError, match="kinds must be"):
        TerminalTask(tokenizer, kinds=["count_words", "sudo"])
