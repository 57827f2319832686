"""Kernel variants as loop mechanisms: ``kernel_tiling`` keeps the numerics contract (every
tiling decodes the same tokens), a planted order-breaking variant (4 accumulator lanes instead of
8) fails token forcing in the pilot's trial path and is rejected before timing, and
``attention_impl`` offers no sdpa on CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from specpilot import kernels
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError
from specpilot.forcing import Reference
from specpilot.kernels import int8
from specpilot.kernels.linear import COL_TILES, ROW_TILES, set_schedule
from specpilot.loading import load_model
from specpilot.mechanisms import get
from specpilot.mechanisms.base import Context, apply_checked
from specpilot.pilot.executors import LocalExecutor
from specpilot.pilot.reference import ar_decoder
from specpilot.pilot.trial import (
    MISMATCH,
    PASS,
    ChildSpec,
    PromptCase,
    TrialJob,
    TrialLimits,
    TrialResult,
)
from specpilot.plan import Plan
from specpilot.runtime import build, context_of
from specpilot.tree import TreeSpec

from .kernel_planted import four_lanes
from .test_kernels import native_gguf  # noqa: F401

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")

REPO = str(Path(__file__).resolve().parents[1])
NATIVE = Context("llama", 1.0, "suffix", "cpu", "float32", threads=2, weights="native",
                 isa="avx2", vocab_size=256)  # fmt: skip
FP32 = dataclasses.replace(NATIVE, weights="fp32")
GPU = dataclasses.replace(NATIVE, device="NVIDIA H200", dtype="bfloat16", threads=0)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 4, 9, 11, 1, 2, 3], [42, 17, 42]]
MAX_NEW = 20
TIE = (3, 4)
"""The two token ids whose LM-head rows are made a near-tie at the first generated token."""


def _lm_input(model: Any, prompt: list[int]) -> torch.Tensor:
    """The LM head's input row of the prompt's last position (plain decoding's first step)."""
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(a[0].detach()))
    try:
        Engine(model, EngineConfig()).generate(prompt, GenerationConfig(1, stop_on_eos=False))
    finally:
        hook.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])[-1:].clone()


def _f32_blocks(w: torch.Tensor) -> torch.Tensor:
    return w.contiguous().view(torch.uint8).reshape(-1).clone()


def _near_tie_head(h8: torch.Tensor, h4: torch.Tensor, vocab: int, seed: int) -> torch.Tensor:
    """An LM head whose rows TIE lead by far and are ordered one way by the contract's kernel on
    ``h8`` and the other way by the 4-lane kernel on ``h4`` (found by search; rows are per
    output element, so two rows decide it)."""
    g = torch.Generator().manual_seed(seed)
    dim = h8.shape[1]
    head = torch.randn(vocab, dim, generator=g) * 0.02
    a = h8[0] / h8[0].norm() * 4.0
    f32 = kernels.QTYPES["F32"]
    for _ in range(4000):
        b = a + torch.randn(dim, generator=g) * 2e-7
        pair = torch.stack([a, b])
        blocks = _f32_blocks(pair)
        y8 = kernels.gguf_matmul(h8, blocks, f32, 2, dim)[0]
        y4 = kernels.gguf_matmul_reference(h4, blocks, f32, 2, dim, lanes=4)[0]
        if int(torch.argmax(y8)) != int(torch.argmax(y4)):
            head[TIE[0]], head[TIE[1]] = a, b
            return head
    raise AssertionError("no near-tie found: the 4-lane kernel never flipped the pair")


@pytest.fixture(scope="module")
def tie_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF (F32 blocks, untied head) whose first generated token for PROMPTS[0]
    is a near-tie that the contract's 8-lane order and the planted 4-lane order break apart."""
    from .conftest import tiny_model
    from .test_loading import VOCAB, write_gguf

    tmp = tmp_path_factory.mktemp("kernel_mech")
    src = tiny_model("llama", seed=7, std=0.12, vocab=VOCAB, dim=64, intermediate_size=128,
                     tie_embeddings=False)  # fmt: skip
    draft_path = tmp / "draft.gguf"
    write_gguf(draft_path, src)
    cache = tmp / "cache"
    h8 = _lm_input(load_model(str(draft_path), cache_dir=cache, weights="native").model,
                   PROMPTS[0])  # fmt: skip
    lanes4 = load_model(str(draft_path), cache_dir=cache, weights="native").model
    assert four_lanes(lanes4) > 0
    h4 = _lm_input(lanes4, PROMPTS[0])
    src.lm_head.weight.copy_(_near_tie_head(h8, h4, VOCAB, seed=3))
    path = tmp / "tie.gguf"
    write_gguf(path, src)
    return path


