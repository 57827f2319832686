"""``specpilot memory list|show|export|import``: inspect and share the mechanism memory.

``export`` writes JSON keyed by context and idempotency keys (portable between machines);
``import`` merges such a file (entries already present are skipped, so importing twice changes
nothing). ``show EFFECT_ID`` says, field by field, why the entry's context is judged similar to
the current one (``--against CONTEXT_ID``, default the newest context: the latest run's), then
prints the entry as JSON (``--json``: the JSON only). The database is never replaced or
truncated by these commands.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specpilot.errors import ConfigError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "memory",
        help="list, show, export or import mechanism memory",
        description="Inspect and share the pilot's mechanism memory (SQLite).",
    )
    p.add_argument("action", choices=["list", "show", "export", "import"])
    p.add_argument("target", nargs="?", default=None,
                   help="show: effect id or mechanism id; export/import: JSON file "
                   "(export: default stdout)")  # fmt: skip
    p.add_argument("--memory", default="~/.cache/specpilot/memory.sqlite",
                   help="memory database (default: %(default)s)")  # fmt: skip
    p.add_argument("--limit", type=int, default=50, help="list: rows to show")
    p.add_argument("--against", type=int, default=None, metavar="CONTEXT_ID",
                   help="show: the context to compare the entry's with (the ctx #N of `memory "
                   "list`; default: the newest)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="show: print the JSON only")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def run(args: argparse.Namespace) -> int:
    from specpilot.pilot.memory import Memory

    path = Path(args.memory).expanduser()
    if args.action != "import" and not path.exists():
        raise ConfigError(f"--memory {path}: no memory database there yet (run optimize first)")
    if args.action == "show" and not args.target:
        raise ConfigError("memory show needs an effect id or a mechanism id")
    doc = _read_import(args.target) if args.action == "import" else None
    if args.action == "export" and args.target:
        from specpilot.outpaths import check_output_path

        check_output_path(args.target, "memory export")
    created = not path.exists()
    try:
        mem = Memory(path)
    except BaseException:
        if created:
            _remove_db(path)
        raise
    try:
        if args.action == "list":
            _list(mem, args.limit)
        elif args.action == "show":
            doc = mem.show(args.target, args.against)
            if "similarity" in doc and not args.json:
                _why_similar(doc["similarity"])
            print(json.dumps(doc, indent=2, default=str))
        elif args.action == "export":
            text = json.dumps(mem.export(), indent=2, sort_keys=True) + "\n"
            if args.target:
                Path(args.target).write_text(text)
            else:
                sys.stdout.write(text)
        else:
            added = mem.import_json(doc)
            print("imported: " + ", ".join(f"{v} {k}" for k, v in added.items()))
    except BaseException:
        mem.close()
        if created:  # a failed import leaves no empty database behind
            _remove_db(path)
        raise
    mem.close()
    return 0


def _read_import(target: str | None) -> Any:
    """The JSON document of ``memory import FILE``, read before the database is opened."""
    if not target:
        raise ConfigError("memory import needs a JSON file (from memory export)")
    try:
        doc = json.loads(Path(target).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(
            f"memory import: {target} is not a text file (not UTF-8); give a JSON file written "
            "by specpilot memory export"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"memory import: cannot read {target}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != "specpilot-memory":
        raise ConfigError(
            f"memory import: {target} is not a specpilot memory export (format mismatch)"
        )
    return doc


def _remove_db(path: Path) -> None:
    """Remove a database this command created (and SQLite's side files)."""
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        p.unlink(missing_ok=True)


def _list(mem: Any, limit: int) -> None:
    from rich.table import Table

    rows = mem.list_entries(limit)
    counts = mem.counts()
    t = Table(title=f"mechanism memory: {mem.path} ("
              + ", ".join(f"{v} {k}" for k, v in counts.items()) + ")")  # fmt: skip
    for col in ("id", "mechanism", "params", "speedup", "context", "kind", "factor deltas"):
        t.add_column(col, overflow="fold")
    for r in rows:
        extra = " ".join(str(r[k]) for k in ("isa", "weights") if r.get(k))
        vocab = f" v{r['vocab_size']}" if r.get("vocab_size") else ""
        ctx = (
            f"ctx #{r['context_id']}: {r['arch']} {r['params_m']:.0f}M{vocab} "
            f"{r['drafter_kind']} {r['device']} {r['dtype']} b{r['batch_size']} {extra}"
        )
        deltas = json.loads(r["factor_deltas"] or "{}")
        t.add_row(str(r["id"]), r["mechanism_id"], r["params"],
                  f"{r['speedup']:.3f} ± {r['spread']:.3f}", ctx, r["kind"],
                  ", ".join(f"{k} {v:+.2f}" for k, v in deltas.items()))  # fmt: skip
    _console().print(t)


def _why_similar(sim: dict[str, Any]) -> None:
    """The similarity reasons of ``memory show`` as a table: per field, both values, whether they
    agree, the weight and the score."""
    from rich.table import Table

    t = Table(title=f"why similar to context #{sim['against']}: {sim['total']:.3f} of 1")
    for col in ("field", f"context #{sim['against']}", "entry", "judged", "score / weight"):
        t.add_column(col, overflow="fold")
    for f in sim["fields"]:
        t.add_row(f["field"], _value(f["ours"]), _value(f["theirs"]), f["how"],
                  f"{f['score']:.3f} / {f['weight']:.2f}")  # fmt: skip
    _console().print(t)


def _value(v: Any) -> str:
    return "unknown" if v in ("", 0, None) else str(v)


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)
