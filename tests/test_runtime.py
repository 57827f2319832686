"""Plan runtime: default plan, build errors, budget caps, compile (slow)."""

from __future__ import annotations

import doctest
from typing import Any

import pytest
import torch

from specpilot import runtime
from specpilot.engine import EngineConfig
from specpilot.errors import ConfigError
from specpilot.mechanisms import get
from specpilot.mechanisms.base import Context, apply_checked
from specpilot.mechanisms.batch_budget import cap_spec
from specpilot.mechanisms.compile_forward import compiler_missing
from specpilot.plan import Plan
from specpilot.runtime import build, default_plan
from specpilot.tree import TreeSpec

from .runtime_helpers import GEN, PROMPTS, loaded, references


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_default_plan_is_bench_default() -> None:
    plan = default_plan(loaded())
    assert plan == Plan(drafter="suffix", tree=TreeSpec(kind="chain", k=5), engine=EngineConfig())
    assert plan.describe() == "suffix/chain k=5"


def test_build_ar_and_errors() -> None:
    built = build(Plan(drafter="none"), loaded())
    assert built.make_drafter() is None and built.candidate() is None
    assert [built.engine.generate(p, GEN).tokens for p in PROMPTS] == references()
    with pytest.raises(ConfigError, match="draft model"):
        build(Plan(drafter="model"), loaded())
    lm = loaded()
    build(Plan(), lm)  # prepacks for oneDNN
    with pytest.raises(ConfigError, match="prepacked"):
        build(Plan(engine=EngineConfig(linear="torch")), lm)
    with pytest.raises(ConfigError, match="neither one of"):
        build(Plan(drafter="oracle"), loaded())


def test_budget_table_caps_the_tree() -> None:
    plan = Plan(
        tree=TreeSpec(kind="dynamic", budget=16), options={"batch_budget": {"1": 12, "4": 3}}
    )
    assert build(plan, loaded()).spec.budget == 12
    assert build(plan, loaded(), batch_size=6).spec.budget == 3
    chain = cap_spec(TreeSpec(kind="chain", k=8), 2)
    assert chain == TreeSpec(kind="chain", k=2)
    assert cap_spec(chain, 5) is chain
    assert doctest.testmod(runtime).failed == 0


@pytest.mark.slow
@pytest.mark.skipif(compiler_missing(False) is not None, reason="no C compiler")
@pytest.mark.parametrize("linear", ["torch", "onednn"])
def test_compile_forward_decodes(linear: str) -> None:
    """Inductor-compiled blocks (tens of seconds to compile): lossless is for forcing to decide;
    on this tiny model it reproduces the eager output."""
    ctx = Context("llama", 0.1, "suffix", "cpu", "float32", threads=2)
    plan = apply_checked(get("compile_forward"), ctx, Plan(engine=EngineConfig(linear=linear)))
    lm = loaded()
    built = build(plan, lm)
    drafter = built.make_drafter()
    outs = [built.engine.generate(p, GEN, drafter=drafter, spec=built.spec).tokens for p in PROMPTS]
    assert outs == references()
    assert lm.model.compiled == ("layers", True)


def test_draft_vocab_cuts_the_draft_head() -> None:
    plan = Plan(drafter="model", options={"draft_vocab": {"keep": 100}})
    draft = loaded(seed=7)  # the target's weights: drafts inside the kept ids are accepted
    built = build(plan, loaded(), draft=draft)
    assert draft.model.lm_head(torch.zeros(1, draft.cfg.dim)).shape == (1, 100)
    drafter = built.make_drafter()
    runs = [built.engine.generate(p, GEN, drafter=drafter, spec=built.spec) for p in PROMPTS]
    assert [r.tokens for r in runs] == references()
    full = build(Plan(drafter="model"), loaded(), draft=loaded(seed=7))
    d2 = full.make_drafter()
    taus = [full.engine.generate(p, GEN, drafter=d2, spec=full.spec).tau for p in PROMPTS]
    assert sum(r.tau for r in runs) < sum(taus)  # ids >= 100 can no longer be drafted


@pytest.mark.parametrize("order", [("hybrid_drafting", "adaptive_draft"),
                                   ("adaptive_draft", "hybrid_drafting")])
def test_configure_hooks_run_in_registry_order(order: tuple[str, str]) -> None:
    """Every runtime option goes through its mechanism's configure hook, in registry order, so
    the drafter wrappers nest the same whatever order the plan file lists them in."""
    from specpilot.drafters.adaptive import ConfidenceDrafter
    from specpilot.drafters.hybrid import HybridDrafter
    from specpilot.mechanisms.base import RuntimeMechanism

    raw = {
        "hybrid_drafting": {"fallback": "lookup", "min_nodes": 1},
        "adaptive_draft": {"threshold": 0.2, "min_nodes": 1},
    }
    plan = Plan(drafter="suffix", options={k: raw[k] for k in order})
    d = build(plan, loaded()).make_drafter()
    assert isinstance(d, ConfidenceDrafter) and isinstance(d.inner, HybridDrafter)
    assert all(isinstance(get(k), RuntimeMechanism) for k in raw)
    assert not isinstance(get("chain_length"), RuntimeMechanism)
    with pytest.raises(ConfigError, match="keeps no runtime options"):
        build(Plan(options={"chain_length": {"k": 3}}), loaded())


def test_cuda_defaults_to_fixed_width_chains(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a chain plan gets fixed-width steps in CUDA graphs (lossless by construction with
    stock kernels); trees, explicit widths and CPU plans are left as they are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = EngineConfig(device="cuda", dtype="bfloat16")
    chains = [TreeSpec(kind="chain", k=5), TreeSpec(kind="chain", k=3)]
    got = runtime.lossless_gpu_engine(cuda, chains)
    assert (got.fixed_width, got.cuda_graphs) == (6, True)
    assert runtime.lossless_gpu_engine(cuda, [TreeSpec(kind="dynamic")]) == cuda
    explicit = EngineConfig(device="cuda", fixed_width=8)
    assert runtime.lossless_gpu_engine(explicit, chains) == explicit
    assert runtime.lossless_gpu_engine(EngineConfig(), chains) == EngineConfig()
    assert runtime.gpu_lossless_note(cuda, True) is not None
    assert runtime.gpu_lossless_note(got, True) is None
    assert runtime.gpu_lossless_note(cuda, False) is None  # plain decoding only
    plan = Plan(tree=chains[0], engine=got)
    assert Plan.from_json(plan.to_json()) == plan  # the width travels in plan files


def test_a_tree_plan_under_fixed_widths_fails_at_build() -> None:
    plan = Plan(tree=TreeSpec(kind="dynamic", budget=6), engine=EngineConfig(fixed_width=8))
    with pytest.raises(ConfigError, match="chains only"):
        build(plan, loaded())
    build(Plan(tree=TreeSpec(kind="chain", k=5), engine=EngineConfig(fixed_width=6)), loaded())
