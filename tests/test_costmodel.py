"""Cost model: roofline counts by hand, hardware table and calibration cache, factors (pure
functions on hand-made inputs), direction, sensitivity; ``profile`` end to end on a tiny model,
with sleeps injected inside and outside the profiled ranges, and with a planted lossy verifier
(the profile stops with the forcing report); the ``profile`` CLI writes JSON and HTML."""

from __future__ import annotations

import argparse
import doctest
import importlib
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import specpilot.engine as engine_mod
import specpilot.kernels.rowops as rowops_mod
from specpilot import cli_profile
from specpilot.costmodel import (
    CostReport,
    Hardware,
    LossyPlanError,
    ProfileConfig,
    profile,
    roofline,
)
from specpilot.costmodel import factors as factors_mod
from specpilot.costmodel import hardware as hw_mod
from specpilot.costmodel import measure as measure_mod
from specpilot.costmodel import pipeline as pipeline_mod
from specpilot.costmodel import runs as runs_mod
from specpilot.costmodel.factors import kernel_factor, overhead_factor, tau_factor, tau_ratio
from specpilot.costmodel.html import to_html
from specpilot.costmodel.measure import collect, profiler_cost_per_event
from specpilot.costmodel.report import direction, kernel_rows, row_times, sensitivity
from specpilot.costmodel.roofline import Dtypes, StepShape, Work, floor_s, prefill_work, step_work
from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig
from specpilot.forcing import MISMATCH
from specpilot.tree import Acceptance, DraftTree, TreeSpec

from .conftest import tiny_config, tiny_model
from .test_loading import make_model, save_dir

HW = Hardware("test machine", 1e11, 4e10, 5e10, "test")

# -- roofline by hand ---------------------------------------------------------------------------


def test_step_work_by_hand() -> None:
    """tiny config: D=48, L=2, H=4, Hk=2, hd=12, I=96, V=64; R=3 rows, K=10 cached keys."""
    cfg = tiny_config()
    shape = StepShape(rows=3, row_keys=3 * 13, keys=10)
    w = step_work(cfg, shape, Dtypes(weight=4, act=4, cache=8))
    # qkv per layer: 2*3*48*96 + 4*3*48 (norm) + 3*3*6*12 (RoPE) = 27648 + 576 + 648 = 28872
    #          bytes: 4*(48*96 + 48) + 4*3*(48 + 96) + 4*2*3*12 = 18624 + 1728 + 288 = 20640
    assert (w["qkv"].flops, w["qkv"].bytes) == (2 * 28872, 2 * 20640)
    # attention: 4*4*12*39 = 7488 (fp64); bytes 8*2*12*2*13 + 4*2*3*4*12 = 4992 + 1152 = 6144
    assert (w["attention"].flops, w["attention"].bytes) == (2 * 7488, 2 * 6144)
    assert w["attention"].fp64_flops == 2 * 7488
    # o_proj: 2*3*48*48 = 13824; bytes 4*48*48 + 4*3*96 = 9216 + 1152 = 10368
    assert (w["o_proj"].flops, w["o_proj"].bytes) == (2 * 13824, 2 * 10368)
    # gate_up: 2*3*48*192 + 4*3*48 + 5*3*96 = 55296 + 576 + 1440 = 57312
    #   bytes: 4*(2*96*48 + 48) + 4*3*(48 + 96) = 37056 + 1728 = 38784
    assert (w["gate_up"].flops, w["gate_up"].bytes) == (2 * 57312, 2 * 38784)
    # down: 2*3*96*48 = 27648; bytes 4*96*48 + 4*3*144 = 18432 + 1728 = 20160
    assert (w["down"].flops, w["down"].bytes) == (2 * 27648, 2 * 20160)
    # lm_head (once): 2*3*48*64 + 4*3*48 = 18432 + 576 = 19008
    #   bytes: 4*(64*48 + 48) + 4*3*48 + 4*3*64 = 12480 + 576 + 768 = 13824
    assert (w["lm_head"].flops, w["lm_head"].bytes) == (19008, 13824)
    assert w["recurrent"] == Work(0.0, 0.0)
    # sdpa attention keeps the cache in the model dtype: no fp64 FLOPs, 4-byte K/V
    w4 = step_work(cfg, shape, Dtypes(4, 4, 4))
    assert w4["attention"].fp64_flops == 0 and w4["attention"].bytes == 2 * (2496 + 1152)


