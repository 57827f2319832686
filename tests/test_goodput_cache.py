"""The goodput cost curve on disk: measured once per machine, model and plan, a hit for the same
key, a miss when the weights mode, the linear backend, a kernel option, compile, the attention
kind or the thread count changes; a corrupt or old file ignored and rewritten; a busy
measurement never cached; recalibration forced by the config or the environment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specpilot.batch import BatchConfig, BatchEngine
from specpilot.engine import Engine, EngineConfig
from specpilot.errors import ConfigError
from specpilot.goodput import CostCurve
from specpilot.goodput import curve as curve_mod

from .conftest import tiny_model


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The curve file under tmp_path, a load sample the test sets, and a count of measurements
    (the real verify forwards, at up to 8 rows to stay fast). ``$SPECPILOT_CACHE`` stays as it
    is: the native kernels build under its parent too."""
    monkeypatch.delenv(curve_mod.RECALIBRATE_ENV, raising=False)
    state: dict[str, Any] = {"load": 0.0, "measured": 0, "path": tmp_path / "goodput.json"}
    monkeypatch.setattr(curve_mod, "curve_path", lambda: state["path"])
    real = curve_mod.measure_verify_curve

    def counted(*a: Any, **k: Any) -> CostCurve:
        state["measured"] += 1
        return real(*a, **k)

    monkeypatch.setattr(curve_mod, "measure_verify_curve", counted)
    monkeypatch.setattr(curve_mod, "sample_load", lambda fn, min_s: (fn(), state["load"]))
    monkeypatch.setattr(curve_mod, "load_limit", lambda: 0.3)
    return state


def _engine(**cfg: Any) -> Engine:
    cfg = {"goodput_rows": 8, **cfg}
    return Engine(tiny_model("llama", seed=3, std=0.12), EngineConfig(goodput=True, **cfg))


def test_measured_once_then_cached(machine: dict[str, Any]) -> None:
    a = _engine()._selector()
    assert a.curve_source == "measured" and machine["measured"] == 1
    assert machine["path"].exists()
    b = _engine()._selector()  # a fresh load of the same model, same plan
    assert b.curve_source == "cached" and machine["measured"] == 1
    assert b.curve.rows == a.curve.rows == [1, 2, 3, 4, 5, 6, 8]
    assert b.curve.seconds == a.curve.seconds
    assert b.summary()["curve_source"] == "cached"
    assert b.curve.smoothing == 0.2
    # the batched engine's calibration (one sequence, same shape) is the same measurement
    beng = BatchEngine(
        tiny_model("llama", seed=3, std=0.12),
        EngineConfig(goodput=True, goodput_rows=8),
        BatchConfig(max_batch=2, max_len=512),
    )
    beng._measure_curve()
    assert beng.selector is not None and beng.selector.curve_source == "cached"
    assert machine["measured"] == 1


@pytest.mark.parametrize(
    "change",
    [
        "linear",
        "attention",
        "native",
        "numerics",
        "kernel_option",
        "compiled",
        "threads",
        "rows",
        "model",
    ],
)
def test_a_changed_key_measures_anew(machine: dict[str, Any], change: str) -> None:
    _engine()._selector()
    assert machine["measured"] == 1
    cfg: dict[str, Any] = {}
    if change == "linear":
        cfg["linear"] = "torch"
    elif change == "attention":
        cfg["attention"] = "sdpa"
    elif change == "rows":
        cfg["goodput_rows"] = 4
    eng = _engine(**cfg)
    if change == "native":
        eng.model.native = True  # the weights mode (GGUF blocks) is part of the key
    elif change == "numerics":
        eng.model._numerics = "int8"  # what Transformer.set_numerics records
    elif change == "kernel_option":
        eng.model.model.layers[0].mlp.down_proj.tiles = ((1, 4), (4, 2))  # GGUFLinear tiling
    elif change == "compiled":
        eng.model.compiled = ("layers", False)
    elif change == "model":
        eng = Engine(
            tiny_model("llama", seed=3, std=0.12, n_layers=3),
            EngineConfig(goodput=True, goodput_rows=8),
        )
    before = torch.get_num_threads()
    if change == "threads":
        torch.set_num_threads(2)
    try:
        sel = eng._selector()
    finally:
        torch.set_num_threads(before)
    assert sel.curve_source == "measured" and machine["measured"] == 2, change
    # both curves are kept: the unchanged plan (or the changed one, for engine options) hits
    assert _engine(**cfg)._selector().curve_source == "cached" and machine["measured"] == 2


def test_the_key_ignores_weight_values_and_cache_size() -> None:
    a, b = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    a.setup_cache(64)
    b.setup_cache(256, batch=2, attention="exact")
    assert curve_mod.model_fingerprint(a) == curve_mod.model_fingerprint(b)
    key = curve_mod.curve_key(a, "exact", 128, (1, 2, 4))
    assert "weights=float32" in key and "attention=exact" in key and "threads=" in key
    a.native = True
    assert "weights=native" in curve_mod.curve_key(a, "exact", 128, (1, 2, 4))


