"""CLI: ``bench --batch-size`` end to end on a tiny model directory, ``serve`` flag validation,
sampling flags of ``generate``."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from specpilot.batch import VerifyBudget
from specpilot.bench_batch import plan_budget
from specpilot.cli import main
from specpilot.cli_serve import parse_budget_table
from specpilot.errors import ConfigError
from specpilot.plan import Plan, save_plan
from specpilot.tree import TreeSpec

from .test_cli import GOOD, _prompts
from .test_loading import make_model, save_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_dir(tmp_path_factory.mktemp("cli_batch") / "tiny", make_model("llama-tied", seed=2))


def test_bench_batch_size_json(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "batch.json"
    lines = [*GOOD, json.dumps({"id": "c", "prompt": "a b a b a b a b", "chat": False})]
    argv = ["bench", "--model", str(model_dir), "--prompts", str(_prompts(tmp_path, lines))]
    argv += ["--max-new-tokens", "16", "--drafter", "lookup", "--batch-size", "2", "--threads", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["batch_size"] == 2 and d["n_prompts"] == 3 and d["lossless"] is True
    ar, (spec,) = d["ar"], d["candidates"]
    assert ar["tok_s"] > 0 and spec["tok_s"] > 0 and spec["speedup"] > 0
    assert spec["mismatches"] == 0 and spec["tau"] >= 1.0
    assert 0 < ar["latency_p50_s"] <= ar["latency_p99_s"]
    # a min gain no draft reaches: nothing is verified, so speculative decoding is plain AR
    assert main([*argv, "--min-gain", "1", "--json", str(out)]) == 0
    spec = json.loads(out.read_text())["candidates"][0]
    assert spec["mean_draft_nodes"] == 0 and spec["tau"] == 1.0 and spec["mismatches"] == 0


def test_serve_rejects_bad_flags(model_dir: Path, tmp_path: Path) -> None:
    base = ["serve", "--model", str(model_dir)]
    assert main([*base, "--port", "0"]) == 2
    assert main([*base, "--budget-table", "2:4"]) == 2
    assert main([*base, "--max-batch", "0"]) == 2
    assert main([*base, "--plan", str(tmp_path / "missing.json")]) == 2
    assert parse_budget_table("1:16, 4:8") == ((1, 16), (4, 8))
    with pytest.raises(ConfigError):
        parse_budget_table("1-16")


def test_serve_on_a_taken_port_is_a_one_line_error(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through serve_in_main (the engine in the main thread): uvicorn.run would exit 1 instead."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--model", str(model_dir), "--port", str(port), "--threads", "1"]
        assert main([*argv, "--log-level", "error"]) == 2
    assert f"could not start on 127.0.0.1:{port}" in capsys.readouterr().err


def test_bench_batch_size_with_a_plan_budget_table(model_dir: Path, tmp_path: Path) -> None:
    plan = Plan(
        drafter="lookup",
        tree=TreeSpec(kind="chain", k=4),
        options={"batch_budget": {"2": 2, "4": 1}},
    )
    path = save_plan(plan, tmp_path / "plan.json")
    assert plan_budget(str(path), 4) == VerifyBudget(((1, 4), (2, 2), (4, 1)))
    assert plan_budget(None, 4) is None
    out = tmp_path / "batch.json"
    argv = ["bench", "--model", str(model_dir), "--plan", str(path), "--batch-size", "2"]
    argv += ["--prompts", str(_prompts(tmp_path, GOOD)), "--max-new-tokens", "12"]
    assert main([*argv, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["lossless"] is True and d["candidates"][0]["mean_draft_nodes"] <= 2.0


def test_generate_samples_reproducibly(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(model_dir), "--prompt", "hello world", "--no-chat"]
    argv += ["--max-new-tokens", "12", "--drafter", "lookup", "--temperature", "0.8"]
    outs = []
    for _ in range(2):
        assert main([*argv, "--seed", "5"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert main([*argv, "--temperature", "7"]) == 2