def test_native_weights_count_their_block_bytes() -> None:
    """A native model's floors read its GGUF blocks as stored (Q4_1 layers: 20 bytes per 32
    weights; a Q8_0 head: 34 per 32), not the fp32 size of the same weights."""

    class Blocks(torch.nn.Module):
        def __init__(self, out_f: int, in_f: int, per32: int) -> None:
            super().__init__()
            self.in_features, self.out_features = in_f, out_f
            self.register_buffer(
                "blocks", torch.zeros(out_f * in_f // 32 * per32, dtype=torch.uint8)
            )

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].qkv = Blocks(96, 64, 20)
    model.model.layers[0].down = Blocks(64, 128, 20)
    model.lm_head = Blocks(256, 64, 34)
    assert roofline.native_weight_bytes(model) == (20 / 32, 34 / 32)
    assert roofline.native_weight_bytes(torch.nn.Linear(4, 4)) is None
    cfg, shape = tiny_config(), StepShape(rows=1, row_keys=5, keys=4)
    fp32 = step_work(cfg, shape, Dtypes(4, 4, 4))["lm_head"]
    q8 = step_work(cfg, shape, Dtypes(20 / 32, 4, 4, head_weight=34 / 32))["lm_head"]
    v, d = cfg.vocab_size, cfg.dim
    assert fp32.bytes - q8.bytes == (4 - 34 / 32) * v * d + (4 - 20 / 32) * d
    assert q8.flops == fp32.flops


def test_arch_variants_by_hand() -> None:
    shape = StepShape(rows=1, row_keys=5, keys=4)
    dt = Dtypes(4, 4, 4)
    base = step_work(tiny_config(), shape, dt)["qkv"]
    qwen2 = step_work(tiny_config("qwen2"), shape, dt)["qkv"]  # q/k/v bias: +96 FLOPs, +96 w
    assert qwen2.flops - base.flops == 2 * 96 and qwen2.bytes - base.bytes == 2 * 4 * 96
    qwen3 = step_work(tiny_config("qwen3"), shape, dt)["qkv"]  # q/k norm: 4*6*12, weights 2*12
    assert qwen3.flops - base.flops == 2 * 4 * 72 and qwen3.bytes - base.bytes == 2 * 4 * 24


def test_prefill_work_by_hand() -> None:
    # P=5: qkv 2*(2*5*48*96 + 4*5*48 + 3*5*6*12) = 96240; attention 2*4*4*12*15 = 5760 (causal);
    # o_proj 2*2*5*48*48 = 46080; gate_up 2*(2*5*48*192 + 4*5*48 + 5*5*96) = 191040;
    # down 2*2*5*96*48 = 92160; lm_head one row 2*48*64 + 4*48 = 6336
    w = prefill_work(tiny_config(), [5], Dtypes(4, 4, 4))
    assert w.flops == 96240 + 5760 + 46080 + 191040 + 92160 + 6336
    two = prefill_work(tiny_config(), [5, 5], Dtypes(4, 4, 4))
    assert two.flops == 2 * w.flops and two.bytes == 2 * w.bytes


def test_floor() -> None:
    # compute-bound: 6e9 FLOPs at 0.6 x 1e11 = 0.1 s; 1e6 bytes at 0.9 x 4e10 = 27.8 us
    assert floor_s(Work(6e9, 1e6), 1e11, 4e10, 0.6, 0.9) == pytest.approx(0.1)
    # memory-bound: 3.6e9 bytes at 0.9 x 4e10 = 0.1 s
    assert floor_s(Work(1e3, 3.6e9), 1e11, 4e10, 0.6, 0.9) == pytest.approx(0.1)
    # fp64 FLOPs against the fp64 peak (half here)
    assert floor_s(Work(6e9, 0, 6e9), 1e11, 4e10, 0.6, 0.9, 5e10) == pytest.approx(0.2)
    # int8 FLOPs against the int8 peak (8x here): 6e9 at 0.6 x 8e11 = 12.5 ms, + 1.2e9 fp32 at
    # 0.6 x 1e11 = 20 ms; without an int8 peak they fall back to the fp32 one
    w8 = Work(7.2e9, 1e6, 0.0, 6e9)
    assert floor_s(w8, 1e11, 4e10, 0.6, 0.9, None, 8e11) == pytest.approx(0.0325)
    assert floor_s(w8, 1e11, 4e10, 0.6, 0.9) == pytest.approx(0.12)


