"""CPU calibration under load: a busy calibration is never cached, floors beaten re-calibrate."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specpilot.costmodel import hardware as hw_mod
from specpilot.costmodel.report import KernelRow

QUIET = {"peak_flops": 1e11, "peak_flops_fp64": 5e10, "peak_bw": 4e10}
BUSY = {"peak_flops": 4e10, "peak_flops_fp64": 2e10, "peak_bw": 1.3e10}


def _stat(others: list[float]) -> Callable[[], tuple[float, float, float]]:
    """A fake ``/proc/stat`` sampler: each call is one second later, with ``others[0]`` cores of
    other processes busy meanwhile (this process idle)."""
    state = [0.0, 0.0]

    def sample() -> tuple[float, float, float]:
        state[0] += 1.0
        state[1] += others[0]
        return state[0], state[1], 0.0

    return sample


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Injected load (``load[0]`` cores of other work) and a calibration whose peaks drop when
    the machine is busy, as a real one does."""
    load = [0.0]
    calls: list[float] = []

    def fake(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
        calls.append(load[0])
        return dict(BUSY if load[0] > 0.3 else QUIET)

    monkeypatch.setattr(hw_mod, "calibrate", fake)
    monkeypatch.setattr(hw_mod, "_cpu_times", _stat(load))
    monkeypatch.setattr(hw_mod, "LOAD_SAMPLE_S", 0.0)
    monkeypatch.setattr(hw_mod, "RETRY_WAIT_S", 0.0)
    monkeypatch.setattr(hw_mod, "load_limit", lambda: 0.3)
    monkeypatch.setattr(hw_mod, "_RECHECKED", set())
    return {"load": load, "calls": calls}


def test_other_load_subtracts_own_cpu_time() -> None:
    assert hw_mod.other_load((0.0, 10.0, 1.0), (2.0, 13.0, 2.0)) == 1.0
    assert hw_mod.other_load(None, (2.0, 13.0, 2.0)) is None
    assert hw_mod.other_load((0.0, 10.0, 1.0), (2.0, 10.5, 2.0)) == 0.0  # never negative


def test_real_load_sample_is_a_number_of_cores() -> None:
    a = hw_mod._cpu_times()
    if a is None:
        pytest.skip("no /proc/stat")
    sum(range(200_000))
    load = hw_mod.other_load(a, hw_mod._cpu_times())
    assert load is None or 0.0 <= load <= (torch.get_num_threads() + 64)


def test_busy_calibration_is_refused(tmp_path: Path, machine: dict) -> None:
    machine["load"][0] = 1.5  # another job on 1.5 cores
    busy = hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path)
    assert busy.source == "calibrated (not cached)" and busy.load == 1.5
    assert busy.peak_bw == BUSY["peak_bw"] and "not cached" in busy.notes[0]
    assert not (tmp_path / "hardware.json").exists()
    assert len(machine["calls"]) == 1  # the first try saw the load before measuring; one retry

    machine["load"][0] = 0.0
    quiet = hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path)
    assert quiet.source == "calibrated" and quiet.peak_bw == QUIET["peak_bw"] and not quiet.notes
    (entry,) = json.loads((tmp_path / "hardware.json").read_text()).values()
    assert entry["peak_bw"] == QUIET["peak_bw"] and entry["load"] == 0.0

    machine["load"][0] = 2.0  # a forced re-calibration while busy keeps the quiet one
    again = hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path, recalibrate=True)
    assert again.source == "calibrated (cached)" and again.peak_bw == QUIET["peak_bw"]
    assert "quiet calibration of" in again.notes[0]
    (entry,) = json.loads((tmp_path / "hardware.json").read_text()).values()
    assert entry["peak_bw"] == QUIET["peak_bw"]
    assert "measured" in again.describe() and "GB/s" in again.describe()


