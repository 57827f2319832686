"""Mechanism memory: what was tried where, and what it did (SQLite in WAL mode).

Tables:
  * contexts   - where plans ran: architecture, size (M params), drafter kind, device, dtype,
                 batch size, threads, and (columns added to v1 in place, NULL = unknown in
                 entries recorded before) vocabulary size, CPU model, kernel ISA class, weights
                 mode; unique by a canonical ``key``;
  * mechanisms - id, factor, description;
  * trials     - every finished trial: idempotency key (unique: recording twice is a no-op), run,
                 round, kind (explore / integrate), context, mechanism steps and params, status,
                 reason, speedup and spread, the full result as JSON;
  * effects    - measured effects of PASS trials: speedup with spread, factor deltas (filled in
                 when the next round's cost model has run on the plan that kept the change);
  * validation - the forcing evidence of each trial: pool (sample / full), prompts, tokens,
                 status, summary;
  * agent_sources - agent-written mechanism modules that passed forcing and were kept: SHA-256,
                 source, mechanism ids and provenance (endpoint model, endpoint, run, round), so
                 a later run re-applies them without the LLM (:mod:`specpilot.agent`).
The coordinator is the only writer (one connection, one thread); every write commits before the
coordinator takes its next step (``synchronous=FULL``). ``export`` / ``import_json`` move entries
between machines as JSON keyed by context key and idempotency key, never by row ids.
Opening a database recorded by an older specpilot adds the missing context columns
(``ALTER TABLE ADD COLUMN``): the schema version stays 1 and no entry is lost. Similarity of
contexts: :mod:`specpilot.pilot.similarity`.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specpilot.errors import ConfigError
from specpilot.mechanisms.base import Context
from specpilot.pilot.similarity import similarity, similarity_reasons

SCHEMA_VERSION = 1
DEFAULT_MEMORY = Path("~/.cache/specpilot/memory.sqlite")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS contexts(
  id INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, arch TEXT, params_m REAL, drafter_kind TEXT,
  device TEXT, dtype TEXT, batch_size INTEGER, threads INTEGER, created REAL);
CREATE TABLE IF NOT EXISTS mechanisms(id TEXT PRIMARY KEY, factor TEXT, description TEXT);
CREATE TABLE IF NOT EXISTS trials(
  id INTEGER PRIMARY KEY, idem_key TEXT UNIQUE NOT NULL, run_id TEXT, round INTEGER, kind TEXT,
  context_id INTEGER REFERENCES contexts(id), mechanism_id TEXT, params TEXT, steps TEXT,
  status TEXT, reason TEXT, speedup REAL, spread REAL, result TEXT, created REAL);
CREATE TABLE IF NOT EXISTS effects(
  id INTEGER PRIMARY KEY, trial_id INTEGER UNIQUE REFERENCES trials(id), context_id INTEGER,
  mechanism_id TEXT, params TEXT, speedup REAL, spread REAL, factor_deltas TEXT);
CREATE TABLE IF NOT EXISTS validation(
  id INTEGER PRIMARY KEY, trial_id INTEGER UNIQUE REFERENCES trials(id), pool TEXT,
  n_prompts INTEGER, n_tokens INTEGER, status TEXT, summary TEXT);
CREATE TABLE IF NOT EXISTS agent_sources(
  sha256 TEXT PRIMARY KEY, source TEXT NOT NULL, mechanism_ids TEXT, model TEXT, endpoint TEXT,
  run_id TEXT, round INTEGER, created REAL);
CREATE INDEX IF NOT EXISTS trials_mech ON trials(mechanism_id);
CREATE INDEX IF NOT EXISTS effects_mech ON effects(mechanism_id);
"""
ADDED_CONTEXT_COLUMNS = (
    ("vocab_size", "INTEGER"), ("cpu_model", "TEXT"), ("isa", "TEXT"), ("weights", "TEXT"),
)  # fmt: skip
"""Context columns added to schema v1 in place (what transfer needs; NULL = unknown)."""
_CONTEXT_COLUMNS = ("key", "arch", "params_m", "drafter_kind", "device", "dtype", "batch_size",
                    "threads", "created", *(c for c, _ in ADDED_CONTEXT_COLUMNS))  # fmt: skip
_INSERT_CONTEXT = (
    f"INSERT OR IGNORE INTO contexts({', '.join(_CONTEXT_COLUMNS)}) "
    f"VALUES({','.join('?' * len(_CONTEXT_COLUMNS))})"
)