def test_int8_share_moves_the_gemm_flops_only() -> None:
    """In the int8 profile the linears' 2 x weights x rows FLOPs are integer dot products; the
    norms, RoPE, SiLU and attention stay fp32."""
    cfg, shape = tiny_config(), StepShape(rows=3, row_keys=3 * 13, keys=10)
    fp = step_work(cfg, shape, Dtypes(4, 4, 4))
    q8 = step_work(cfg, shape, Dtypes(4, 4, 4, int8=1.0, head_int8=0.5))
    assert all(q8[k].flops == fp[k].flops and fp[k].int8_flops == 0 for k in fp)
    assert q8["qkv"].int8_flops == 2 * 2 * 3 * 48 * 96  # L = 2 layers
    assert q8["gate_up"].int8_flops == 2 * 2 * 3 * 48 * 192
    assert q8["down"].int8_flops == q8["o_proj"].int8_flops * 2 == 2 * 2 * 3 * 96 * 48
    assert q8["lm_head"].int8_flops == 0.5 * 2 * 3 * 48 * 64
    assert q8["attention"].int8_flops == 0


def test_native_int8_share_counts_the_int8_kernels() -> None:
    class Lin(torch.nn.Module):
        def __init__(self, out_f: int, in_f: int, int8: bool) -> None:
            super().__init__()
            self.in_features, self.out_features, self.int8 = in_f, out_f, int8
            self.register_buffer("blocks", torch.zeros(1, dtype=torch.uint8))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].q = Lin(96, 64, True)  # 6144 elements on the int8 kernel
    model.layers[0].v = Lin(32, 64, False)  # 2048 on the fp32 one (e.g. an F16 tensor)
    model.lm_head = Lin(256, 64, True)
    assert roofline.native_int8_share(model) == (0.75, 1.0)
    assert roofline.native_int8_share(torch.nn.Linear(4, 4)) == (0.0, 0.0)


# -- hardware -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device_name", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("Tesla T4", None),
    ],
)
def test_gpu_table(device_name: str, entry: str | None) -> None:
    e = hw_mod.match_gpu(device_name)
    assert (e.name if e else None) == entry
    if e is not None:
        assert 1e14 < e.bf16 < 5e15 and 5e11 < e.bw < 1e13 and e.cite


def test_cpu_calibration_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake(device: torch.device, dtype: torch.dtype, repeats: int = 3) -> dict[str, float]:
        calls.append(dtype)
        return {"peak_flops": 1e11, "peak_flops_fp64": 5e10, "peak_bw": 4e10}

    monkeypatch.setattr(hw_mod, "calibrate", fake)
    monkeypatch.setattr(hw_mod, "_cpu_times", lambda: None)  # no load sample: a quiet machine
    a = hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path)
    b = hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path)
    assert len(calls) == 1 and a.source == "calibrated" and b.source == "calibrated (cached)"
    assert (b.peak_flops, b.peak_bw, b.peak_flops_fp64) == (1e11, 4e10, 5e10)
    key = next(iter(json.loads((tmp_path / "hardware.json").read_text())))
    assert f"threads={torch.get_num_threads()}" in key and torch.__version__ in key
    hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path, recalibrate=True)
    assert len(calls) == 2


