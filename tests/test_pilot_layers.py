"""The pilot and agent packages keep their place in the layer order (costmodel < pilot < agent <
server < cli): read from the source with ``ast``, the pilot imports nothing of agent, server or
the CLI, the agents nothing of server or the CLI; no import cycle among their modules; no module
over 500 lines and no function over 80."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "specpilot"


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("specpilot")}


FILES = sorted([*(SRC / "pilot").glob("*.py"), *(SRC / "agent").glob("*.py")])
MODULES = {_module(p): _imports(p) for p in FILES}


@pytest.mark.parametrize(
    ("package", "above"),
    [("specpilot.pilot", ("specpilot.agent", "specpilot.server", "specpilot.cli")),
     ("specpilot.agent", ("specpilot.server", "specpilot.cli"))],
)  # fmt: skip
def test_no_import_against_the_layer_order(package: str, above: tuple[str, ...]) -> None:
    bad = {m: sorted(d for d in deps if d.startswith(above))
           for m, deps in MODULES.items() if m.startswith(package)}  # fmt: skip
    assert not {m: d for m, d in bad.items() if d}


def test_no_import_cycle_among_pilot_and_agent_modules() -> None:
    graph = {m: {d for d in deps if d in MODULES and d != m} for m, deps in MODULES.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(m):], m]))
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_module_and_function_sizes(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 500
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno - node.lineno + 1 <= 80, f"{path.name}:{node.name}"
