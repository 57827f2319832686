"""``specpilot optimize --agent ...``: flags become a validated AgentConfig that names the key's
variable, never the key; bad flag combinations fail with a clear message and exit code 2; memory
exports carry agent sources, and a tampered source is refused on import."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot.agent.config import AgentConfig
from specpilot.cli import build_parser, main
from specpilot.cli_optimize import _config
from specpilot.errors import ConfigError
from specpilot.pilot.config import OptimizeConfig
from specpilot.pilot.memory import Memory

from . import agent_sources as src

URL = "http://127.0.0.1:8000/v1"


def _args(*extra: str) -> object:
    return build_parser().parse_args(["optimize", "--workload", "chat", "--limit", "2", *extra])


def test_flags_build_the_agent_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "sk-very-secret")
    flags = ["--agent", "openai", "--agent-base-url", URL, "--agent-model", "m",
             "--agent-api-key-env", "MY_KEY", "--set", 'agent={"candidates": 2}']  # fmt: skip
    cfg = _config(_args(*flags))
    want = AgentConfig(base_url=URL, model="m", api_key_env="MY_KEY", candidates=2)
    assert AgentConfig.from_json(cfg.agent) == want
    blob = json.dumps(cfg.to_json())
    assert "MY_KEY" in blob and "sk-very-secret" not in blob
    assert OptimizeConfig.from_json(cfg.to_json()).agent == cfg.agent  # --resume reads it back
    assert _config(_args()).agent is None  # the built-in explorer stays the default


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--agent-base-url", URL], "need --agent openai"),
        (["--agent", "openai", "--agent-model", "m"], "--agent-base-url must be an http"),
        (["--agent", "openai", "--agent-base-url", URL], "--agent-model is required"),
        (["--agent", "openai", "--agent-base-url", "http://u:pw@h/v1", "--agent-model", "m"],
         "must not carry credentials"),
        (["--agent", "openai", "--agent-base-url", URL, "--agent-model", "m", "--set",
          'agent={"sandbox": "none"}'], "agent sandbox"),
        (["--agent", "openai", "--agent-base-url", URL, "--agent-model", "m", "--set",
          'agent={"telepathy": 1}'], "unknown key(s) ['telepathy']"),
    ],
)  # fmt: skip
def test_bad_agent_flags(flags: list[str], why: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError) as e:
        _config(_args(*flags))
    assert why in str(e.value)
    assert main(["optimize", "--workload", "chat", "--limit", "2", *flags]) == 2
    assert why in capsys.readouterr().err


def test_agent_sources_travel_with_memory_exports(tmp_path: Path) -> None:
    a = Memory(tmp_path / "a.sqlite")
    origin = {"model": "m", "endpoint": URL, "run_id": "r1", "round": 0}
    assert a.add_agent_source(src.GOOD, ["agent_unslow"], origin)
    assert not a.add_agent_source(src.GOOD, ["agent_unslow"], origin)  # idempotent by hash
    doc = json.loads(json.dumps(a.export()))
    b = Memory(tmp_path / "b.sqlite")
    assert b.import_json(doc)["agent_sources"] == 1
    (got,) = b.agent_sources()
    assert got["source"] == src.GOOD and got["mechanism_ids"] == ["agent_unslow"]
    assert (got["model"], got["endpoint"], got["run_id"]) == ("m", URL, "r1")
    assert b.counts()["agent_sources"] == 1
    doc["agent_sources"][0]["source"] += "\nMECHANISMS = []\n"
    c = Memory(tmp_path / "c.sqlite")
    with pytest.raises(ConfigError, match="does not match its SHA-256"):
        c.import_json(doc)
    assert c.agent_sources() == [] and c.counts()["trials"] == 0  # nothing was imported
    for m in (a, b, c):
        m.close()