def test_cached_peaks_are_the_best_quiet_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peak is a maximum: a later quiet calibration that reads less (a neighbour's traffic on
    a shared host) keeps the cached figure and says so; one that reads more raises it."""
    readings = iter([(1e11, 4e10, 8e11), (1.2e11, 2.5e10, 6e11), (0.9e11, 5e10, 9e11)])

    def fake(device: torch.device, dtype: torch.dtype, repeats: int = 3) -> dict[str, float]:
        f, bw, i8 = next(readings)
        return {"peak_flops": f, "peak_flops_fp64": 5e10, "peak_bw": bw, "peak_ops_int8": i8}

    monkeypatch.setattr(hw_mod, "calibrate", fake)
    monkeypatch.setattr(hw_mod, "_cpu_times", lambda: None)
    first = hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path)
    assert (first.peak_bw, first.int8_peak, first.notes) == (4e10, 8e11, ())
    low = hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path, recalibrate=True)
    assert (low.peak_flops, low.peak_bw, low.peak_ops_int8) == (1.2e11, 4e10, 8e11)
    assert "peak_bw, peak_ops_int8 kept from an earlier quiet calibration" in low.notes[0]
    assert "25.0 GB/s" in low.notes[0]
    high = hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path, recalibrate=True)
    assert (high.peak_flops, high.peak_bw, high.peak_ops_int8) == (1.2e11, 5e10, 9e11)
    cached = hw_mod.detect("cpu", torch.float32, cache_dir=tmp_path)
    assert cached.source == "calibrated (cached)" and cached.peak_bw == 5e10
    assert "int8 900 GOP/s" in cached.describe()


def test_no_int8_peak_falls_back_to_the_dtype_peak() -> None:
    assert HW.peak_ops_int8 is None and HW.int8_peak == HW.peak_flops


def test_calibration_measures_something() -> None:
    m = hw_mod.calibrate(torch.device("cpu"), torch.float32, repeats=1)
    assert m["peak_flops"] > 1e8 and m["peak_bw"] > 1e8 and m["peak_flops_fp64"] > 1e7
    assert m["peak_ops_int8"] > 1e8  # torch's int8 GEMM (0.0 only where torch lacks one)


# -- factors ------------------------------------------------------------------------------------


def test_tau_factor_by_hand() -> None:
    # the plan commits 2.0 tokens per step, the oracle tree at N* 3.0: 1.5x left in tau
    assert tau_factor(plan_tau=2.0, best_tau=3.0) == pytest.approx(1.5)
    assert tau_ratio(plan_tau=2.0, best_tau=3.0) == pytest.approx(1.5)
    # the plan verifies more than N*: the raw ratio is below 1, the factor stays 1
    assert tau_ratio(plan_tau=2.5, best_tau=2.0) == pytest.approx(0.8)
    assert tau_factor(plan_tau=2.5, best_tau=2.0) == 1.0
    assert tau_factor(plan_tau=1.0, best_tau=1.0) == 1.0  # plain AR
    with pytest.raises(ValueError, match="plan_tau"):
        tau_factor(plan_tau=0.0, best_tau=1.0)


def test_kernel_factor_by_hand() -> None:
    measured = {"qkv": 3.0, "down": 1.0, "drafter": 0.5}
    floors = {"qkv": 1.0, "down": 1.0, "drafter": 0.0}
    assert kernel_factor(measured, floors) == pytest.approx(4.5 / 2.0)  # 2.25 > 1
    assert kernel_factor({"qkv": 1.0}, {"qkv": 1.0}) == 1.0  # at the roofline
    # a class faster than its floor (or not measured) counts at its floor: no lead hides a gap
    assert kernel_factor({"qkv": 2.0}, {"qkv": 1.0, "down": 1.0}) == 1.5
    assert kernel_factor({"qkv": 2.0, "prefill": 1.0}, {"qkv": 1.0, "prefill": 3.0}) == 1.25
    assert kernel_factor({"qkv": 1.0}, {}) == float("inf")


def test_overhead_factor_by_hand() -> None:
    # 12 ms of wall time per step, 8 ms of it in kernels: 1.5x
    assert overhead_factor(wall_step_s=0.012, kernel_step_s=0.008) == pytest.approx(1.5)
    assert overhead_factor(0.012, 0.0) == float("inf")
    # 0.010 s plain, 0.015 s profiled over 100 steps and 500,000 events: 1 us per event
    assert profiler_cost_per_event(0.010, 0.015, 100, 500_000) == pytest.approx(1e-6)
    assert profiler_cost_per_event(0.015, 0.010, 100, 500_000) == 0.0  # never negative
    assert profiler_cost_per_event(0.010, 0.015, 100, 0) == 0.0


def test_factor_docstring_examples() -> None:
    for mod in (factors_mod, measure_mod):
        res = doctest.testmod(mod)
        assert res.failed == 0 and res.attempted > 0, mod.__name__


def test_direction_is_the_argmax() -> None:
    assert direction({"tau": 1.5, "kernel": 3.0, "overhead": 1.1}) == "kernel"
    assert direction({"tau": 2.0, "kernel": 1.0, "overhead": 1.9}) == "tau"
    assert direction({"tau": 1.0, "kernel": 1.2, "overhead": 4.0}) == "overhead"
    assert direction({"tau": 2.0, "kernel": 2.0, "overhead": 2.0}) == "tau"  # ties: first


def test_sensitivity_flags_close_factors() -> None:
    work = {"down": Work(1e3, 3.6e8)}  # memory-bound: floor = 3.6e8 / (0.9 * 4e10) = 10 ms
    close = {"down": 0.021}  # kernel factor 2.1, tau factor 2.0
    rows = kernel_rows(work, close, HW, 0.6, 0.9)
    assert kernel_factor(*row_times(rows)) == pytest.approx(2.1)
    points, stable = sensitivity(work, close, HW, 0.6, 0.9, tau_f=2.0, overhead_f=1.0)
    assert len(points) == 9 and not stable
    assert {p.direction for p in points} == {"tau", "kernel"}
    low_beta = next(p for p in points if p.alpha == 0.6 and p.beta == pytest.approx(0.72))
    assert low_beta.kernel_factor == pytest.approx(2.1 * 0.8) and low_beta.direction == "tau"
    far = {"down": 0.05}  # kernel factor 5: stays the direction under +-20%
    _, stable = sensitivity(work, far, HW, 0.6, 0.9, tau_f=2.0, overhead_f=1.0)
    assert stable


# -- profile end to end -------------------------------------------------------------------------

PROMPTS = [("a", [3, 4, 5, 3, 4, 5, 3, 4]), ("b", [10, 20, 30, 10, 20, 30, 10])]


def _profile(drafter: str = "none", tokens: int = 24, **kw: Any) -> CostReport:
    eng = Engine(tiny_model("llama", seed=1), EngineConfig(attention="exact"))
    make = (lambda: None) if drafter == "none" else (lambda: make_drafter(drafter))
    cfg = ProfileConfig(max_new_tokens=tokens, max_budget=16, verify_repeats=2, draft_samples=8)
    threads = torch.get_num_threads()
    # one thread: the tiny model gains nothing from two, and idle OpenMP workers spinning
    # against another process on a 2-core machine turn a 1 ms step into tens of ms
    torch.set_num_threads(1)
    try:
        return profile(eng, PROMPTS, make, TreeSpec(budget=8), cfg, hardware=HW, **kw)
    finally:
        torch.set_num_threads(threads)


def _check_report(r: CostReport) -> None:
    assert r.direction == direction(r.factors)
    assert r.gap == pytest.approx(r.tau_factor * r.kernel_factor * r.overhead_factor)
    assert r.tau_factor >= 1.0 and r.kernel_factor > 1.0 and r.overhead_factor > 0.5
    assert [k.name for k in r.kernels] == [
        "qkv",
        "attention",
        "o_proj",
        "gate_up",
        "down",
        "lm_head",
        "recurrent",
        "drafter",
        "prefill",
    ]
    assert all(k.measured_ms > 0 for k in r.kernels if k.name not in ("recurrent", "drafter"))
    assert r.kernel_step_ms == pytest.approx(sum(k.measured_ms for k in r.kernels))
    assert len(r.sensitivity) == 9 and r.mismatches == 0
    assert r.forcing.startswith("PASS: 2 prompts")
    assert r.n_star in [b.n for b in r.budgets]


def test_profile_ar() -> None:
    r = _profile("none")
    _check_report(r)
    assert [(b.n, b.tau_opt, b.tau_bf) for b in r.budgets] == [(0, 1.0, 1.0)]
    assert r.tau_factor == r.tau_actual == r.tau_replay_plan == 1.0
    assert r.n_star == 0 and r.drafter == "none"
    assert r.steps == 2 * 23  # one decode step per token after the prefill one


def test_profile_lookup() -> None:
    r = _profile("lookup")
    _check_report(r)
    assert r.tau_actual > 1.0 and r.drafter == "lookup"
    assert r.tau_bf_at_plan == pytest.approx(r.tau_actual)  # replay reproduces the engine
    assert r.tau_replay_plan == pytest.approx(r.tau_actual)
    opt = {b.n: b.tau_opt for b in r.budgets}
    assert opt[8] >= r.tau_actual and all(b.tau_bf <= b.tau_opt for b in r.budgets)
    assert next(k for k in r.kernels if k.name == "drafter").measured_ms > 0
    d = r.to_json()
    for key in ("tau_factor", "kernel_factor", "overhead_factor", "gap", "direction", "n_star"):
        assert key in d
    assert d["tau_opt"][0] == {"n": 0, "tau": 1.0} and len(d["tau_opt"]) == len(r.budgets)
    assert set(d["kernels"][0]) == {"name", "flops", "bytes", "floor_ms", "measured_ms"}
    json.dumps(d)
    page = to_html(r)
    assert page.count("<svg") == 2


def _accept_first_child(tree: DraftTree, target: Any) -> Acceptance:
    """A lossy verifier: accepts the first child at every node, whatever the target chose."""
    kids, toks = tree.children(), tree.tokens.tolist()
    path: list[int] = []
    node = -1
    while kids[node + 1]:
        node = kids[node + 1][0]
        path.append(node)
    return Acceptance(tuple(path), (*(toks[i] for i in path), int(target[node + 1])))


def test_lossy_plan_stops_the_profile_with_the_forcing_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_verify_home(), "verify_greedy", _accept_first_child)
    timed: list[str] = []
    real_profiled, real_verify = runs_mod.profiled, pipeline_mod.time_verify
    monkeypatch.setattr(
        runs_mod, "profiled", lambda *a, **k: timed.append("profiled") or real_profiled(*a, **k)
    )
    monkeypatch.setattr(
        pipeline_mod, "time_verify", lambda *a, **k: timed.append("verify") or real_verify(*a, **k)
    )
    with pytest.raises(LossyPlanError) as e:
        _profile("lookup")
    rep = e.value.forcing
    assert e.value.run == "plain" and rep.status == MISMATCH and not rep.ok
    assert rep.n_prompts == 1 and len(rep.divergences) == 1  # stopped at the first prompt
    d = rep.divergences[0]
    assert d.prompt_id == "a" and d.ref_margin is not None  # the reference recorded margins
    assert "MISMATCH" in str(e.value) and rep.summary() in str(e.value)
    assert timed == []  # nothing of the lossy plan was profiled or timed
    # plain AR has no draft tokens to accept wrongly: the same verifier profiles it to the end
    ar = _profile("none", tokens=8)
    assert ar.forcing.startswith("PASS: 2 prompts") and ar.mismatches == 0 and ar.steps == 2 * 7


SLEEP = 0.005  # large against the tiny model's ~1 ms step, so timing noise cannot hide it


def _sleepy_range(name: str, real: Any) -> Any:
    @contextmanager
    def ctx(n: str) -> Any:
        with real(n):
            if n == name:
                time.sleep(SLEEP)
            yield

    return ctx


def test_sleep_in_a_range_raises_that_class_and_the_kernel_factor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = _profile("none", tokens=16)
    # the MLP, whose down range this is, lives in specpilot.kernels.rowops
    monkeypatch.setattr(rowops_mod, "kernel_range", _sleepy_range("down", rowops_mod.kernel_range))
    slow = _profile("none", tokens=16)
    down = {r.name: r for r in base.kernels}["down"]
    down2 = {r.name: r for r in slow.kernels}["down"]
    added = 2 * SLEEP * 1e3  # one sleep per layer, two layers, one forward per step
    assert added * 0.95 < down2.measured_ms - down.measured_ms < added * 1.5
    floors = sum(k.floor_ms for k in base.kernels)
    # the factor grows by the time the class gained (a VM's sleep overshoots by up to ~30%),
    # plus a little: the prefill's own sleeps land in the prefill class
    gain = (down2.measured_ms - down.measured_ms) / floors
    assert 0.9 * gain < slow.kernel_factor - base.kernel_factor < 1.4 * gain
    assert slow.direction == "kernel"
    assert slow.overhead_factor < base.overhead_factor + 0.1  # wall and kernel time grew alike


def _verify_home() -> Any:
    """The module whose ``verify_greedy`` the engine's step calls (outside every range)."""
    try:
        return importlib.import_module("specpilot.verify")
    except ImportError:
        return engine_mod