def context_key(ctx: Context) -> str:
    return json.dumps(asdict(ctx), sort_keys=True, separators=(",", ":"))


def _migrate(db: sqlite3.Connection) -> None:
    """Add the context columns a v1 database recorded by an older specpilot lacks."""
    have = {r[1] for r in db.execute("PRAGMA table_info(contexts)")}
    for name, kind in ADDED_CONTEXT_COLUMNS:
        if name not in have:
            try:
                db.execute(f"ALTER TABLE contexts ADD COLUMN {name} {kind}")
            except sqlite3.OperationalError as e:  # another process added it just now
                if "duplicate column" not in str(e):
                    raise


def _known(v: Any) -> Any:
    """A context value as stored: unknown ("" or 0) as NULL."""
    return None if v in ("", 0) else v


def row_context(r: Mapping[str, Any]) -> Context:
    """The :class:`Context` of a ``contexts`` row (NULL columns: unknown)."""
    return Context(
        r["arch"], r["params_m"], r["drafter_kind"], r["device"], r["dtype"], r["batch_size"],
        r["threads"], vocab_size=r["vocab_size"] or 0, cpu_model=r["cpu_model"] or "",
        isa=r["isa"] or "", weights=r["weights"] or "",
    )  # fmt: skip


@dataclass(frozen=True)
class Prior:
    """A remembered effect: try ``params`` of ``mechanism`` first."""

    mechanism: str
    params: dict[str, Any]
    speedup: float
    spread: float
    similarity: float
    context: str

    @property
    def score(self) -> float:
        return self.similarity * (self.speedup - self.spread)