def _native(path: Path) -> Any:
    return load_model(str(path), cache_dir=path.parent / "cache", weights="native")


def _first_tokens(model: Any) -> list[int]:
    eng = Engine(model, EngineConfig())
    gen = GenerationConfig(MAX_NEW, stop_on_eos=False)
    return [eng.generate(p, gen).tokens[0] for p in PROMPTS]


def test_the_planted_variant_flips_the_near_tie(tie_gguf: Path) -> None:
    """The precondition of the trial test: 4 lanes really change a token here."""
    ref = _first_tokens(_native(tie_gguf).model)
    planted = _native(tie_gguf).model
    four_lanes(planted)
    got = _first_tokens(planted)
    assert ref[0] in TIE and got[0] in TIE and got[0] != ref[0]


# -- kernel_tiling -----------------------------------------------------------------------------


def test_kernel_tiling_applies_to_native_weights_only() -> None:
    mech = get("kernel_tiling")
    assert mech.applicable(NATIVE, Plan()) is None
    assert "--weights native" in (mech.applicable(FP32, Plan()) or "")
    assert "GPU" in (mech.applicable(GPU, Plan()) or "")
    legacy = Context("llama", 1.0, "suffix", "cpu", "float32", threads=2)  # weights unknown
    assert mech.applicable(legacy, Plan()) is not None


def test_kernel_tiling_space_options_round_trip() -> None:
    mech = get("kernel_tiling")
    space = {p.name: p for p in mech.space(NATIVE, Plan())}
    assert space["multi_row_tile"].choices == ROW_TILES and space["multi_row_tile"].default == 4
    assert space["single_col_tile"].choices == COL_TILES and space["single_col_tile"].default == 4
    plan = apply_checked(mech, NATIVE, Plan(), {"single_col_tile": 2, "multi_row_tile": 8,
                                                "multi_col_tile": 1})  # fmt: skip
    assert plan.options["kernel_tiling"] == {"single": [1, 2], "multi": [8, 1]}
    again = Plan.from_json(plan.to_json())
    assert again == plan
    opts = mech.parse_options(again.options["kernel_tiling"])
    assert (opts.single, opts.multi) == ((1, 2), (8, 1))
    assert {p.name: p.default for p in mech.space(NATIVE, plan)} == {
        "single_col_tile": 2, "multi_row_tile": 8, "multi_col_tile": 1}  # fmt: skip
    bad_options = [
        ({"multi": [5, 2]}, "row tile"),
        ({"single": [1, 8]}, "column tile"),
        ({"multi": 4}, r"\[row tile, column tile\]"),
        ({"rows": 4}, "unknown"),
    ]
    for bad, match in bad_options:
        with pytest.raises(ConfigError, match=match):
            mech.parse_options(bad)


def test_gguf_linear_schedule_setter_keeps_the_bits() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g)
    lin = kernels.GGUFLinear(_f32_blocks(w), kernels.QTYPES["F32"], 40, 64)
    xs = [torch.randn(m, 64, generator=g) for m in (1, 7, 16)]
    ref = [lin(x) for x in xs]
    for rt in ROW_TILES:
        for ct in COL_TILES:
            lin.set_schedule((1, ct), (rt, ct))
            assert lin.tiles == ((1, ct), (rt, ct))
            assert all(torch.equal(lin(x), r) for x, r in zip(xs, ref, strict=True))
    with pytest.raises(ValueError, match="row tile"):
        lin.set_schedule((5, 1), (1, 1))
    with pytest.raises(ValueError, match="column tile"):
        lin.set_schedule((1, 1), (1, 8))


def test_every_tiling_decodes_the_same_tokens(tie_gguf: Path) -> None:
    """Through runtime.build: the configure hook sets every native linear, and plain and
    speculative decoding give the reference tokens for every corner of the space."""
    base = Plan(tree=TreeSpec(kind="dynamic", budget=10, topk=3, depth=5))
    lm = _native(tie_gguf)
    ctx = context_of(lm, base, 1)
    assert ctx.weights == "native" and ctx.vocab_size == lm.cfg.vocab_size
    gen = GenerationConfig(MAX_NEW, stop_on_eos=False)
    ref = [Engine(lm.model, EngineConfig()).generate(p, gen).tokens for p in PROMPTS]
    mech = get("kernel_tiling")
    for params in ({"single_col_tile": 1, "multi_row_tile": 1, "multi_col_tile": 1},
                   {"single_col_tile": 2, "multi_row_tile": 8, "multi_col_tile": 4},
                   {"single_col_tile": 4, "multi_row_tile": 2, "multi_col_tile": 2}):  # fmt: skip
        plan = apply_checked(mech, ctx, base, params)
        built = build(plan, lm)
        tiles = {m.tiles for m in lm.model.modules() if isinstance(m, kernels.GGUFLinear)}
        opts = plan.options["kernel_tiling"]
        assert tiles == {(tuple(opts["single"]), tuple(opts["multi"]))}
        for p, want in zip(PROMPTS, ref, strict=True):
            plain = built.engine.generate(p, gen).tokens
            spec = built.engine.generate(p, gen, drafter=built.make_drafter(), spec=built.spec)
            assert plain == want and spec.tokens == want, (params, p)
    set_schedule(lm.model)  # back to the op's defaults