OUTSIDE_SLEEP = 0.02
"""Long against the ~1-2 ms of kernels that follow it: after an idle of a few ms the next kernels
run measurably slower on a VM (cold caches, a descheduled vCPU: up to ~2 ms more per step seen
here), which a 5 ms sleep's 1 ms kernel bound cannot tell from the sleep itself."""


def test_sleep_outside_the_ranges_raises_the_overhead_factor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = _profile("none", tokens=16)
    again = _profile("none", tokens=16)  # run-to-run noise of this machine, now
    noise_wall = abs(again.wall_step_ms - base.wall_step_ms)
    noise_kernel = abs(again.kernel_step_ms - base.kernel_step_ms)
    home = _verify_home()
    real = home.verify_greedy

    def slow_verify(*a: Any) -> Any:
        time.sleep(OUTSIDE_SLEEP)
        return real(*a)

    monkeypatch.setattr(home, "verify_greedy", slow_verify)
    slow = _profile("none", tokens=16)
    added = OUTSIDE_SLEEP * 1e3  # one verify per step, outside every profiled range
    # absolute bounds widened by the noise measured just before: the tiny model's ~1 ms step
    # jitters by a good fraction of itself on a shared 2-core machine
    grew = slow.wall_step_ms - base.wall_step_ms
    # upper bound: a VM's sleep overshoots by up to ~50% (5 ms slept as 7.4 ms seen here)
    assert 0.8 * added - 2 * noise_wall < grew < 1.5 * added + 2.0 + 2 * noise_wall
    assert abs(slow.kernel_step_ms - base.kernel_step_ms) < 0.2 * added + 2 * noise_kernel
    assert slow.overhead_factor == pytest.approx(slow.wall_step_ms / slow.kernel_step_ms)
    # the kernel time may move within the bound above (caches and clocks go cold across a sleep):
    # the factor's rise is measured against the larger of the two kernel times
    kernel = max(base.kernel_step_ms, slow.kernel_step_ms)
    assert slow.overhead_factor > base.overhead_factor + 0.5 * added / kernel


