"""The agents in the real loop, against a scripted endpoint on loopback.

* run A: the endpoint rate-limits, sends empty, prose and unparsable replies, seven sources the
  static check must stop, one that changes outputs (MISMATCH), one that spins (TIMEOUT) and one
  known-good mechanism, which is integrated; its source and provenance go to the memory;
* run B (``unsafe_skip_static_check``): sources that pass the relaxed check but write a cache
  outside the scratch directory, open a socket, read the journal or the parent's environment -
  only the runtime sandbox stands between them and the machine, and each is a CRASH;
* run C: no endpoint; the memory exported from run A is imported into a fresh database, and the
  stored mechanism is re-applied without the LLM (sandboxed, token-forced again) and kept.
The coordinator process never imports agent-written code, and the API key is written nowhere.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from specpilot.agent.explorer import agent_explorer
from specpilot.agent.store import sha256
from specpilot.pilot.coordinator import Coordinator
from specpilot.pilot.memory import Memory
from specpilot.pilot.sandbox import probe

from . import agent_sources as src
from .agent_endpoint import Status, serve
from .agent_helpers import KEY, KEY_VAR, agent_config, config
from .pilot_helpers import tiny_model_dir

STRONG = {"landlock", "netns"} <= set(probe())


def _records(out: Path, kind: str) -> list[dict[str, Any]]:
    lines = (out / "journal.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def _trials(out: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(t["kind"], t["steps"][-1][0]): t["result"] for t in _records(out, "trial")}


def _no_agent_module_imported() -> None:
    assert not [m for m in sys.modules if m.startswith("agent_")], "agent code imported here"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("agent_model") / "model")


@pytest.fixture(scope="module")
def run_a(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("agent_run_a")
    script = [Status(429, retry_after=0.01), "", "I think a longer chain would help.",
              src.reply("class Broken(:\n    pass")]  # fmt: skip
    script += [src.reply(s) for s, _ in src.STATIC_BAD.values()]
    script += [src.reply(src.CHANGE_OUTPUTS), src.reply(src.SPIN), src.reply(src.GOOD)]
    mp = pytest.MonkeyPatch()
    mp.setenv(KEY_VAR, KEY)
    try:
        with serve(script) as ep:
            acfg = agent_config(ep.url, requests_per_round=14, candidates=3, agents=1)
            cfg = config(root / "run", model, root / "memory.sqlite", agent=acfg,
                         candidates_per_round=3, workers=2)  # fmt: skip
            summary = Coordinator(cfg, explorer_factory=agent_explorer).run()
    finally:
        mp.undo()
    return {"root": root, "out": root / "run", "summary": summary, "endpoint": ep}


def test_every_bad_reply_is_rejected_with_its_reason(run_a: dict[str, Any]) -> None:
    (cands,) = _records(run_a["out"], "candidates")
    log = cands["agent"]
    assert [e["request"] for e in log] == list(range(len(log)))
    first = log[0]  # the 429 was retried (backoff), then the reply was empty
    assert (first["stage"], first["status"], first["attempts"]) == ("endpoint", "empty", 2)
    assert log[1]["stage"] == "parse" and "no proposal found" in log[1]["reason"]
    assert log[2]["stage"] == "static" and "does not parse" in log[2]["reason"]
    for e, (name, (source, why)) in zip(log[3:], src.STATIC_BAD.items(), strict=False):
        assert e["stage"] == "static" and why in e["reason"], (name, e)
        assert (run_a["out"] / "agent" / "rejected" / f"agent_{e['sha'][:16]}.py").exists()
        assert e["sha"] == sha256(source.strip() + "\n")
    accepted = [e for e in log if e["stage"] == "accepted"]
    assert [e["mechanism"] for e in accepted] == ["agent_flip", "agent_spin", "agent_unslow"]
    assert len(log) == 3 + len(src.STATIC_BAD) + 3
    _no_agent_module_imported()


def test_runtime_misbehaviour_is_caught_and_the_good_one_kept(run_a: dict[str, Any]) -> None:
    trials = _trials(run_a["out"])
    flip, spin = trials[("explore", "agent_flip")], trials[("explore", "agent_spin")]
    assert flip["status"] == "MISMATCH" and flip["speedup"] is None, flip["reason"]
    assert spin["status"] == "TIMEOUT" and "no answer to generate" in spin["reason"]
    good = trials[("integrate", "agent_unslow")]
    assert good["status"] == "PASS" and good["speedup"] > 1.05, good
    (rnd,) = [json.loads(x) for x in (run_a["out"] / "rounds.jsonl").read_text().splitlines()]
    assert [k["mechanism"] for k in rnd["kept"]] == ["agent_unslow"]
    assert rnd["sandbox"] == run_a["summary"].sandbox != ""
    assert any(e["stage"] == "stored" for e in rnd["agent"])
    html = (run_a["out"] / "report.html").read_text()
    assert f"<b>{rnd['sandbox']}</b>" in html and "forbidden name" in html
    plan = json.loads((run_a["out"] / "plan.json").read_text())
    assert {"id": "slow_path", "params": {"fast": True}} in plan["mechanisms"]


def test_agent_source_stored_with_provenance_and_key_never_written(run_a: dict[str, Any]) -> None:
    mem = Memory(run_a["root"] / "memory.sqlite")
    (stored,) = mem.agent_sources()
    mem.close()
    assert stored["sha256"] == sha256(src.GOOD.strip() + "\n")
    assert stored["mechanism_ids"] == ["agent_unslow"]
    assert stored["model"] == "scripted-model" and stored["endpoint"] == run_a["endpoint"].url
    assert stored["run_id"] == run_a["summary"].run_id and stored["round"] == 0
    ep = run_a["endpoint"]
    assert all(r["headers"].get("authorization") == f"Bearer {KEY}" for r in ep.requests)
    for f in [*run_a["root"].rglob("*")]:
        if f.is_file():
            assert KEY.encode() not in f.read_bytes(), f
    first = ep.requests[0]["body"]["messages"][1]["content"]
    for part in ("Cost-model factors", "Current plan", "class Mechanism(Protocol)",
                 "chain_length.py", "slow_path"):  # fmt: skip
        assert part in first
    later = ep.requests[-1]["body"]["messages"][1]["content"]
    assert "forbidden name 'open'" in later and "does not parse" in later


def test_stored_mechanism_reapplied_without_the_llm(
    run_a: dict[str, Any], model: Path, tmp_path: Path
) -> None:
    doc = json.loads(json.dumps(Memory(run_a["root"] / "memory.sqlite").export()))
    mem = Memory(tmp_path / "other-machine.sqlite")
    assert mem.import_json(doc)["agent_sources"] == 1
    mem.close()
    cfg = config(tmp_path / "run", model, tmp_path / "other-machine.sqlite")
    summary = Coordinator(cfg, explorer_factory=agent_explorer).run()
    (reuse,) = _records(tmp_path / "run", "agent_reuse")
    assert [e["status"] for e in reuse["agent"]] == ["reused"]
    # through the memory: the recall trial (stacked remembered winners) or a memory candidate
    trials = [t for t in _records(tmp_path / "run", "trial")
              if ["agent_unslow", {}] in t["steps"]]  # fmt: skip
    assert trials and all(t["result"]["status"] == "PASS" for t in trials)
    assert trials[0]["result"]["forcing"]["n_prompts"] >= 2  # token-forced again
    assert ["agent_unslow" in k.mechanism for k in summary.kept] == [True]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert "agent_unslow" in [m["id"] for m in plan["mechanisms"]]
    assert summary.sandbox
    _no_agent_module_imported()


def test_only_the_runtime_sandbox_stops_these(model: Path, tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.5)
    outside = tmp_path / "cache" / "outputs.txt"
    outside.parent.mkdir()
    out = tmp_path / "run"
    bad = src.runtime_bad(str(outside), listener.getsockname()[1], str(out / "journal.jsonl"),
                          KEY_VAR)  # fmt: skip
    if not STRONG:  # known gaps of the audit layer (docs/agent.md): native code, /proc
        bad.pop("parent_env")
        bad.pop("raw_write")
    mp = pytest.MonkeyPatch()
    mp.setenv(KEY_VAR, KEY)
    try:
        with serve([src.reply(s) for s in bad.values()]) as ep:
            acfg = agent_config(ep.url, requests_per_round=len(bad), candidates=len(bad), agents=1,
                                unsafe_skip_static_check=True)  # fmt: skip
            cfg = config(out, model, tmp_path / "memory.sqlite", agent=acfg,
                         candidates_per_round=len(bad) - len(src.AT_IMPORT), workers=2)  # fmt: skip
            summary = Coordinator(cfg, explorer_factory=agent_explorer).run()
    finally:
        mp.undo()
    (cands,) = _records(out, "candidates")
    log = {e["sha"]: e for e in cands["agent"]}
    assert len(log) == len(bad)  # each passed the (relaxed) check, then ran sandboxed
    trials = _trials(out)
    reasons = {}
    for name, source in bad.items():
        e = log[sha256(source.strip() + "\n")]
        if name in src.AT_IMPORT:  # stopped while the describing child imported it
            assert (e["stage"], e["status"]) == ("describe", "CRASH"), e
            assert "importing or describing failed: PermissionError" in e["reason"], e
            reasons[name] = e["reason"]
        else:  # stopped in the trial child, before any speed figure
            res = trials[("explore", e["mechanism"])]
            assert res["status"] == "CRASH" and "PermissionError" in res["reason"], res
            reasons[name] = res["reason"]
    assert len(trials) == len(bad) - len(src.AT_IMPORT) and summary.kept == []
    assert not outside.exists()
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    if STRONG:  # stopped by Landlock itself: no audit event fires for libc calls or /proc
        assert summary.sandbox == "landlock+netns+audit"
        for name in ("raw_write", "parent_env"):
            assert "[Errno 13] Permission denied" in reasons[name], reasons[name]
