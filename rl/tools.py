"""Tools a model can call from an assistant turn (orthon.rl.multi_turn): ``fn(code: str) -> str``.

``python`` runs the code in the sandbox (orthon.rl.sandbox) and returns what it printed (stdout, then
stderr; the status when it did not finish normally). ``calculator`` evaluates one arithmetic
expression (integers, + - * / // % ** and parentheses) without running any code: a tool for the
built-in arithmetic task that needs no sandbox.
"""
from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_POWER = 10_000  # a ** b with a larger exponent is refused (it could take any time and memory)


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
            raise ValueError(f"exponent {right} is larger than {MAX_POWER}")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculator(code: str) -> str:
    """The value of the last line that is an expression ('print(...)' around it is allowed)."""
    line = [l for l in code.strip().splitlines() if l.strip()][-1].strip()
    if line.startswith("print(") and line.endswith(")"):
        line = line[len("print("):-1]
    return str(_eval(ast.parse(line, mode="eval")))


def python_tool(code: str, timeout_s: float = 10.0, memory_mb: int = 512, max_chars: int = 4000) -> str:
    """Run the code in the sandbox (the shared warm pool) and return what a model is shown of it."""
    from orthon.rl.sandbox import observation, run_code, shared_pool

    text, _ = observation(run_code(code, timeout_s=timeout_s, memory_mb=memory_mb, pool=shared_pool()), max_chars)
    return text