class _Ev:
    """Stands in for a Kineto event (the methods :func:`collect` reads)."""

    def __init__(self, name: str, start: int, end: int, annotation: bool = False) -> None:
        self._n, self._s, self._e, self._a = name, start, end, annotation

    def name(self) -> str:
        return self._n

    def start_ns(self) -> int:
        return self._s

    def end_ns(self) -> int:
        return self._e

    def is_user_annotation(self) -> bool:
        return self._a

    def device_type(self) -> Any:
        return torch.autograd.DeviceType.CPU


def test_collect_attributes_nested_ranges_to_prefill_and_drafter() -> None:
    us = 1000  # ns
    events = [
        _Ev("prefill", 0, 100 * us, True),
        _Ev("qkv", 10 * us, 20 * us, True),  # inside prefill: prefill's time
        _Ev("aten::mm", 11 * us, 19 * us),
        _Ev("drafter", 200 * us, 230 * us, True),
        _Ev("o_proj", 205 * us, 210 * us, True),  # a draft model's layer: drafter's time
        _Ev("qkv", 300 * us, 340 * us, True),
        _Ev("aten::mm", 301 * us, 339 * us),
        _Ev("down", 400 * us, 410 * us, True),
    ]
    ct = collect(events, cuda=False)
    assert ct.all_events == len(events) and ct.draft_o_proj == 1
    assert ct.seconds == pytest.approx(
        {"prefill": 100e-6, "drafter": 30e-6, "qkv": 40e-6, "down": 10e-6}
    )  # nested qkv and o_proj belong to prefill and drafter; only the top-level qkv counts
    assert ct.events == {"prefill": 3, "drafter": 2, "qkv": 2, "down": 1}
    # 1 us per recorded event inside each class comes off
    assert ct.corrected(1e-6) == pytest.approx(
        {"prefill": 97e-6, "drafter": 28e-6, "qkv": 38e-6, "down": 9e-6}
    )
    # an inflated cost per event takes a class down to half its recorded time, never to 0
    assert ct.corrected(100e-6) == pytest.approx(
        {"prefill": 50e-6, "drafter": 15e-6, "qkv": 20e-6, "down": 5e-6}
    )


