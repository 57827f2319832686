"""``--plan`` on generate, bench and profile (tiny model directory), and its bad inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specpilot.cli import main
from specpilot.costmodel import hardware as hw_mod
from specpilot.engine import EngineConfig
from specpilot.plan import Plan, save_plan
from specpilot.tree import TreeSpec

from .test_loading import make_model, save_dir

PROMPTS = [
    json.dumps({"id": "a", "prompt": "def f(x): return x + x + x", "chat": False}),
    json.dumps({"id": "b", "prompt": "hello hello hello world", "chat": False}),
]
TUNED = Plan(
    drafter="lookup",
    drafter_options={"min_n": 1, "max_n": 3},
    tree=TreeSpec(kind="static", paths=((0,), (1,), (0, 0), (0, 0, 0))),
    engine=EngineConfig(threads=1, static_buffers=True, device_accept=True),
    options={
        "adaptive_draft": {"threshold": 0.05, "min_nodes": 1},
        "hybrid_drafting": {"fallback": "suffix", "min_nodes": 1},
        "batch_budget": {"1": 3},
    },
)


@pytest.fixture(autouse=True)
def keep_threads() -> Any:
    """Plans set torch's thread count; give the rest of the suite its own back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_dir(tmp_path_factory.mktemp("plan") / "tiny", make_model("llama-tied", seed=2))


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    run = tmp_path / "run"
    save_plan(TUNED, run / "plan.json")
    return {"prompts": prompts, "run": run, "plan": run / "plan.json"}


def _bench(model_dir: Path, files: dict[str, Path], out: Path, *extra: str) -> int:
    return main(
        [
            "bench",
            "--model",
            str(model_dir),
            "--prompts",
            str(files["prompts"]),
            "--max-new-tokens",
            "20",
            "--json",
            str(out),
            *extra,
        ]
    )


def test_bench_with_plan(model_dir: Path, files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    assert _bench(model_dir, files, out, "--plan", str(files["run"])) == 0  # a run directory
    d = json.loads(out.read_text())
    assert d["lossless"] is True and d["drafter"] == "lookup"
    assert d["tree"]["kind"] == "static" and len(d["tree"]["paths"]) == 3  # budget table: 3
    assert d["threads"] == 1
    assert d["candidates"][0]["mean_draft_nodes"] <= 3


def test_generate_and_profile_with_plan(
    model_dir: Path,
    files: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rc = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--plan",
            str(files["plan"]),
            "--prompt",
            "hello hello",
            "--no-chat",
            "--max-new-tokens",
            "12",
        ]
    )
    assert rc == 0 and "lookup/static 4 nodes" in capsys.readouterr().err
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        hw_mod,
        "calibrate",
        lambda *a, **k: {"peak_flops": 1e11, "peak_flops_fp64": 5e10, "peak_bw": 4e10},
    )
    out = tmp_path / "p.json"
    args = ["--prompts", str(files["prompts"]), "--max-new-tokens", "12", "--max-budget", "4"]
    head = ["profile", "--model", str(model_dir), "--plan", str(files["plan"])]
    rc = main([*head, "--json", str(out), *args])
    assert rc == 0
    assert json.loads(out.read_text())["direction"] in ("tau", "kernel", "overhead")


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--drafter", "suffix"], "drop --drafter"),
        (["--tree", "dynamic"], "drop --tree"),
        (["--k", "3", "--threads", "2"], "drop --k, --threads"),
        # a flag given at its default value still conflicts: "given" is decided by None
        (["--k", "5"], "drop --k"),
        (["--device", "cpu", "--linear", "onednn"], "drop --device, --linear"),
        (["--lookup-min-n", "1"], "drop --lookup-min-n"),
    ],
)
def test_plan_conflicts_with_flags(
    model_dir: Path,
    files: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    rc = _bench(model_dir, files, tmp_path / "b.json", "--plan", str(files["plan"]), *extra)
    assert rc == 2 and message in _err(capsys)


def _write(tmp_path: Path, doc: Any) -> Path:
    p = tmp_path / "bad.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("{nope", "not a readable JSON plan"),
        ({"options": {"warp_drive": {"on": True}}}, "unknown mechanism 'warp_drive'"),
        ({"mechanisms": [{"id": "warp_drive", "params": {}}]}, "unknown mechanism"),
        ({"options": {"adaptive_draft": {"threshold": 7}}}, "threshold"),
        ({"tree": {"kind": "chain", "k": -1}}, "k must be a positive"),
        ({"drafter": "model"}, "--draft-model"),
        ({"drafter": "oracle"}, "neither one of"),
    ],
)
def test_bad_plan_files_exit_2(
    model_dir: Path,
    files: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    doc: Any,
    message: str,
) -> None:
    bad = _write(tmp_path, doc)
    rc = _bench(model_dir, files, tmp_path / "b.json", "--plan", str(bad))
    err = _err(capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    rc = _bench(model_dir, files, tmp_path / "b.json", "--plan", str(tmp_path / "missing"))
    assert rc == 2 and "no plan file" in _err(capsys)