def test_kernel_tiling_refuses_an_fp32_model() -> None:
    from .runtime_helpers import loaded

    plan = Plan(options={"kernel_tiling": {"single": [1, 4], "multi": [4, 2]}})
    with pytest.raises(ConfigError, match="no native GGUF linears"):
        build(plan, loaded())


# -- kernel_prefetch ---------------------------------------------------------------------------


def test_kernel_prefetch_applies_to_the_int8_profile_on_native_weights_only() -> None:
    mech = get("kernel_prefetch")
    int8_plan = Plan(engine=EngineConfig(numerics="int8"))
    assert mech.applicable(NATIVE, int8_plan) is None
    assert "--numerics int8" in (mech.applicable(NATIVE, Plan()) or "")
    assert "--weights native" in (mech.applicable(FP32, int8_plan) or "")
    assert "GPU" in (mech.applicable(GPU, int8_plan) or "")


def test_kernel_prefetch_space_options_round_trip() -> None:
    mech = get("kernel_prefetch")
    base = Plan(engine=EngineConfig(numerics="int8"))
    (param,) = mech.space(NATIVE, base)
    assert param.name == "columns" and param.choices == int8.PREFETCH_COLUMNS
    assert param.default == 0
    plan = apply_checked(mech, NATIVE, base, {"columns": 32})
    assert plan.options["kernel_prefetch"] == {"columns": 32}
    again = Plan.from_json(plan.to_json())
    assert again == plan and mech.parse_options(again.options["kernel_prefetch"]).columns == 32
    assert mech.space(NATIVE, plan)[0].default == 32
    for bad, match in [({"columns": 5}, "columns must be one of"), ({"columns": "8"}, "columns"),
                       ({"rows": 4}, "unknown"), (8, "JSON object")]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            mech.parse_options(bad)


def test_every_prefetch_distance_decodes_the_same_tokens(native_gguf) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Through runtime.build in the int8 profile (Q4_1 and Q8_0 weights): the configure hook
    sets the GEMMs' distance, and plain and speculative decoding give the reference tokens."""
    path, cache_dir = native_gguf
    lm = load_model(str(path), cache_dir=cache_dir, weights="native")
    base = Plan(drafter="suffix", tree=TreeSpec(kind="dynamic", budget=10, topk=3, depth=5),
                engine=EngineConfig(numerics="int8"))  # fmt: skip
    gen = GenerationConfig(MAX_NEW, stop_on_eos=False)
    ref = [Engine(lm.model, base.engine).generate(p, gen).tokens for p in PROMPTS]
    ctx = context_of(lm, base, 1)
    mech = get("kernel_prefetch")
    before = int8.prefetch()
    try:
        for columns in int8.PREFETCH_COLUMNS[::-1]:
            built = build(apply_checked(mech, ctx, base, {"columns": columns}), lm)
            assert int8.prefetch() == columns
            for p, want in zip(PROMPTS, ref, strict=True):
                plain = built.engine.generate(p, gen).tokens
                spec = built.engine.generate(p, gen, drafter=built.make_drafter(), spec=built.spec)
                assert plain == want and spec.tokens == want, (columns, p)
    finally:
        int8.set_prefetch(before)


# -- the planted order-breaking variant through the trial path ---------------------------------


def _job(key: str, path: Path, steps: tuple, cases: tuple[PromptCase, ...], timed: bool,
         work: Path) -> TrialJob:  # fmt: skip
    plan = Plan().to_json()
    mods = ("tests.kernel_planted_child",)
    cand = ChildSpec(str(path), plan, steps, mods, (REPO,), weights="native")
    base = ChildSpec(str(path), plan, (), mods, (REPO,), weights="native") if timed else None
    return TrialJob(key, cand, base, cases[:2], (cases[2:],) if timed else (), MAX_NEW,
                    stop_on_eos=False, limits=TrialLimits(threads=1, memory_bytes=6 << 30),
                    work_dir=str(work), warmup=tuple(cases[0].ids[:4]))  # fmt: skip


