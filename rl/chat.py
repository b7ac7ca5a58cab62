"""The chat format of the GLM-5 recipe, and the tool-call parser.

A conversation is a list of messages with one of four roles, each rendered as its role token, a
newline and its content:

    <|system|>\\nYou can run python.<|user|>\\nQ: 123456*789=?<|assistant|>\\n<think>too big to do
    by heart</think>```python tool_name=python\\nprint(123456*789)\\n```<|observation|>\\n97406784
    <|assistant|>\\n<think></think>97406784<|user|>

An assistant turn is ``<think>...</think>`` then its content; a tool call is a python fenced block in
it whose header carries ``tool_name=...``; the assistant hands over to the tool by ending its turn
with the ``<|observation|>`` token, and the tool's output comes back as an observation message
(attended to, never trained on). ``clear_thinking`` drops the thinking of every assistant turn but the
last one when the conversation is rendered again (interleaved thinking is kept otherwise). The parser
never raises on model output: no call, a call, or a parse error whose message becomes the observation.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "observation")
ROLE_TOKENS = {role: f"<|{role}|>" for role in ROLES}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Message:
    role: str
    content: str
    thinking: str | None = None  # assistant turns: the text of their <think> block

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r} is not one of {ROLES}")


def render_message(message: Message, keep_thinking: bool = True) -> str:
    body = message.content
    if message.role == "assistant" and message.thinking is not None:  # a turn without a block renders as generated
        thinking = message.thinking if keep_thinking else ""
        body = f"{THINK_OPEN}{thinking}{THINK_CLOSE}{body}"
    return f"{ROLE_TOKENS[message.role]}\n{body}"


def render(messages: list[Message], clear_thinking: bool = False, generation_prompt: bool = True) -> str:
    """The conversation as text; with ``generation_prompt`` it ends with an open assistant turn."""
    last_assistant = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
    text = "".join(render_message(m, keep_thinking=not clear_thinking or i == last_assistant)
                   for i, m in enumerate(messages))
    return text + (f"{ROLE_TOKENS['assistant']}\n" if generation_prompt else "")


class ChatTemplate:
    """The chat format as a server renders OpenAI conversations with it (orthon.engine.openai_api.ChatFormat):
    an assistant turn ends where the model opens the next turn, a user's or a tool's."""

    stop = (ROLE_TOKENS["user"], ROLE_TOKENS["observation"])
    think = (THINK_OPEN, THINK_CLOSE)

    def render(self, messages: list[tuple[str, str]]) -> str:
        return render([Message(role, content) for role, content in messages])


def split_assistant(text: str) -> Message:
    """An assistant turn's generated text (after its role line) as a Message: the thinking block
    apart, the end-of-turn role token stripped."""
    for token in ROLE_TOKENS.values():
        if text.endswith(token):
            text = text[: -len(token)]
            break
    thinking = None
    if text.startswith(THINK_OPEN) and THINK_CLOSE in text:
        thinking, text = text[len(THINK_OPEN):].split(THINK_CLOSE, 1)
    return Message("assistant", text, thinking)


@dataclass
class ToolCall:
    tool: str
    code: str


@dataclass
class ParseError:
    message: str  # what is wrong, written for the model: it becomes the observation


_FENCE = re.compile(r"```python([^\n`]*)\n(.*?)(```|\Z)", re.S)
_TOOL_NAME = re.compile(r"\btool_name\s*=\s*([A-Za-z_][\w.-]*)")


def parse_tool_call(text: str, tools=None) -> ToolCall | ParseError | None:
    """The first tool call in an assistant turn's content. None: the turn calls no tool (a python
    block without ``tool_name=`` is just code shown to the user). ``tools``: the names that exist."""
    if not isinstance(text, str):
        return ParseError(f"tool call: expected text, got {type(text).__name__}")
    for match in _FENCE.finditer(text):
        header, code, closing = match.groups()
        name = _TOOL_NAME.search(header)
        if name is None:
            continue
        if not closing:
            return ParseError("tool call: the ```python block is not closed with ```")
        tool = name.group(1)
        if tools is not None and tool not in tools:
            return ParseError(f"tool call: no tool named {tool!r} (available: {', '.join(sorted(tools))})")
        if not code.strip():
            return ParseError(f"tool call to {tool}: the code block is empty")
        return ToolCall(tool, code)
    if re.search(r"```python[^\n`]*\btool_name\s*=", text) is None and "tool_name=" in text:
        return ParseError("tool call: tool_name= must be in the header line of a ```python block")
    return None