def test_ranges_are_off_by_default() -> None:
    from specpilot import profiling

    assert not profiling.kernel_ranges_enabled()
    assert profiling.kernel_range("qkv") is profiling.kernel_range("down")  # the shared no-op


# -- CLI ----------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli_profile.add_parser(p.add_subparsers(dest="cmd"))
    return p.parse_args(["profile", *argv])


def _fake_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        hw_mod,
        "calibrate",
        lambda *a, **k: {
            "peak_flops": 1e11,
            "peak_flops_fp64": 5e10,
            "peak_bw": 4e10,
        },
    )
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))


def test_cli_writes_json_and_html(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_calibration(tmp_path, monkeypatch)
    model = save_dir(tmp_path / "tiny", make_model("llama-tied", seed=2))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "prompt": "def f(x): return x + x + x + x"})
        + "\n"
        + json.dumps({"id": "b", "prompt": "hello hello hello world hello"})
        + "\n"
    )
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    args = _parse(
        [
            "--model",
            str(model),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "16",
            "--drafter",
            "lookup",
            "--max-budget",
            "8",
            "--json",
            str(out),
            "--html",
            str(page),
        ]
    )
    assert cli_profile.run(args) == 0
    d = json.loads(out.read_text())
    for key in (
        "tau_factor",
        "kernel_factor",
        "overhead_factor",
        "gap",
        "direction",
        "n_star",
        "tau_opt",
        "kernels",
        "tau_bf",
        "tau_actual",
        "sensitivity",
        "profile_s",
    ):
        assert key in d, key
    assert d["direction"] in ("tau", "kernel", "overhead") and d["drafter"] == "lookup"
    assert d["hardware"]["source"].startswith("calibrated")  # cached or not: the load decides
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") == 2
    assert html.count("<rect") == 2 * sum(
        1 for k in d["kernels"] if k["floor_ms"] > 0 or k["measured_ms"] > 0
    )
    assert "token forcing: PASS" in html and d["forcing"].startswith("PASS")


