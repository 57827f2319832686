"""Mechanisms: registry, typed spaces (Optuna), apply -> valid JSON plans, applicability reasons,
and decoding with each applied mechanism equal to plain AR output (or left to forcing)."""

from __future__ import annotations

import doctest
import random
from typing import Any

import pytest
import torch

from specpilot.drafters import adaptive, hybrid
from specpilot.errors import ConfigError
from specpilot.mechanisms import FACTORS, all_mechanisms, by_factor, get
from specpilot.mechanisms import static_tree as static_tree_mod
from specpilot.mechanisms.base import (
    Context,
    Mechanism,
    Param,
    apply_checked,
    check_params,
    optuna_space,
)
from specpilot.plan import Plan
from specpilot.runtime import build, context_of, plan_options
from specpilot.tree import TreeSpec

from .runtime_helpers import GEN, PROMPTS, loaded, references

CPU = Context("llama", 1.0, "suffix", "cpu", "float32", threads=2, drafters=("lookup", "suffix"))
CPU_MODEL = Context(
    "llama", 1.0, "model", "cpu", "float32", threads=2, drafters=("lookup", "suffix", "model")
)
GPU = Context("llama", 1.0, "suffix", "NVIDIA H200", "bfloat16", threads=0)
BASES = {
    "suffix/chain": Plan(),
    "lookup/dynamic": Plan(drafter="lookup", tree=TreeSpec(kind="dynamic", budget=8, topk=2)),
    "model/static": Plan(drafter="model", tree=TreeSpec(kind="static", paths=((0,), (1,)))),
}
GPU_ONLY = {"gpu_dtype", "cuda_graphs"}
LOSSY_ALLOWED = {"attention_impl"}
"""May change outputs by design; token forcing, not this test, decides whether a plan keeps it."""


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """One torch thread: these tests run many tiny forwards, which 2 threads only slow down
    on a busy machine (thread hand-offs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sample(p: Param, rng: random.Random) -> Any:
    if p.kind == "bool":
        return rng.random() < 0.5
    if p.kind == "categorical":
        return rng.choice(p.choices)
    assert p.low is not None and p.high is not None
    if p.kind == "int":
        return rng.randint(int(p.low), int(p.high))
    return rng.uniform(p.low, p.high)


def test_registry() -> None:
    mechs = all_mechanisms()
    ids = [m.id for m in mechs]
    assert len(ids) >= 12 and len(set(ids)) == len(ids)
    assert {m.factor for m in mechs} == set(FACTORS)
    for m in mechs:
        assert isinstance(m, Mechanism) and m.description and get(m.id) is m
        assert m in by_factor(m.factor)
    with pytest.raises(ConfigError, match="unknown mechanism 'warp_drive'"):
        get("warp_drive")
    with pytest.raises(ConfigError, match="factor must be"):
        by_factor("speed")


@pytest.mark.parametrize("mech", all_mechanisms(), ids=lambda m: m.id)
@pytest.mark.parametrize("base", list(BASES))
def test_space_and_apply_round_trip(mech: Mechanism, base: str) -> None:
    plan = BASES[base]
    ctx = CPU_MODEL if plan.drafter == "model" else CPU
    reason = mech.applicable(ctx, plan)
    if reason is not None:
        assert isinstance(reason, str) and reason
        with pytest.raises(ConfigError, match="does not apply"):
            apply_checked(mech, ctx, plan)
        return
    space = mech.space(ctx, plan)
    assert space and len({p.name for p in space}) == len(space)
    dists = optuna_space(space)
    for p in space:
        assert p.check(p.default) == p.default
        assert dists[p.name]._contains(dists[p.name].to_internal_repr(p.default))
    rng = random.Random(hash((mech.id, base)) & 0xFFFF)
    for trial in range(8):
        params = {p.name: (p.default if trial == 0 else _sample(p, rng)) for p in space}
        out = apply_checked(mech, ctx, plan, params)
        assert out.mechanisms[-1].id == mech.id
        again = Plan.from_json(out.to_json())
        assert again == out
        plan_options(again)  # every runtime option parses


@pytest.mark.parametrize("mech", all_mechanisms(), ids=lambda m: m.id)
def test_gpu_context(mech: Mechanism) -> None:
    """On a GPU context the GPU-only mechanisms apply (their apply needs a CUDA plan, see
    test_gpu.py); the CPU-only ones give their reason."""
    reason = mech.applicable(GPU, Plan())
    if mech.id in ("threads", "linear_backend", "draft_vocab"):
        assert reason
    if mech.id == "gpu_dtype":
        assert reason is None
    assert mech.applicable(CPU, Plan()) is None or mech.id not in (
        "chain_length",
        "static_tree",
        "dynamic_tree",
        "static_buffers",
        "device_accept",
    )


def test_applicability_reasons() -> None:
    ar = Plan(drafter="none")
    for mid in ("chain_length", "static_tree", "dynamic_tree", "adaptive_draft", "hybrid_drafting"):
        assert "without a drafter" in (get(mid).applicable(CPU, ar) or "")
    assert "CUDA" in (get("cuda_graphs").applicable(CPU, Plan()) or "")
    assert "GPU" in (get("gpu_dtype").applicable(CPU, Plan()) or "")
    assert "not lookup" in (get("lookup_ngram").applicable(CPU, Plan()) or "")
    assert "no draft model" in (get("draft_vocab").applicable(CPU, Plan()) or "")
    one = Context("llama", 1.0, "suffix", "cpu", "float32", threads=1, drafters=("suffix",))
    assert "one CPU thread" in (get("threads").applicable(one, Plan()) or "")
    assert "only one drafter" in (get("drafter_choice").applicable(one, Plan()) or "")


def test_bad_params() -> None:
    chain = get("chain_length")
    with pytest.raises(ConfigError, match="outside"):
        apply_checked(chain, CPU, Plan(), {"k": 99})
    with pytest.raises(ConfigError, match="unknown param"):
        apply_checked(chain, CPU, Plan(), {"length": 3})
    with pytest.raises(ConfigError, match="not in"):
        apply_checked(get("attention_impl"), CPU, Plan(), {"attention": "flash"})
    assert check_params(chain.space(CPU, Plan()), {}, "x") == {"k": 5}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"warp_drive": {}}, "unknown mechanism"),
        ({"chain_length": {"k": 3}}, "keeps no runtime options"),
        ({"adaptive_draft": {"threshold": 2.0}}, "threshold"),
        ({"adaptive_draft": {"threshold": 0.2, "depth": 2}}, "unknown key"),
        ({"hybrid_drafting": {"fallback": "oracle"}}, "fallback"),
        ({"batch_budget": {"one": 4}}, "not an integer"),
        ({"batch_budget": {"1": 0}}, "budget >= 1"),
        ({"compile_forward": {"scope": "everything"}}, "scope"),
        ({"draft_vocab": {"keep": 1}}, "keep"),
    ],
)
def test_bad_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_options(Plan(options=options))


def test_static_tree_family_and_batch_table() -> None:
    paths = static_tree_mod.static_paths(3, 4, 2, 1)
    spec = TreeSpec(kind="static", paths=paths)  # validates closure
    assert spec.max_depth == 4 and spec.branching == 3 and len(paths) == 4 + 2 * 2 * 2
    bb = get("batch_budget")
    ctx4 = Context("llama", 1.0, "suffix", "cpu", "float32", batch_size=4, threads=2)
    p = apply_checked(bb, CPU, Plan(), {"budget": 4})
    p = apply_checked(bb, ctx4, p, {"batch_size": 4, "budget": 2})
    assert p.options["batch_budget"] == {"1": 4, "4": 2}


def test_drafter_choice_drops_stale_options() -> None:
    plan = Plan(
        drafter="lookup",
        drafter_options={"min_n": 2},
        options={"hybrid_drafting": {"fallback": "suffix", "min_nodes": 1}},
    )
    out = apply_checked(get("drafter_choice"), CPU, plan, {"drafter": "suffix"})
    assert out.drafter == "suffix" and out.drafter_options == {}
    assert "hybrid_drafting" not in out.options


def test_wrapper_doctests() -> None:
    for mod in (adaptive, hybrid, static_tree_mod):
        assert doctest.testmod(mod).failed == 0


# -- decoding with each mechanism applied --------------------------------------------------------


def _variants(mech: Mechanism, ctx: Context, plan: Plan) -> list[dict[str, Any]]:
    """Defaults plus one hand-picked variant per mechanism that exercises its runtime path."""
    extra: dict[str, dict[str, Any]] = {
        "chain_length": {"k": 9},
        "static_tree": {"width": 3, "depth": 5, "branch_depth": 2, "tail": 1},
        "dynamic_tree": {"budget": 12, "topk": 3, "depth": 6},
        "drafter_choice": {"drafter": "lookup"},
        "lookup_ngram": {"min_n": 2, "span": 2, "max_matches": 3, "discount": 0.7},
        "suffix_options": {"max_pattern": 4, "max_depth": 3, "max_corpus_tokens": 0},
        "hybrid_drafting": {
            "fallback": "model" if plan.drafter != "model" else "lookup",
            "min_nodes": 2,
        },
        "adaptive_draft": {"threshold": 0.6, "min_nodes": 0},
        "batch_budget": {"budget": 2},
        "threads": {"threads": 1},
        "linear_backend": {"linear": "torch"},
        "draft_vocab": {"keep": 300},
        "static_buffers": {"on": True},
        "device_accept": {"on": True},
    }
    return [{}, extra.get(mech.id, {})]


CASES = [
    (m, base)
    for m in all_mechanisms()
    if m.id not in GPU_ONLY | {"compile_forward"}
    for base in BASES
]


@pytest.fixture(scope="module")
def refs() -> list[list[int]]:
    return references()


@pytest.mark.parametrize(("mech", "base"), CASES, ids=[f"{m.id}-{b}" for m, b in CASES])
def test_decoding_with_mechanism(
    mech: Mechanism, base: str, refs: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = BASES[base]
    has_model = plan.drafter == "model" or mech.id in ("hybrid_drafting", "draft_vocab")
    ctx = CPU_MODEL if has_model else CPU
    if mech.applicable(ctx, plan) is not None:
        pytest.skip(f"{mech.id} does not apply to {base}")
    if mech.id == "draft_vocab" and plan.drafter != "model":
        plan = apply_checked(get("hybrid_drafting"), ctx, plan, {"fallback": "model"})
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # keep one thread
    variants = _variants(mech, ctx, plan)
    if plan.drafter == "model":  # the slowest drafter: the hand-picked variant only
        variants = variants[1:]
    for params in variants:
        applied = apply_checked(mech, ctx, plan, params)
        lm = loaded()
        draft = loaded(seed=8) if has_model else None
        built = build(applied, lm, draft=draft)
        drafter = built.make_drafter()
        outs = [
            built.engine.generate(p, GEN, drafter=drafter, spec=built.spec).tokens for p in PROMPTS
        ]
        if mech.id in LOSSY_ALLOWED:
            assert all(len(o) == GEN.max_new_tokens for o in outs)  # forcing decides
        else:
            assert outs == refs, f"{mech.id} {params} on {base} changed the output"


def test_context_of() -> None:
    lm = loaded()
    ctx = context_of(lm, Plan(), 2, drafters=("model",))
    assert ctx.device == "cpu" and ctx.batch_size == 2 and ctx.threads >= 1
    assert ctx.drafters == ("lookup", "suffix", "model")
    assert ctx.arch == "llama" and ctx.params_m > 0 and ctx.drafter_kind == "suffix"
    n = sum(p.numel() for p in lm.model.parameters()) / 1e6
    assert ctx.params_m == pytest.approx(n, rel=1e-3)
    with pytest.raises(ConfigError, match="batch size"):
        context_of(lm, Plan(), 0)


def test_context_offers_the_shipped_trained_drafter_of_its_target() -> None:
    """drafter_choice can pick the trained head only where one ships for this very target."""
    import json
    from dataclasses import replace

    from specpilot.drafters.trained import shipped_drafters

    shipped = shipped_drafters()
    assert shipped, "the package ships a head drafter"
    cfg = json.loads((shipped[0] / "config.json").read_text())
    lm = loaded()
    assert "head" not in context_of(lm, Plan(), 1).drafters
    ours = replace(lm, fingerprint=cfg["extra"]["target_fingerprint"])
    assert context_of(ours, Plan(), 1).drafters == ("lookup", "suffix", "head", "head+suffix")


def test_union_gate_on_a_trained_head_plus_suffix(tmp_path: Any, refs: list[list[int]]) -> None:
    """union_gate applies to X+suffix plans only; every corner of its space decodes losslessly
    through runtime.build."""
    from specpilot.drafters.feature_net import FeatureNet, FeatureNetConfig
    from specpilot.drafters.trained import save_drafter

    lm = loaded()
    c = lm.cfg
    cfg = FeatureNetConfig(
        kind="head", dim=c.dim, vocab_size=c.vocab_size, taps=(1, 2), n_heads=4, n_kv_heads=2,
        head_dim=12, intermediate_size=64, extra={"target_fingerprint": lm.fingerprint},
    )  # fmt: skip
    net = FeatureNet(cfg)
    net.init_weights(0, std=0.3)
    out = save_drafter(net, tmp_path / "head", {}, dtype=torch.float32)
    mech = get("union_gate")
    ctx = Context("llama", 1.0, "suffix", "cpu", "float32", threads=2, drafters=("suffix",))
    assert mech.applicable(ctx, Plan(drafter="suffix")) is not None
    plan = Plan(drafter=f"{out}+suffix")
    assert mech.applicable(ctx, plan) is None
    for params in (
        {},
        {"trust": 1, "trained_depth": 2, "min_prob": 0.3},
        {"trust": 8, "trained_depth": 1, "min_prob": 0.6},
    ):
        applied = apply_checked(mech, ctx, plan, params)
        built = build(applied, loaded())
        drafter = built.make_drafter()
        if params:
            assert drafter.trust == params["trust"]
        outs = [
            built.engine.generate(p, GEN, drafter=drafter, spec=built.spec).tokens for p in PROMPTS
        ]
        assert outs == refs


def test_threads_space_leaves_out_the_start_plans_own_count() -> None:
    """A plan with threads unset runs on all of them: "all" is not a new candidate then."""
    from specpilot.engine import EngineConfig

    (p,) = get("threads").space(CPU, Plan())
    assert (p.low, p.high) == (1, 1)
    (p,) = get("threads").space(CPU, Plan(engine=EngineConfig(threads=1)))
    assert (p.low, p.high, p.default) == (1, 2, 1)


def test_linear_backend_does_not_apply_to_native_weights_with_a_training_free_drafter() -> None:
    from dataclasses import replace

    native = replace(CPU, weights="native")
    reason = get("linear_backend").applicable(native, Plan(drafter="suffix"))
    if reason is not None and "oneDNN" in reason and "native" not in reason:
        pytest.skip(reason)
    assert "native kernels" in (reason or "")
    assert get("linear_backend").applicable(native, Plan(drafter="head")) is None
    assert get("linear_backend").applicable(CPU, Plan(drafter="suffix")) is None


def test_compile_forward_does_not_apply_to_native_weights() -> None:
    """The native step is custom ops Inductor cannot fuse; a plan asking for it on a native
    model fails to build with the reason (the loop measured 0.81x and a trace failure)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from specpilot.mechanisms.compile_forward import CompileOptions, compile_model

    reason = get("compile_forward").applicable(replace(CPU, weights="native"), Plan())
    assert reason is not None and "native GGUF kernels" in reason
    with pytest.raises(ConfigError, match=r"native GGUF kernels.*--weights fp32"):
        compile_model(SimpleNamespace(native=True, compiled=None), CompileOptions())