@pytest.fixture(scope="module")
def trials(tie_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrialResult]:
    """Reference from native plain decoding; the planted variant (with timing rounds queued
    behind forcing) and a contract-keeping tiling (forcing only) through a local pool."""
    work = tmp_path_factory.mktemp("kernel_trials")
    lm = _native(tie_gguf)
    dec = ar_decoder(lm, "cpu", MAX_NEW, False)
    cases = []
    for i, ids in enumerate(PROMPTS):
        toks, margins = dec(ids)
        cases.append(PromptCase(f"p{i}", tuple(ids), Reference(f"p{i}", tuple(toks),
                                                               tuple(margins))))  # fmt: skip
    tiling = ("kernel_tiling", {"single_col_tile": 1, "multi_row_tile": 8, "multi_col_tile": 1})
    jobs = [_job("lanes4", tie_gguf, (("kernel_lanes4", {}),), tuple(cases), True, work),
            _job("tiling", tie_gguf, (tiling,), tuple(cases), False, work)]  # fmt: skip
    ex = LocalExecutor(workers=2)
    try:
        futs = {j.key: ex.submit(j) for j in jobs}
        return {k: f.result() for k, f in futs.items()}
    finally:
        ex.shutdown()


def test_order_breaking_variant_fails_forcing_before_timing(trials: dict[str, TrialResult]) -> None:
    r = trials["lanes4"]
    assert r.status == MISMATCH, r.reason
    assert r.phase == "forcing" and r.speedup is None and r.spread is None and not r.round_ratios
    assert r.forcing["status"] == MISMATCH and "diverge" in r.reason


def test_contract_keeping_tiling_passes_forcing(trials: dict[str, TrialResult]) -> None:
    r = trials["tiling"]
    assert r.status == PASS, r.reason
    assert r.forcing["status"] == PASS and r.forcing["n_prompts"] == 2
    assert r.plan is not None and r.plan["options"]["kernel_tiling"] == {
        "single": [1, 1], "multi": [8, 1]}  # fmt: skip


# -- attention_impl ----------------------------------------------------------------------------


def test_sdpa_is_no_candidate_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    mech = get("attention_impl")
    (cpu,) = mech.space(NATIVE, Plan())
    assert "sdpa" not in cpu.choices and "exact" in cpu.choices
    (gpu,) = mech.space(GPU, Plan(engine=EngineConfig(device="cpu")))
    assert "sdpa" in gpu.choices
    with pytest.raises(ConfigError, match="not in"):
        apply_checked(mech, NATIVE, Plan(), {"attention": "sdpa"})
    sdpa_plan = Plan(engine=EngineConfig(attention="sdpa"))
    assert mech.applicable(NATIVE, sdpa_plan) is None  # it may move a CPU plan off sdpa
    assert mech.space(NATIVE, sdpa_plan)[0].default != "sdpa"
    monkeypatch.setattr(kernels, "available", lambda: False)  # only exact left on CPU
    exact = Plan(engine=EngineConfig(attention="exact"))
    reason = mech.applicable(NATIVE, exact) or ""
    assert "outside the contract" in reason and "exact" in reason
    assert mech.applicable(GPU, exact) is None


def test_planted_lane_width_differs_in_bits_only() -> None:
    """What the planted variant computes: the same values within fp32 tolerance, other bits."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 256, generator=g), torch.randn(5, 256, generator=g)
    blocks, f32 = _f32_blocks(w), kernels.QTYPES["F32"]
    y8 = kernels.gguf_matmul(x, blocks, f32, 64, 256)
    y4 = kernels.gguf_matmul_reference(x, blocks, f32, 64, 256, lanes=4)
    assert torch.allclose(y8, y4, atol=1e-4) and not torch.equal(y8, y4)
    exact = x.double() @ w.double().T
    np.testing.assert_allclose(y4.double().numpy(), exact.numpy(), atol=1e-4)


# -- optimize runs the target (and every trial child) in one weights mode ------------------------


def test_optimize_weights_reach_the_trial_children(tmp_path: Path) -> None:
    from specpilot.pilot.config import OptimizeConfig
    from specpilot.pilot.coordinator import Coordinator

    cfg = OptimizeConfig(out=str(tmp_path / "run"), weights="native")
    assert OptimizeConfig.from_json(cfg.to_json()) == cfg
    old = cfg.to_json()
    del old["weights"]  # a run journaled before the field existed resumes with the default
    assert OptimizeConfig.from_json(old).weights == "auto"
    with pytest.raises(ConfigError, match="--weights must be one of"):
        OptimizeConfig(out=str(tmp_path / "bad"), weights="int4")
    coord = Coordinator(cfg)
    coord.builtin = SimpleNamespace(child_extras=lambda plan, steps: ((), (), ""))
    assert coord.spec(Plan().to_json()).weights == "native"
