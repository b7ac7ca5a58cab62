"""Imports point one way: core <- data, optim <- pretrain <- engine <- midtrain, rl, backends <- launch.

Every import of every module (function-level ones too) is read with ast; an import of a package at the
same or a higher layer, other than the module's own package, fails, and so does any cycle between
modules."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"core": 0, "data": 1, "optim": 1, "pretrain": 2, "engine": 3, "midtrain": 4, "rl": 4, "backends": 4,
          "launch": 5}


def _modules() -> dict[str, Path]:
    out = {}
    for top in LAYERS:
        for path in sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else []:
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out["orthon." + ".".join(parts)] = path
    return out


def _imports(path: Path, name: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                parts = name.split(".")
                base = parts[: len(parts) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}  # `from pkg import submodule`
    return {m for m in found if m.startswith("orthon.")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path, name) if m in modules and m != name} for name, path in modules.items()}


def test_layer_map_covers_every_package():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages <= set(LAYERS), f"packages without a layer: {sorted(packages - set(LAYERS))}"


def test_no_upward_or_sideways_import():
    graph = _graph()
    # The checker reads the real modules and their real imports (on an empty graph it would pass
    # vacuously): a module-level import and a function-level one, downward, both seen.
    assert "orthon.core.metrics" in graph["orthon.pretrain.trainer"]
    assert "orthon.optim.ablation" in graph["orthon.launch.cmd_ablate"]  # inside run()
    bad = []
    for name, targets in graph.items():
        own = name.split(".")[1]
        for target in targets:
            other = target.split(".")[1]
            if other != own and LAYERS[other] >= LAYERS[own]:
                bad.append(f"{name} imports {target} ({own} is layer {LAYERS[own]}, {other} layer {LAYERS[other]})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_a_planted_upward_import(tmp_path):
    """The parser must catch both import styles, at module and function level."""
    src = tmp_path / "m.py"
    src.write_text("import orthon.launch.cli\ndef f():\n    from orthon.rl import trainer\n")
    assert _imports(src, "orthon.data.m") >= {"orthon.launch.cli", "orthon.rl", "orthon.rl.trainer"}
