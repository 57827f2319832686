"""The static check of agent-written mechanism source (trusted side; the code is parsed, never run).

A source passes when it:
  * parses (``ast.parse``) and is at most :data:`MAX_SOURCE` characters;
  * imports only from the allow-list :data:`ALLOWED_IMPORTS` (``from MODULE import NAME`` with
    listed names; ``import MODULE`` only for :data:`WHOLE_MODULES`);
  * never names a dangerous builtin (:data:`FORBIDDEN_NAMES`: ``eval``, ``exec``, ``open``,
    ``__import__``, ``compile``, ``globals``, ``getattr`` ...), any dunder name other than the
    methods it defines, any dunder or frame/code attribute (``x.__class__``, ``f.f_globals``,
    ``__subclasses__``), or a string containing ``__``;
  * keeps module level to docstrings, imports, class and function definitions and assignments;
  * defines ``MECHANISMS = [...]`` (or a tuple) of instances of classes it defines, each class
    with literal string attributes ``id`` (new, ``agent_[a-z0-9_]{2,40}``), ``factor`` (one of
    tau / kernel / overhead) and ``description``, and methods ``space``, ``applicable`` and
    ``apply`` (``wrap_decode`` optional).
This is a first filter with clear reasons for the agent, not the security boundary: the runtime
sandbox (:mod:`.sandbox`) is. Known gaps are listed in docs/agent.md.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from specpilot.mechanisms.base import FACTORS


def _names(words: str) -> frozenset[str]:
    return frozenset(words.split())


MAX_SOURCE = 20_000
ID_RE = re.compile(r"^agent_[a-z0-9_]{2,40}$")
ALLOWED_IMPORTS: dict[str, frozenset[str]] = {
    "__future__": frozenset({"annotations"}),
    "specpilot.mechanisms.base": _names(
        "Context Param FACTORS no_drafter with_option parse_dataclass require check_params "
        "defaults record"
    ),
    "specpilot.plan": frozenset({"Plan", "AppliedMechanism"}),
    "specpilot.tree": frozenset({"TreeSpec"}),
    "dataclasses": frozenset({"dataclass", "field", "replace", "fields", "asdict"}),
    "typing": frozenset({"Any", "Callable", "ClassVar", "Final", "Literal", "Optional", "Union"}),
    "collections.abc": frozenset({"Callable", "Iterable", "Iterator", "Mapping", "Sequence"}),
    "collections": frozenset({"Counter", "OrderedDict", "defaultdict", "deque"}),
    "math": frozenset({"ceil", "floor", "log", "log2", "exp", "sqrt", "inf", "isfinite"}),
    "itertools": frozenset({"accumulate", "chain", "islice", "pairwise", "product"}),
}
WHOLE_MODULES = frozenset({"math"})
FORBIDDEN_NAMES = _names(
    "eval exec compile open __import__ globals locals vars getattr setattr delattr input "
    "breakpoint help memoryview exit quit dir __builtins__ __loader__ __spec__ object"
)
FORBIDDEN_ATTRS = _names(
    "f_globals f_locals f_builtins f_back f_code gi_frame gi_code cr_frame cr_code ag_frame "
    "ag_code tb_frame tb_next co_code mro format format_map"
)
REQUIRED_METHODS = ("space", "applicable", "apply")
_MODULE_LEVEL = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.Assign,
                 ast.AnnAssign)  # fmt: skip


class StaticReject(ValueError):
    """The source fails the static check; the message is the reason (shown to the agent)."""


@dataclass(frozen=True)
class MechanismInfo:
    """What the static check learned of one mechanism class (literal attributes only)."""

    id: str
    factor: str
    description: str
    class_name: str
    wraps_decode: bool


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _where(node: ast.AST) -> str:
    return f"line {getattr(node, 'lineno', '?')}"


def _check_node(node: ast.AST, defined_methods: set[str]) -> None:
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name not in WHOLE_MODULES:
                raise StaticReject(f"{_where(node)}: import of {a.name!r} is not allowed; "
                                   f"allowed: {sorted(ALLOWED_IMPORTS)}")  # fmt: skip
    elif isinstance(node, ast.ImportFrom):
        mod = node.module or ""
        if node.level or mod not in ALLOWED_IMPORTS:
            raise StaticReject(f"{_where(node)}: import from {mod!r} is not allowed; "
                               f"allowed: {sorted(ALLOWED_IMPORTS)}")  # fmt: skip
        for a in node.names:
            if a.name not in ALLOWED_IMPORTS[mod]:
                raise StaticReject(f"{_where(node)}: importing {a.name!r} from {mod!r} is not "
                                   f"allowed; allowed: {sorted(ALLOWED_IMPORTS[mod])}")  # fmt: skip
    elif isinstance(node, ast.Name):
        if node.id in FORBIDDEN_NAMES:
            raise StaticReject(f"{_where(node)}: forbidden name {node.id!r}")
        if _dunder(node.id) and node.id not in ("__name__",):
            raise StaticReject(f"{_where(node)}: dunder name {node.id!r} is not allowed")
    elif isinstance(node, ast.Attribute):
        if _dunder(node.attr) or node.attr in FORBIDDEN_ATTRS:
            raise StaticReject(f"{_where(node)}: attribute {node.attr!r} is not allowed")
    elif isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
        text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
        if "__" in text:
            raise StaticReject(f"{_where(node)}: strings containing '__' are not allowed")
    elif isinstance(node, ast.FunctionDef):
        if _dunder(node.name) and node.name not in ("__init__", "__post_init__"):
            raise StaticReject(f"{_where(node)}: defining {node.name!r} is not allowed")
        defined_methods.add(node.name)
    elif isinstance(node, (ast.Global, ast.Nonlocal)):
        raise StaticReject(f"{_where(node)}: global/nonlocal statements are not allowed")
    elif isinstance(node, (ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith)):
        raise StaticReject(f"{_where(node)}: async code is not allowed")


def check_source(
    source: str, taken_ids: frozenset[str] = frozenset(), relaxed: bool = False
) -> list[MechanismInfo]:
    """The mechanisms ``source`` defines; :class:`StaticReject` with the reason otherwise.
    ``taken_ids``: ids already used (built-in mechanisms, other agent sources). ``relaxed``
    (tests only: it exercises the runtime sandbox) checks syntax and the protocol, not names."""
    tree = check_syntax(source)
    if relaxed:
        return _mechanisms(tree, taken_ids)
    for stmt in tree.body:
        doc = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        if not doc and not isinstance(stmt, _MODULE_LEVEL):
            raise StaticReject(
                f"{_where(stmt)}: module-level {type(stmt).__name__} statements are not allowed "
                "(only imports, classes, functions and assignments)"
            )
    methods: set[str] = set()
    for node in ast.walk(tree):
        _check_node(node, methods)
    return _mechanisms(tree, taken_ids)


def check_syntax(source: str) -> ast.Module:
    """The parsed module; :class:`StaticReject` when it is too long or does not parse."""
    if not source.strip():
        raise StaticReject("the source is empty")
    if len(source) > MAX_SOURCE:
        raise StaticReject(f"the source has {len(source)} characters (limit {MAX_SOURCE})")
    try:
        return ast.parse(source)
    except SyntaxError as e:
        raise StaticReject(f"the source does not parse: line {e.lineno}: {e.msg}") from None
    except ValueError as e:  # e.g. null bytes
        raise StaticReject(f"the source does not parse: {e}") from None


def _literal_str(cls: ast.ClassDef, name: str) -> str | None:
    for stmt in cls.body:
        targets: list[ast.expr] = []
        value = None
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        for t in targets:
            if isinstance(t, ast.Name) and t.id == name:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    return value.value
                raise StaticReject(f"class {cls.name}: {name} must be a string literal")
    return None


def _mechanisms(tree: ast.Module, taken: frozenset[str]) -> list[MechanismInfo]:
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    listed: ast.expr | None = None
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MECHANISMS" for t in stmt.targets
        ):
            listed = stmt.value
    if listed is None:
        raise StaticReject("the module defines no MECHANISMS = [...] list")
    if not isinstance(listed, (ast.List, ast.Tuple)) or not listed.elts:
        raise StaticReject("MECHANISMS must be a non-empty list or tuple of instances")
    out: list[MechanismInfo] = []
    for elt in listed.elts:
        if not (isinstance(elt, ast.Call) and isinstance(elt.func, ast.Name)):
            raise StaticReject("MECHANISMS must list instances of classes the module defines")
        cls = classes.get(elt.func.id)
        if cls is None:
            raise StaticReject(f"MECHANISMS lists {elt.func.id}, which the module does not define")
        out.append(_info(cls, classes))
    ids = [m.id for m in out]
    if len(set(ids)) != len(ids):
        raise StaticReject(f"MECHANISMS has duplicate ids {ids}")
    for m in out:
        if m.id in taken:
            raise StaticReject(f"mechanism id {m.id!r} is already taken; choose a new id")
    return out


def _info(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> MechanismInfo:
    chain = [cls]  # single inheritance within the module only
    while chain[-1].bases:
        base = chain[-1].bases[0]
        if len(chain[-1].bases) > 1 or not isinstance(base, ast.Name) or base.id not in classes:
            raise StaticReject(f"class {chain[-1].name}: may only inherit from one class of the "
                               "same module")  # fmt: skip
        if classes[base.id] in chain:
            raise StaticReject(f"class {cls.name}: cyclic inheritance")
        chain.append(classes[base.id])

    def attr(name: str) -> str | None:
        return next((v for c in chain if (v := _literal_str(c, name)) is not None), None)

    methods = {f.name for c in chain for f in c.body if isinstance(f, ast.FunctionDef)}
    mid, factor, desc = attr("id"), attr("factor"), attr("description")
    if mid is None or factor is None or desc is None:
        raise StaticReject(f"class {cls.name}: needs string literals id, factor and description")
    if not ID_RE.match(mid):
        raise StaticReject(f"class {cls.name}: id {mid!r} must match {ID_RE.pattern}")
    if factor not in FACTORS:
        raise StaticReject(f"class {cls.name}: factor {factor!r} is not one of {FACTORS}")
    missing = [m for m in REQUIRED_METHODS if m not in methods]
    if missing:
        raise StaticReject(f"class {cls.name}: missing method(s) {missing} of the protocol")
    return MechanismInfo(mid, factor, desc, cls.name, "wrap_decode" in methods)
