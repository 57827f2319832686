"""``specpilot export``: plans as vLLM / SGLang flags, approximations and untranslatable parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot.cli import main
from specpilot.engine import EngineConfig
from specpilot.errors import ConfigError
from specpilot.export import export_plan
from specpilot.plan import Plan, save_plan
from specpilot.tree import TreeSpec

LOOKUP = Plan(
    drafter="lookup", drafter_options={"min_n": 2, "max_n": 5}, tree=TreeSpec("chain", k=7)
)
MODEL_DYN = Plan(drafter="model", tree=TreeSpec("dynamic", budget=12, topk=3, depth=6))
STATIC = Plan(drafter="suffix", tree=TreeSpec("static", paths=((0,), (1,), (0, 0))))


def test_vllm_ngram() -> None:
    e = export_plan(LOOKUP, "vllm")
    assert e.config == {
        "method": "ngram",
        "num_speculative_tokens": 7,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    }
    i = e.flags.index("--speculative-config")
    assert json.loads(e.flags[i + 1]) == e.config
    kind = LOOKUP.engine.resolved_attention  # fixed, or exact where the kernels cannot build
    assert kind in ("fixed", "exact") and any(f"attention={kind}" in u for u in e.untranslated)
    assert "vllm serve MODEL --speculative-config" in e.render()


def test_vllm_draft_model_tree_and_options() -> None:
    plan = MODEL_DYN.replace(options={"hybrid_drafting": {"fallback": "lookup"}})
    e = export_plan(plan, "vllm", draft_model="org/draft")
    assert e.config["method"] == "draft_model" and e.config["model"] == "org/draft"
    assert e.config["num_speculative_tokens"] == 6
    assert any("dynamic tree" in u for u in e.untranslated)
    assert any("hybrid" in u for u in e.untranslated)
    trained = export_plan(STATIC.replace(drafter="/runs/head"), "vllm")
    assert trained.config["method"] == "eagle"
    assert trained.config["speculative_token_tree"] == "[(0,), (1,), (0, 0)]"
    assert any("EAGLE checkpoint" in a for a in trained.approximate)


def test_sglang() -> None:
    e = export_plan(MODEL_DYN, "sglang", draft_model="d")
    assert e.config["--speculative-algorithm"] == "STANDALONE"
    assert e.config["--speculative-num-steps"] == 6
    assert e.config["--speculative-eagle-topk"] == 3
    assert e.config["--speculative-num-draft-tokens"] == 13
    assert e.flags[:2] == ("--speculative-algorithm", "STANDALONE")
    s = export_plan(STATIC, "sglang")
    assert s.config["--speculative-algorithm"] == "NGRAM"
    assert any("suffix" in u for u in s.untranslated)
    assert any("static tree" in a for a in s.approximate)
    ar = export_plan(Plan(drafter="none", engine=EngineConfig(linear="torch")), "sglang")
    assert "--speculative-algorithm" not in ar.config
    with pytest.raises(ConfigError, match="--to"):
        export_plan(LOOKUP, "tgi")


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = save_plan(LOOKUP, tmp_path / "run" / "plan.json")
    assert main(["export", "--plan", str(p.parent), "--to", "vllm", "--model", "m"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# vllm") and "vllm serve m --speculative-config" in out
    assert "does not translate:" in out
    assert main(["export", "--plan", str(p), "--to", "sglang", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["--speculative-algorithm"] == "NGRAM"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"options": {"nope": {}}}))
    assert main(["export", "--plan", str(bad), "--to", "vllm"]) == 2
    assert "unknown mechanism" in capsys.readouterr().err