def test_a_forced_kernel_isa_is_part_of_a_native_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A path forced by $SPECPILOT_KERNELS_ISA runs at its own speed: it gets its own curve."""
    a = tiny_model("llama", seed=1)
    a.native = True
    monkeypatch.delenv("SPECPILOT_KERNELS_ISA", raising=False)
    auto = curve_mod.curve_key(a, "fixed", 128, (1, 2, 4))
    monkeypatch.setenv("SPECPILOT_KERNELS_ISA", "avx2")
    forced = curve_mod.curve_key(a, "fixed", 128, (1, 2, 4))
    assert "isa=auto" in auto and "isa=avx2" in forced and auto != forced


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        "",
        None,  # a valid file whose entry has another version
        "shape",  # a valid entry for other row counts
        "negative",
    ],
)
def test_a_corrupt_or_old_file_is_ignored_and_rewritten(
    machine: dict[str, Any], content: str | None
) -> None:
    path: Path = machine["path"]
    path.parent.mkdir(parents=True, exist_ok=True)
    if content is None or content in ("shape", "negative"):
        _engine()._selector()
        data = json.loads(path.read_text())
        (key,) = data
        if content is None:
            data[key]["version"] = curve_mod.CURVE_VERSION - 1
        elif content == "shape":
            data[key]["rows"] = [1, 2, 4, 16]
        else:
            data[key]["seconds"][0] = -1.0
        path.write_text(json.dumps(data))
        machine["measured"] = 0
    else:
        path.write_text(content)
    sel = _engine()._selector()
    assert sel.curve_source == "measured" and machine["measured"] == 1
    data = json.loads(path.read_text())
    (entry,) = data.values()
    assert entry["version"] == curve_mod.CURVE_VERSION and entry["rows"] == [1, 2, 3, 4, 5, 6, 8]
    assert _engine()._selector().curve_source == "cached"


def test_a_busy_measurement_is_not_cached(machine: dict[str, Any]) -> None:
    machine["load"] = 1.5
    sel = _engine()._selector()
    assert sel.curve_source.startswith("measured, not cached") and "1.50" in sel.curve_source
    assert not machine["path"].exists()
    machine["load"] = 0.0
    quiet = _engine()._selector()
    assert quiet.curve_source == "measured" and machine["measured"] == 2
    machine["load"] = 2.0  # a forced re-measurement on a busy machine keeps the quiet curve
    again = _engine(goodput_recalibrate=True)._selector()
    assert again.curve_source.startswith("cached (a re-measurement")
    assert again.curve.seconds == quiet.curve.seconds and machine["measured"] == 3


def test_recalibration_is_forced_by_the_config_or_the_environment(
    machine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _engine()._selector()
    assert _engine(goodput_recalibrate=True)._selector().curve_source == "measured"
    assert machine["measured"] == 2
    monkeypatch.setenv(curve_mod.RECALIBRATE_ENV, "1")
    assert _engine()._selector().curve_source == "measured" and machine["measured"] == 3
    monkeypatch.setenv(curve_mod.RECALIBRATE_ENV, "0")
    assert _engine()._selector().curve_source == "cached" and machine["measured"] == 3


def test_an_unwritable_cache_is_skipped(
    machine: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    machine["path"] = blocker / "goodput.json"  # its directory is a file
    assert _engine()._selector().curve_source == "measured"
    assert _engine()._selector().curve_source == "measured"  # nothing kept, nothing raised


def test_the_calibration_settings_are_validated(machine: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="goodput_rows"):
        EngineConfig(goodput_rows=0)
    with pytest.raises(ConfigError, match="goodput_smoothing"):
        EngineConfig(goodput_smoothing=1.5)
    sel = _engine(goodput_smoothing=0.0, goodput_recalibrate=True)._selector()
    assert sel.curve.smoothing == 0.0


def test_the_curve_lives_under_the_cache_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPILOT_CACHE", "/somewhere/specpilot/models")
    assert curve_mod.curve_path() == Path("/somewhere/specpilot/goodput.json")
    monkeypatch.delenv("SPECPILOT_CACHE")
    assert curve_mod.curve_path() == Path.home() / ".cache" / "specpilot" / "goodput.json"


@pytest.mark.parametrize("batched", [False, True])
def test_bench_json_says_whether_the_curve_was_measured_or_cached(
    machine: dict[str, Any], tmp_path: Path, batched: bool
) -> None:
    from specpilot.cli import main

    from .test_cli import GOOD, _prompts
    from .test_loading import make_model, save_dir

    model_dir = save_dir(tmp_path / "tiny", make_model("llama-tied", seed=2))
    argv = ["bench", "--model", str(model_dir), "--prompts", str(_prompts(tmp_path, GOOD))]
    argv += ["--max-new-tokens", "12", "--drafter", "lookup", "--goodput", "--threads", "1"]
    argv += ["--batch-size", "2"] if batched else []
    sources = []
    for run in range(2):
        out = tmp_path / f"bench{run}.json"
        assert main([*argv, "--json", str(out)]) == 0
        g = json.loads(out.read_text())["goodput"]
        assert g["steps"] > 0 and g["curve"]["rows"][0] == 1
        sources.append(g["curve_source"])
    assert sources == ["measured", "cached"] and machine["measured"] == 1
