"""Memory contexts carry what transfer needs (vocabulary, CPU model, kernel ISA class, weights
mode): an old v1 database gains the columns in place and keeps every entry, export / import
carries the new fields, similarity is explained field by field and ``memory show`` prints why."""

from __future__ import annotations

import argparse
import json
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from specpilot import cli_memory, machine
from specpilot.errors import ConfigError
from specpilot.mechanisms.base import Context
from specpilot.pilot.memory import ADDED_CONTEXT_COLUMNS, Memory, similarity
from specpilot.pilot.similarity import WEIGHTS, similarity_reasons
from specpilot.plan import Plan
from specpilot.runtime import context_of

from .runtime_helpers import loaded

SMOL = Context("llama", 134.5, "suffix", "cpu", "float32", 1, 2, vocab_size=49152,
               cpu_model="AMD EPYC", isa="avx2", weights="native")  # fmt: skip
GEMMA = replace(SMOL, arch="gemma3", params_m=268.1, vocab_size=262144)
XEON = replace(SMOL, cpu_model="Intel(R) Xeon(R) Platinum 8480+", isa="avx512_vnni")

V1_DDL = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE contexts(
  id INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, arch TEXT, params_m REAL, drafter_kind TEXT,
  device TEXT, dtype TEXT, batch_size INTEGER, threads INTEGER, created REAL);
CREATE TABLE mechanisms(id TEXT PRIMARY KEY, factor TEXT, description TEXT);
CREATE TABLE trials(
  id INTEGER PRIMARY KEY, idem_key TEXT UNIQUE NOT NULL, run_id TEXT, round INTEGER, kind TEXT,
  context_id INTEGER REFERENCES contexts(id), mechanism_id TEXT, params TEXT, steps TEXT,
  status TEXT, reason TEXT, speedup REAL, spread REAL, result TEXT, created REAL);
CREATE TABLE effects(
  id INTEGER PRIMARY KEY, trial_id INTEGER UNIQUE REFERENCES trials(id), context_id INTEGER,
  mechanism_id TEXT, params TEXT, speedup REAL, spread REAL, factor_deltas TEXT);
CREATE TABLE validation(
  id INTEGER PRIMARY KEY, trial_id INTEGER UNIQUE REFERENCES trials(id), pool TEXT,
  n_prompts INTEGER, n_tokens INTEGER, status TEXT, summary TEXT);