class Memory:
    """The memory database; open with a path (created on first use) or ``:memory:``."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path) if str(path) == ":memory:" else str(Path(path).expanduser())
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.executescript(_SCHEMA)
            _migrate(self.db)
            row = self.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                self.db.execute("INSERT INTO meta VALUES('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise ConfigError(
                    f"--memory {self.path}: schema version {row[0]}, this specpilot reads "
                    f"{SCHEMA_VERSION}; use another --memory path"
                )
        except sqlite3.DatabaseError as e:
            raise ConfigError(
                f"--memory {self.path}: not a specpilot memory database ({e}); pass another path"
            ) from None

    def close(self) -> None:
        self.db.close()

    # -- writes (the coordinator only) ----------------------------------------------------------

    def context_id(self, ctx: Context) -> int:
        key = context_key(ctx)
        self.db.execute(
            _INSERT_CONTEXT,
            (key, ctx.arch, ctx.params_m, ctx.drafter_kind, ctx.device, ctx.dtype,
             ctx.batch_size, ctx.threads, time.time(), _known(ctx.vocab_size),
             _known(ctx.cpu_model), _known(ctx.isa), _known(ctx.weights)),
        )  # fmt: skip
        return int(self.db.execute("SELECT id FROM contexts WHERE key=?", (key,)).fetchone()[0])

    def add_mechanisms(self, mechs: Iterable[Any]) -> None:
        with self.db:
            for m in mechs:
                self.db.execute(
                    "INSERT OR REPLACE INTO mechanisms(id, factor, description) VALUES(?,?,?)",
                    (m.id, m.factor, m.description),
                )

    def record_trial(
        self,
        key: str,
        run_id: str,
        round_: int,
        kind: str,
        ctx: Context,
        steps: list[tuple[str, Mapping[str, Any]]],
        result: Mapping[str, Any],
        pool: str,
    ) -> bool:
        """Record a finished trial (and its effect and validation) in one transaction.
        Returns False when ``key`` was already recorded (nothing changes)."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            if self.db.execute("SELECT 1 FROM trials WHERE idem_key=?", (key,)).fetchone():
                return False
            cid = self.context_id(ctx)
            mech, params = (steps[-1][0], dict(steps[-1][1])) if steps else ("", {})
            cur = self.db.execute(
                "INSERT INTO trials(idem_key, run_id, round, kind, context_id, mechanism_id, "
                "params, steps, status, reason, speedup, spread, result, created) "
                "VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (key, run_id, round_, kind, cid, mech, _dump(params),
                 _dump([[m, dict(p)] for m, p in steps]), result["status"], result.get("reason"),
                 result.get("speedup"), result.get("spread"), _dump(result), time.time()),
            )  # fmt: skip
            tid = cur.lastrowid
            # a stacked trial's speedup belongs to no single mechanism: no effect from it
            single = len(steps) == 1
            if result["status"] == "PASS" and result.get("speedup") is not None and single:
                self.db.execute(
                    "INSERT INTO effects(trial_id, context_id, mechanism_id, params, speedup, "
                    "spread, factor_deltas) VALUES(?,?,?,?,?,?,?)",
                    (tid, cid, mech, _dump(params), result["speedup"], result.get("spread") or 0.0,
                     "{}"),
                )  # fmt: skip
            forcing = result.get("forcing") or {}
            if forcing:
                self.db.execute(
                    "INSERT INTO validation(trial_id, pool, n_prompts, n_tokens, status, summary) "
                    "VALUES(?,?,?,?,?,?)",
                    (tid, pool, forcing.get("n_prompts"), forcing.get("n_tokens"),
                     forcing.get("status"), forcing.get("summary")),
                )  # fmt: skip
            return True

    def set_factor_deltas(self, key: str, deltas: Mapping[str, float]) -> None:
        with self.db:
            self.db.execute(
                "UPDATE effects SET factor_deltas=? WHERE trial_id="
                "(SELECT id FROM trials WHERE idem_key=?)",
                (_dump(dict(deltas)), key),
            )

    def forget_effect(self, key: str) -> None:
        """Drop the effect of trial ``key`` (a speedup above the cost model's ceiling that a
        re-measurement did not confirm must not become a prior); the trial itself stays."""
        with self.db:
            self.db.execute(
                "DELETE FROM effects WHERE trial_id=(SELECT id FROM trials WHERE idem_key=?)",
                (key,),
            )

    def add_agent_source(self, source: str, mechanism_ids: list[str], origin: Mapping[str, Any]
                         ) -> bool:  # fmt: skip
        """Store a kept agent-written module (idempotent by its SHA-256); False if present."""
        import hashlib

        sha = hashlib.sha256(source.encode("utf-8")).hexdigest()
        with self.db:
            cur = self.db.execute(
                "INSERT OR IGNORE INTO agent_sources(sha256, source, mechanism_ids, model, "
                "endpoint, run_id, round, created) VALUES(?,?,?,?,?,?,?,?)",
                (sha, source, _dump(sorted(mechanism_ids)), origin.get("model"),
                 origin.get("endpoint"), origin.get("run_id"), origin.get("round"), time.time()),
            )  # fmt: skip
        return cur.rowcount > 0

    def agent_sources(self) -> list[dict[str, Any]]:
        """Stored agent-written modules, oldest first (``mechanism_ids`` decoded)."""
        rows = self.db.execute("SELECT * FROM agent_sources ORDER BY created, sha256").fetchall()
        return [{**dict(r), "mechanism_ids": json.loads(r["mechanism_ids"] or "[]")} for r in rows]

    # -- reads -----------------------------------------------------------------------------------

    def has_trial(self, key: str) -> bool:
        return (
            self.db.execute("SELECT 1 FROM trials WHERE idem_key=?", (key,)).fetchone() is not None
        )

    def priors(self, ctx: Context, mechanism: str, limit: int = 5) -> list[Prior]:
        """Best remembered params of ``mechanism``, best first: similarity x (speedup - spread),
        only effects that beat their spread; one entry per distinct params."""
        rows = self.db.execute(
            "SELECT e.params, e.speedup, e.spread, c.* FROM effects e "
            "JOIN contexts c ON c.id = e.context_id WHERE e.mechanism_id=?",
            (mechanism,),
        ).fetchall()
        best: dict[str, Prior] = {}
        for r in rows:
            if r["speedup"] - (r["spread"] or 0.0) <= 1.0:
                continue
            p = Prior(mechanism, json.loads(r["params"]), r["speedup"], r["spread"] or 0.0,
                      similarity(ctx, row_context(r)), r["key"])  # fmt: skip
            if r["params"] not in best or p.score > best[r["params"]].score:
                best[r["params"]] = p
        return sorted(best.values(), key=lambda p: -p.score)[:limit]

    def list_entries(self, limit: int = 50) -> list[dict[str, Any]]:
        """Effects with their context, best first (``specpilot memory list``)."""
        rows = self.db.execute(
            "SELECT e.id, e.mechanism_id, e.params, e.speedup, e.spread, e.factor_deltas, "
            "c.id AS context_id, c.arch, c.params_m, c.drafter_kind, c.device, c.dtype, "
            "c.batch_size, c.vocab_size, c.isa, c.weights, t.idem_key, t.kind FROM effects e "
            "JOIN contexts c ON c.id = e.context_id JOIN trials t ON t.id = e.trial_id "
            "ORDER BY e.speedup DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [dict(r) for r in rows]

    def show(self, entry: str, against: int | None = None) -> dict[str, Any]:
        """One effect (by id) or mechanism (by name), with trials and validation. An effect comes
        with ``similarity``: why its context is judged similar to context ``against`` (an id of
        the contexts table; default the newest, i.e. the latest run's)."""
        if entry.isdigit():
            row = self.db.execute("SELECT * FROM effects WHERE id=?", (int(entry),)).fetchone()
            if row is None:
                raise ConfigError(f"memory: no effect #{entry}; see `specpilot memory list`")
            trial = self.db.execute(
                "SELECT * FROM trials WHERE id=?", (row["trial_id"],)
            ).fetchone()
            val = self.db.execute(
                "SELECT * FROM validation WHERE trial_id=?", (row["trial_id"],)
            ).fetchone()
            ctx = self.db.execute(
                "SELECT * FROM contexts WHERE id=?", (row["context_id"],)
            ).fetchone()
            return {
                "effect": dict(row),
                "context": dict(ctx),
                "trial": {k: v for k, v in dict(trial).items() if k != "result"},
                "validation": dict(val) if val else None,
                "similarity": self._why_similar(ctx, against),
            }
        mech = self.db.execute("SELECT * FROM mechanisms WHERE id=?", (entry,)).fetchone()
        trials = self.db.execute(
            "SELECT idem_key, run_id, round, kind, params, status, reason, speedup, spread "
            "FROM trials WHERE mechanism_id=? ORDER BY id",
            (entry,),
        ).fetchall()
        if mech is None and not trials:
            raise ConfigError(f"memory: no effect or mechanism {entry!r}; see `memory list`")
        return {
            "mechanism": dict(mech) if mech else {"id": entry},
            "trials": [dict(t) for t in trials],
        }

    def _why_similar(self, entry_ctx: Mapping[str, Any], against: int | None) -> dict[str, Any]:
        """``similarity_reasons`` of ``against`` (a context id; default the newest) and the
        entry's context, as JSON-ready data."""
        if against is None:
            newest = "SELECT * FROM contexts ORDER BY created DESC, id DESC"
            ref = self.db.execute(newest).fetchone()
        else:
            ref = self.db.execute("SELECT * FROM contexts WHERE id=?", (against,)).fetchone()
            if ref is None:
                raise ConfigError(f"memory: no context #{against}; see `specpilot memory list`")
        reasons = similarity_reasons(row_context(ref), row_context(entry_ctx))
        return {
            "against": int(ref["id"]),
            "total": round(sum(r.score for r in reasons), 6),
            "fields": [asdict(r) for r in reasons],
        }

    def counts(self) -> dict[str, int]:
        out = {
            t: int(self.db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0])
            for t in ("contexts", "mechanisms", "trials", "effects", "validation", "agent_sources")
        }
        if not out["agent_sources"]:  # shown only when there are some
            del out["agent_sources"]
        return out

    # -- sharing ---------------------------------------------------------------------------------

    def export(self) -> dict[str, Any]:
        """Everything, keyed by context key and idempotency key (portable between machines)."""
        ckey = {r["id"]: r["key"] for r in self.db.execute("SELECT id, key FROM contexts")}
        tkey = {r["id"]: r["idem_key"] for r in self.db.execute("SELECT id, idem_key FROM trials")}

        def rows(sql: str) -> list[dict[str, Any]]:
            return [dict(r) for r in self.db.execute(sql)]

        contexts = [
            {k: v for k, v in r.items() if k != "id"}
            for r in rows("SELECT * FROM contexts ORDER BY key")
        ]
        trials = []
        for r in rows("SELECT * FROM trials ORDER BY idem_key"):
            r["context"] = ckey.get(r.pop("context_id"))
            r.pop("id")
            trials.append(r)
        effects = []
        for r in rows("SELECT * FROM effects"):
            r["trial"] = tkey[r.pop("trial_id")]
            r["context"] = ckey.get(r.pop("context_id"))
            r.pop("id")
            effects.append(r)
        validation = []
        for r in rows("SELECT * FROM validation"):
            r["trial"] = tkey[r.pop("trial_id")]
            r.pop("id")
            validation.append(r)
        return {
            "format": "specpilot-memory",
            "version": SCHEMA_VERSION,
            "contexts": contexts,
            "mechanisms": rows("SELECT * FROM mechanisms ORDER BY id"),
            "trials": trials,
            "effects": sorted(effects, key=lambda r: r["trial"]),
            "validation": sorted(validation, key=lambda r: r["trial"]),
            "agent_sources": rows("SELECT * FROM agent_sources ORDER BY sha256"),
        }

    def import_json(self, doc: Any) -> dict[str, int]:
        """Merge an export; entries already present (same keys) are skipped. Returns new counts."""
        if not isinstance(doc, dict) or doc.get("format") != "specpilot-memory":
            raise ConfigError("memory import: not a specpilot memory export (format mismatch)")
        if doc.get("version") != SCHEMA_VERSION:
            raise ConfigError(
                f"memory import: version {doc.get('version')}, expected {SCHEMA_VERSION}"
            )
        added = dict.fromkeys(("contexts", "mechanisms", "trials", "effects", "validation"), 0)
        try:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                for c in doc.get("contexts", []):
                    cur = self.db.execute(
                        _INSERT_CONTEXT,
                        (c["key"], c["arch"], c["params_m"], c["drafter_kind"], c["device"],
                         c["dtype"], c["batch_size"], c["threads"], c.get("created"),
                         *(c.get(name) for name, _ in ADDED_CONTEXT_COLUMNS)),
                    )  # fmt: skip
                    added["contexts"] += cur.rowcount
                for m in doc.get("mechanisms", []):
                    cur = self.db.execute(
                        "INSERT OR IGNORE INTO mechanisms(id, factor, description) VALUES(?,?,?)",
                        (m["id"], m["factor"], m["description"]),
                    )
                    added["mechanisms"] += cur.rowcount
                cid = {r["key"]: r["id"] for r in self.db.execute("SELECT id, key FROM contexts")}
                fresh = set()
                for t in doc.get("trials", []):
                    cur = self.db.execute(
                        "INSERT OR IGNORE INTO trials(idem_key, run_id, round, kind, context_id, "
                        "mechanism_id, params, steps, status, reason, speedup, spread, result, "
                        "created) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                        (t["idem_key"], t["run_id"], t["round"], t["kind"], cid.get(t["context"]),
                         t["mechanism_id"], t["params"], t["steps"], t["status"], t["reason"],
                         t["speedup"], t["spread"], t["result"], t["created"]),
                    )  # fmt: skip
                    if cur.rowcount:
                        fresh.add(t["idem_key"])
                    added["trials"] += cur.rowcount
                tid = {
                    r["idem_key"]: r["id"]
                    for r in self.db.execute("SELECT id, idem_key FROM trials")
                }
                for e in doc.get("effects", []):
                    if e["trial"] in fresh:
                        self.db.execute(
                            "INSERT INTO effects(trial_id, context_id, mechanism_id, params, "
                            "speedup, spread, factor_deltas) VALUES(?,?,?,?,?,?,?)",
                            (tid[e["trial"]], cid.get(e["context"]), e["mechanism_id"],
                             e["params"], e["speedup"], e["spread"], e["factor_deltas"]),
                        )  # fmt: skip
                        added["effects"] += 1
                for v in doc.get("validation", []):
                    if v["trial"] in fresh:
                        self.db.execute(
                            "INSERT INTO validation(trial_id, pool, n_prompts, n_tokens, status, "
                            "summary) VALUES(?,?,?,?,?,?)",
                            (tid[v["trial"]], v["pool"], v["n_prompts"], v["n_tokens"],
                             v["status"], v["summary"]),
                        )  # fmt: skip
                        added["validation"] += 1
                if doc.get("agent_sources"):
                    added["agent_sources"] = sum(map(self._import_source, doc["agent_sources"]))
        except (KeyError, TypeError) as e:
            raise ConfigError(
                f"memory import: malformed entry ({e}); nothing was imported"
            ) from None
        return added

    def _import_source(self, a: Mapping[str, Any]) -> int:
        """One exported agent source; its SHA-256 must match its text (else ConfigError)."""
        import hashlib

        if hashlib.sha256(a["source"].encode("utf-8")).hexdigest() != a["sha256"]:
            raise ConfigError(
                f"memory import: agent source {a['sha256'][:16]} does not match its SHA-256; "
                "nothing was imported"
            )
        cur = self.db.execute(
            "INSERT OR IGNORE INTO agent_sources(sha256, source, mechanism_ids, model, endpoint, "
            "run_id, round, created) VALUES(?,?,?,?,?,?,?,?)",
            (a["sha256"], a["source"], a["mechanism_ids"], a.get("model"), a.get("endpoint"),
             a.get("run_id"), a.get("round"), a.get("created")),
        )  # fmt: skip
        return cur.rowcount


def _dump(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"))
