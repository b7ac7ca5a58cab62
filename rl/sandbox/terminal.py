"""A terminal-style environment: tasks solved by one shell command inside the sandbox, with a binary checker.

Each task seeds a fresh sandbox workspace with its files (a log, a CSV, a word list), states what to
do ("print how many lines of log.txt contain ERROR", "write the distinct words of words.txt, sorted,
to sorted.txt"), and checks what the command left: its stdout, or the files it wrote. The prompt ends
in a shell prompt (``$ ``), so the answer is the command, one line, ending at the first newline (a
fenced ```bash block works too, for chat models).

``TerminalTask`` has ArithmeticTask's interface (sample / eval_set / reward_fn / state_dict), so it plugs
in as ``rl.task: orthon.rl.sandbox.terminal.TerminalTask``; the label is the task's spec as JSON, all the
reward needs to rebuild the workspace. ``execute`` runs a command for a spec in a fresh sandbox.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field

from orthon.core.errors import DataError
from orthon.rl.rewards.code import extract_code, output_lines
from orthon.rl.sandbox.pool import SandboxPool
from orthon.rl.sandbox.result import SandboxResult
from orthon.rl.sandbox.run import run_shell, shared_pool
from orthon.rl.tasks import GeneratedTask, Prompt, newline_stop_ids

KINDS = ("write_file", "count_matches", "sum_column", "sort_unique", "count_words")
SHELL_FENCES = ("bash", "sh", "shell", "console")
TIMEOUT_S = 5.0
MEMORY_MB = 256
_WORDS = ("apple", "river", "stone", "cloud", "maple", "ember", "delta", "orbit", "pixel", "quartz", "sable",
          "tundra", "violet", "willow", "zephyr", "amber", "cobalt", "falcon", "harbor", "lumen")
_LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")


@dataclass
class TerminalSpec:
    kind: str
    instruction: str
    files: dict[str, str] = field(default_factory=dict)  # seeded into the workspace
    expected_stdout: str | None = None  # compared line by line, trailing whitespace ignored
    expected_files: dict[str, str] = field(default_factory=dict)  # compared ignoring a trailing newline
    reference: str = ""  # a command that solves it (tests, and the answer shown to a reader)

    def to_label(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_label(cls, label: str) -> "TerminalSpec":
        try:
            data = json.loads(label)
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise DataError(f"terminal task label: not a TerminalSpec as JSON ({exc})") from None


def make_spec(rng: random.Random, kind: str) -> TerminalSpec:
    """One task of ``kind``, its files and expected outcome drawn from ``rng``."""
    if kind == "write_file":
        name = f"{rng.choice(_WORDS)}.txt"
        text = f"{rng.choice(_WORDS)} {rng.choice(_WORDS)} {rng.randint(1, 999)}"
        return TerminalSpec(kind, f"Create a file named {name} whose only line is: {text}",
                            expected_files={name: text + "\n"}, reference=f"echo '{text}' > {name}")
    if kind == "count_matches":
        level = rng.choice(_LEVELS)
        rows = [f"{rng.choice(_LEVELS)} {rng.choice(_WORDS)} {rng.randint(0, 99)}" for _ in range(rng.randint(10, 40))]
        rows[rng.randrange(len(rows))] = f"{level} {rng.choice(_WORDS)} 0"  # at least one: grep -c then exits 0
        count = sum(level in row for row in rows)
        return TerminalSpec(kind, f"Print how many lines of log.txt contain {level}.", {"log.txt": "\n".join(rows) + "\n"},
                            expected_stdout=str(count), reference=f"grep -c {level} log.txt")
    if kind == "sum_column":
        values = [rng.randint(1, 999) for _ in range(rng.randint(5, 20))]
        csv = "".join(f"{rng.choice(_WORDS)},{v}\n" for v in values)
        return TerminalSpec(kind, "Print the sum of the numbers in the second column of data.csv "
                            "(comma-separated, no header).", {"data.csv": csv}, expected_stdout=str(sum(values)),
                            reference="awk -F, '{s += $2} END {print s}' data.csv")
    if kind == "sort_unique":
        words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 30))]
        return TerminalSpec(kind, "Write the distinct words of words.txt, sorted alphabetically, one per line, "
                            "to sorted.txt.", {"words.txt": "\n".join(words) + "\n"},
                            expected_files={"sorted.txt": "\n".join(sorted(set(words))) + "\n"},
                            reference="sort -u words.txt > sorted.txt")
    if kind == "count_words":
        lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(2, 10))]
        return TerminalSpec(kind, "Print the number of words in text.txt.", {"text.txt": "\n".join(lines) + "\n"},
                            expected_stdout=str(sum(len(line.split()) for line in lines)),
                            reference="wc -w < text.txt")
    raise DataError(f"terminal task: unknown kind {kind!r}; choose from {KINDS}")


def extract_command(response: str) -> str:
    """The last fenced block (bash / sh preferred) if there is one, else the response's first line."""
    if "```" in (response or ""):
        return extract_code(response, SHELL_FENCES).strip()
    lines = (response or "").strip().splitlines()
    return lines[0].strip() if lines else ""


def execute(command: str, spec: TerminalSpec, pool: SandboxPool | None = None) -> SandboxResult:
    """Run ``command`` with /bin/sh in a fresh sandbox whose workspace holds the task's files; the files
    the task checks come back in ``result.files``."""
    return run_shell(command, TIMEOUT_S, MEMORY_MB, files=spec.files, collect=tuple(spec.expected_files), pool=pool)


def check(spec: TerminalSpec, result: SandboxResult) -> bool:
    """The binary checker: the command succeeded (exit 0, nothing cut) and left what the task asks for."""
    if result.status != "ok" or result.truncated:
        return False
    if spec.expected_stdout is not None and output_lines(result.stdout) != output_lines(spec.expected_stdout):
        return False
    for name, want in spec.expected_files.items():
        got = result.files.get(name)
        if got is None or got.decode(errors="replace").rstrip("\n") != want.rstrip("\n"):
            return False
    return True


def terminal_reward(response: str, label: str) -> float:
    """1 when the response's command solves the task of ``label`` (a TerminalSpec as JSON), else 0."""
    spec = TerminalSpec.from_label(label)
    command = extract_command(response)
    if not command:
        return 0.0
    return 1.0 if check(spec, execute(command, spec, pool=shared_pool())) else 0.0


def prompt_text(spec: TerminalSpec) -> str:
    files = ", ".join(sorted(spec.files)) or "none"
    return f"# Shell task (files: {files}): {spec.instruction}\n$ "


class TerminalTask(GeneratedTask):
    task_type = "terminal"
    reward_fn = staticmethod(terminal_reward)

    def __init__(self, tokenizer, seed: int = 0, eval_size: int = 100, kinds: tuple[str, ...] | list[str] = KINDS):
        unknown = [k for k in kinds if k not in KINDS]
        if not kinds or unknown:
            raise DataError(f"TerminalTask: kinds must be a non-empty subset of {KINDS}, got {list(kinds)}")
        super().__init__(tokenizer, seed, eval_size)
        self.kinds = tuple(kinds)
        self.stop_token_ids = newline_stop_ids(tokenizer)  # the command is one line

    def _prompt(self, rng: random.Random, instance_id: str) -> Prompt:
        spec = make_spec(rng, rng.choice(self.kinds))
        text = prompt_text(spec)
        return Prompt(instance_id, text, self.tokenizer.encode(text), spec.to_label())