INSERT INTO meta VALUES('schema', '1');
"""
"""The v1 schema as databases written before contexts carried the transfer fields have it."""
OLD_KEY = (
    '{"arch":"llama","batch_size":1,"device":"cpu","drafter_kind":"suffix",'
    '"drafters":["lookup","suffix"],"dtype":"float32","params_m":134.5,"threads":2}'
)


def old_database(path: Path) -> None:
    """A v1 database with one context, a PASS trial of chain_length and its effect."""
    con = sqlite3.connect(path)
    con.executescript(V1_DDL)
    con.execute("INSERT INTO contexts VALUES(1, ?, 'llama', 134.5, 'suffix', 'cpu', 'float32', "
                "1, 2, 1.0)", (OLD_KEY,))  # fmt: skip
    con.execute("INSERT INTO mechanisms VALUES('chain_length', 'tau', 'chain length')")
    result = json.dumps({"status": "PASS", "speedup": 1.4, "spread": 0.05})
    con.execute("INSERT INTO trials VALUES(1, 'old/1', 'old', 0, 'explore', 1, 'chain_length', "
                "'{\"k\":8}', '[[\"chain_length\",{\"k\":8}]]', 'PASS', '', 1.4, 0.05, ?, 1.0)",
                (result,))  # fmt: skip
    con.execute("INSERT INTO effects VALUES(1, 1, 1, 'chain_length', '{\"k\":8}', 1.4, 0.05, '{}')")
    con.execute("INSERT INTO validation VALUES(1, 1, 'sample', 3, 96, 'PASS', 'PASS: 3 prompts')")
    con.commit()
    con.close()


def _columns(path: Path) -> list[str]:
    con = sqlite3.connect(path)
    try:
        return [r[1] for r in con.execute("PRAGMA table_info(contexts)")]
    finally:
        con.close()


def test_an_old_database_gains_the_columns_and_keeps_its_entries(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    old_database(path)
    assert "isa" not in _columns(path)
    mem = Memory(path)
    assert mem.counts() == {"contexts": 1, "mechanisms": 1, "trials": 1, "effects": 1,
                            "validation": 1}  # fmt: skip
    row = dict(mem.db.execute("SELECT * FROM contexts").fetchone())
    assert row["key"] == OLD_KEY
    assert all(row[c] is None for c, _ in ADDED_CONTEXT_COLUMNS)  # unknown, not invented
    # the old entry is still a prior for a new context; its unknown fields score half
    [prior] = mem.priors(SMOL, "chain_length")
    assert prior.params == {"k": 8} and prior.context == OLD_KEY
    unknown = sum(WEIGHTS[f] for f in ("vocab_size", "cpu_model", "isa", "weights"))
    assert prior.similarity == pytest.approx(1 - unknown / 2)
    # a new trial in a new context goes next to it
    res = {"status": "PASS", "speedup": 1.2, "spread": 0.01, "forcing": {}}
    assert mem.record_trial("new/1", "new", 0, "explore", SMOL, [("chain_length", {"k": 6})],
                            res, "sample")  # fmt: skip
    mem.close()
    added = [c for c, _ in ADDED_CONTEXT_COLUMNS]
    assert _columns(path)[-len(added) :] == added
    again = Memory(path)  # opening a migrated database twice changes nothing
    assert again.counts()["trials"] == 2 and again.counts()["contexts"] == 2
    new = again.db.execute("SELECT * FROM contexts WHERE key != ?", (OLD_KEY,)).fetchone()
    assert (new["vocab_size"], new["cpu_model"], new["isa"], new["weights"]) == (
        49152, "AMD EPYC", "avx2", "native")  # fmt: skip
    again.close()


def test_export_import_round_trips_the_new_fields(tmp_path: Path) -> None:
    a = Memory(tmp_path / "a.sqlite")
    res = {"status": "PASS", "speedup": 1.3, "spread": 0.02, "forcing": {}}
    for i, ctx in enumerate((SMOL, GEMMA, XEON)):
        a.record_trial(f"r/{i}", "r", 0, "explore", ctx, [("threads", {"threads": 1})], res, "s")
    doc = json.loads(json.dumps(a.export()))
    isas = sorted(c["isa"] for c in doc["contexts"])
    assert isas == ["avx2", "avx2", "avx512_vnni"]
    assert sorted(c["vocab_size"] for c in doc["contexts"]) == [49152, 49152, 262144]
    assert {c["weights"] for c in doc["contexts"]} == {"native"}
    b = Memory(tmp_path / "b.sqlite")
    b.import_json(doc)
    assert b.export() == doc
    prior = b.priors(XEON, "threads")[0]
    assert prior.similarity == 1.0 and json.loads(prior.context)["isa"] == "avx512_vnni"
    # an export written before the fields existed imports with them unknown
    for c in doc["contexts"]:
        for name, _ in ADDED_CONTEXT_COLUMNS:
            del c[name]
    c = Memory(tmp_path / "c.sqlite")
    assert c.import_json(doc)["contexts"] == 3
    assert c.db.execute("SELECT COUNT(*) FROM contexts WHERE isa IS NULL").fetchone()[0] == 3


def test_similarity_reasons_field_by_field() -> None:
    assert sum(WEIGHTS.values()) == pytest.approx(1.0)
    same = similarity_reasons(SMOL, SMOL)
    assert [r.field for r in same] == list(WEIGHTS) and all(r.how == "equal" for r in same)
    assert similarity(SMOL, SMOL) == 1.0
    why = {r.field: r for r in similarity_reasons(GEMMA, SMOL)}
    assert why["arch"].how == "differs" and why["arch"].score == 0.0
    assert (why["arch"].ours, why["arch"].theirs) == ("gemma3", "llama")
    assert why["vocab_size"].how.startswith("closeness") and 0 < why["vocab_size"].score < 0.04
    assert why["isa"].how == "equal" and why["isa"].score == WEIGHTS["isa"]
    hw = {r.field: r for r in similarity_reasons(XEON, SMOL)}
    assert hw["isa"].how == "differs" and hw["cpu_model"].how == "differs"
    assert similarity(SMOL, XEON) == pytest.approx(1 - WEIGHTS["isa"] - WEIGHTS["cpu_model"])
    old = Context("llama", 134.5, "suffix", "cpu", "float32", 1, 2)
    half = {r.field: r.score for r in similarity_reasons(SMOL, old) if r.how == "unknown"}
    assert half == {f: WEIGHTS[f] / 2 for f in ("isa", "cpu_model", "vocab_size", "weights")}
    # the hardware and the model both move the judgement, in the documented direction
    assert similarity(SMOL, GEMMA) < similarity(SMOL, XEON) < similarity(SMOL, SMOL)


def test_isa_level_classes() -> None:
    assert machine.isa_level("fpu sse2 avx avx2 fma f16c") == "avx2"
    assert machine.isa_level("avx2 fma f16c avx512f avx512bw") == "avx512"
    assert machine.isa_level("avx2 fma f16c avx512f avx512_vnni") == "avx512_vnni"
    assert machine.isa_level("avx avx2") == "portable"  # the AVX2 kernels also need FMA, F16C
    assert machine.isa_level("") == "portable"
    assert machine.isa_level() in machine.ISA_LEVELS


def test_context_of_fills_the_transfer_fields() -> None:
    lm = loaded()
    ctx = context_of(lm, Plan(), 1)
    assert ctx.vocab_size == lm.cfg.vocab_size > 0
    assert ctx.weights == "fp32" and not ctx.native
    assert ctx.isa == machine.isa_level() and ctx.cpu_model == machine.cpu_model()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="specpilot")
    cli_memory.add_parser(p.add_subparsers(dest="cmd"))
    return cli_memory.run(p.parse_args(argv))


def test_memory_show_prints_why_an_entry_is_similar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.sqlite"
    old_database(path)  # effect #1, recorded before contexts had the transfer fields
    mem = Memory(path)
    res = {"status": "PASS", "speedup": 1.2, "spread": 0.01, "forcing": {}}
    mem.record_trial("g/1", "g", 0, "explore", GEMMA, [("chain_length", {"k": 6})], res, "s")
    gemma_ctx = int(mem.db.execute("SELECT MAX(id) FROM contexts").fetchone()[0])
    mem.close()
    assert main(["memory", "list", "--memory", str(path)]) == 0
    listed = capsys.readouterr().out
    assert f"ctx #{gemma_ctx}" in listed and "avx2" in listed and "v262144" in listed
    assert main(["memory", "show", "1", "--memory", str(path)]) == 0  # against the newest
    out = capsys.readouterr().out
    assert f"why similar to context #{gemma_ctx}" in out
    table = out[: out.index("{")]
    for word in ("arch", "gemma3", "llama", "differs", "isa", "unknown", "0.150 / 0.15"):
        assert word in table, word
    assert main(["memory", "show", "1", "--json", "--memory", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    sim = doc["similarity"]
    assert sim["against"] == gemma_ctx
    fields = {f["field"]: f for f in sim["fields"]}
    assert fields["isa"]["how"] == "unknown" and fields["arch"]["how"] == "differs"
    assert sim["total"] == pytest.approx(sum(f["score"] for f in sim["fields"]))
    assert main(["memory", "show", "1", "--json", "--against", "1", "--memory", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["similarity"]["total"] == 1.0
    with pytest.raises(ConfigError, match="no context #99"):
        main(["memory", "show", "1", "--against", "99", "--memory", str(path)])