def test_cli_lossy_plan_exits_1_with_the_forcing_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_calibration(tmp_path, monkeypatch)
    monkeypatch.setattr(_verify_home(), "verify_greedy", _accept_first_child)
    model = save_dir(tmp_path / "tiny", make_model("llama-tied", seed=2))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "rep", "prompt": "hello hello hello hello hello"}) + "\n")
    out = tmp_path / "r.json"
    argv = ["--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "16"]
    argv += ["--drafter", "lookup", "--max-budget", "8", "--json", str(out)]
    assert cli_profile.run(_parse(argv)) == 1
    cap = capsys.readouterr()
    text = cap.out + cap.err
    assert "MISMATCH" in text and "the plan is lossy" in text and "rep" in text
    assert not out.exists()  # no report of a lossy plan


def test_html_escapes_what_it_shows() -> None:
    r = _profile("none", tokens=8)
    page = to_html(r, title="<b>x</b> & y")
    assert "<title>&lt;b&gt;x&lt;/b&gt; &amp; y</title>" in page and "<b>x</b>" not in page
    assert "No drafter: tau = 1 at every budget." in page and page.count("<svg") == 1


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_profile.main(["--model", str(tmp_path / "missing"), "--limit", "1"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specpilot: error:")
    rc = cli_profile.main(["--drafter", "lookup", "--drafter", "suffix"])
    assert rc == 2 and "one --drafter" in capsys.readouterr().err