def test_load_during_the_measurement_counts(
    tmp_path: Path, machine: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quiet before, busy while measuring (a job started meanwhile): still refused."""

    def starts_a_job(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> dict:
        machine["load"][0] = 1.5
        return dict(QUIET)

    monkeypatch.setattr(hw_mod, "calibrate", starts_a_job)
    got = hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path)
    assert got.source == "calibrated (not cached)" and got.load == 1.5
    assert not (tmp_path / "hardware.json").exists()


def _rows(hw: hw_mod.Hardware) -> tuple[KernelRow, ...]:
    """lm_head: 100 MB in 3 ms; its floor is below 3 ms only with the quiet bandwidth."""
    floor = 1e3 * 100e6 / (0.9 * hw.peak_bw)
    return (KernelRow("lm_head", 0.0, 100e6, floor, 3.0), KernelRow("drafter", 0.0, 0.0, 0.0, 1.0))


def test_kernel_below_its_floor_recalibrates(tmp_path: Path, machine: dict, monkeypatch) -> None:
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    machine["load"][0] = 1.5
    busy = hw_mod.detect("cpu", torch.float32)
    assert hw_mod.beaten_floors(_rows(busy)) == ["lm_head"]  # 8.5 ms floor, 3 ms measured
    machine["load"][0] = 0.0
    hw, rows = hw_mod.floors_checked(busy, _rows, "cpu", torch.float32)
    assert hw.peak_bw == QUIET["peak_bw"] and hw.source == "calibrated"
    assert not hw_mod.beaten_floors(rows) and "re-calibrated" in hw.notes[0]
    n = len(machine["calls"])
    hw2, _ = hw_mod.floors_checked(busy, _rows, "cpu", torch.float32)  # once per process
    assert len(machine["calls"]) == n and "already re-calibrated" in " ".join(hw2.notes)


def test_table_peaks_are_not_recalibrated(machine: dict) -> None:
    table = hw_mod.Hardware("GPU", 1e12, 1e9, 1e11, "table: a datasheet")
    hw, _ = hw_mod.floors_checked(table, _rows, "cpu", torch.float32)
    assert not machine["calls"] and hw.peak_bw == 1e9
    assert "lm_head" in hw.notes[0] and "still measured faster" in hw.notes[-1]


def test_trained_drafter_has_a_floor() -> None:
    """The head's kernel class gets a floor from its weights per forward (it had none)."""
    from specpilot.costmodel import ProfileConfig, profile
    from specpilot.costmodel.roofline import trained_drafter_work, trained_net
    from specpilot.drafters.head import HeadDrafter
    from specpilot.drafters.suffix import SuffixDrafter
    from specpilot.drafters.union import UnionDrafter
    from specpilot.engine import Engine, EngineConfig
    from specpilot.tree import TreeSpec

    from .conftest import tiny_model
    from .test_trained_drafters import make_net

    model = tiny_model("llama", seed=1)
    net = make_net("head", model)
    head = HeadDrafter(net)
    assert trained_net(UnionDrafter(SuffixDrafter(), head)) is head
    assert trained_net(SuffixDrafter()) is None
    one = trained_drafter_work(net, 1.0)
    own = sum(p.numel() for n, p in net.named_parameters() if n.startswith(("in_proj", "layers")))
    assert one.flops == 2 * (own + net.head.numel())
    head_bytes = 2 if "Bf16" in type(net.head_fn).__name__ else 4  # packed bf16 where native
    assert one.bytes == own * 4 + net.head.numel() * head_bytes

    hw = hw_mod.Hardware("test machine", 1e11, 4e10, 5e10, "test")
    cfg = ProfileConfig(max_new_tokens=12, max_budget=8, verify_repeats=1, draft_samples=4)
    eng = Engine(model, EngineConfig(attention="exact"))
    prompts = [("a", [3, 4, 5, 3, 4, 5, 3, 4])]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = profile(eng, prompts, lambda: HeadDrafter(net), TreeSpec(budget=4), cfg, hardware=hw)
    finally:
        torch.set_num_threads(threads)
    (row,) = [k for k in r.kernels if k.name == "drafter"]
    forwards_per_step = row.flops / one.flops
    assert forwards_per_step >= 1.0  # at least one head forward per decode step
    assert row.bytes == pytest.approx(one.bytes * forwards_per_step)
    assert row.floor_ms > 0 and row.measured_ms > 0
