"""The package's shape, read from the source with ``ast``: the layer order of
docs/architecture.md, no import cycles, and the size limits (modules <= 500 lines, functions <=
80 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "specpilot"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "defaults", "config", "outpaths", "machine"),
    ("tree", "tokenizer", "workloads", "sampling", "kernels", "kvcache", "profiling"),
    ("model",),
    ("loading", "drafters", "peers"),
    ("verify", "goodput", "engine", "batch", "fastverify", "forcing", "bench", "plan", "training"),
    ("mechanisms", "runtime", "export", "plan_setup", "bench_batch", "costmodel"),
    ("pilot",),
    ("agent",),
    ("server",),
    ("cli",),
)
"""Low to high; a unit may import its own layer or lower ones (docs/architecture.md)."""

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _unit(module: str) -> str:
    """Layer unit of ``specpilot.a.b``: the top-level package or module (``cli_*`` -> cli)."""
    top = module.split(".")[1] if "." in module else ""
    return "cli" if top.startswith("cli") else top


def _layer(unit: str) -> int:
    for i, names in enumerate(LAYERS):
        if unit in names:
            return i
    raise AssertionError(f"specpilot.{unit} is in no layer: add it to docs/architecture.md")


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(SRC.rglob("*.py")):
        parts = f.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """specpilot modules ``name`` imports (anywhere in the file, lazy imports included)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import submodule` imports the submodule; other names come from pkg
            targets = [t for t in subs if t in known] or [base]
            if len(targets) < len(subs) and targets != [base]:
                targets.append(base)
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t.startswith("specpilot.") and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: _imports(n, p, known) for n, p in mods.items() if n != "specpilot"}


def test_imports_follow_the_layer_order() -> None:
    bad = []
    for mod, deps in _graph().items():
        for dep in deps:
            if dep == "specpilot":
                continue
            if _layer(_unit(dep)) > _layer(_unit(mod)):
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d) :], d]))
            elif d in graph and d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layer_test_can_fail() -> None:
    """A planted upward import is reported (the checks above are not vacuous)."""
    assert _layer(_unit("specpilot.cli_profile")) > _layer(_unit("specpilot.model"))
    with pytest.raises(AssertionError, match="in no layer"):
        _layer("no_such_unit")


def test_module_and_function_sizes() -> None:
    long_modules, long_functions = [], []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name}: {n} lines")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
