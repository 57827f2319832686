"""The drafter-aware tau factor: the cost model replays the other drafters a context offers, the
tau factor compares the plan against the best one's oracle, and the built-in explorer tries that
drafter first (``drafter_choice``, source "profile")."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specpilot.costmodel import Hardware, ProfileConfig, profile
from specpilot.costmodel import pipeline as pipeline_mod
from specpilot.drafters import make_drafter
from specpilot.drafters.base import DraftContext
from specpilot.engine import Engine, EngineConfig
from specpilot.mechanisms import get
from specpilot.mechanisms.base import Context
from specpilot.pilot.explorer import drafter_hint
from specpilot.plan import Plan
from specpilot.runtime import alternative_drafters
from specpilot.tree import DraftTree, TreeSpec

from .conftest import tiny_model

HW = Hardware("test machine", 1e11, 4e10, 5e10, "test")
PROMPTS = [("a", [3, 4, 5, 3, 4, 5, 3, 4]), ("b", [10, 20, 30, 10, 20, 30, 10])]
CTX = Context("llama", 1.0, "lookup", "cpu", "float32", threads=2, drafters=("lookup", "suffix"))


class NothingDrafter:
    """Never proposes a node: the plan's own oracle is plain decoding (tau 1)."""

    name = "nothing"
    hidden_layers: tuple[int, ...] = ()

    def begin(self, prompt: list[int]) -> None:
        pass

    def finish(self, tokens: list[int]) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.empty()


def _profile(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Any:
    # a flat 10 ms verify at every width: drafting pays wherever a node is accepted (the tiny
    # model's own verify times make N* a coin toss between 0 and a few nodes)
    monkeypatch.setattr(pipeline_mod, "time_verify", lambda *a, **k: 0.010)
    eng = Engine(tiny_model("llama", seed=1), EngineConfig(attention="exact"))
    cfg = ProfileConfig(max_new_tokens=24, max_budget=16, verify_repeats=2, draft_samples=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile(eng, PROMPTS, NothingDrafter, TreeSpec(budget=8), cfg, hardware=HW, **kw)
    finally:
        torch.set_num_threads(threads)


def test_a_better_drafter_shows_up_as_a_tau_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    alone = _profile(monkeypatch)
    assert alone.tau_actual == 1.0 and alone.tau_factor == 1.0
    assert [(p.drafter, p.alternative) for p in alone.tau_drafters] == [("nothing", False)]
    assert alone.tau_drafter == "nothing"

    r = _profile(monkeypatch, alternatives={"lookup": lambda: make_drafter("lookup")})
    plan, lookup = r.tau_drafters
    assert (plan.drafter, plan.alternative, lookup.drafter, lookup.alternative) == (
        "nothing", False, "lookup", True,
    )  # fmt: skip
    assert plan.tau_opt == 1.0 and lookup.tau_opt > 1.0  # the tiny prompts repeat: lookup hits
    assert r.tau_drafter == "lookup" and lookup.throughput > plan.throughput
    assert r.tau_factor == pytest.approx(lookup.tau_opt / r.tau_actual) and r.tau_factor > 1.0
    assert r.n_star == plan.n  # N* stays the plan's own budget
    assert "replay_drafters" in r.phases_s
    d = r.to_json()
    assert d["tau_drafter"] == "lookup"
    assert [p["drafter"] for p in d["tau_drafters"]] == ["nothing", "lookup"]
    assert d["tau_drafters"][1]["alternative"] is True


def test_plain_decoding_replays_no_alternative() -> None:
    eng = Engine(tiny_model("llama", seed=1), EngineConfig(attention="exact"))
    cfg = ProfileConfig(max_new_tokens=8, max_budget=16, verify_repeats=2, draft_samples=8)
    r = profile(eng, PROMPTS, lambda: None, None, cfg, hardware=HW,
                alternatives={"lookup": lambda: make_drafter("lookup")})  # fmt: skip
    assert r.tau_factor == 1.0 and r.tau_drafters == () and r.tau_drafter == ""


def _report(name: str, alternative: bool = True) -> dict[str, Any]:
    return {
        "tau_drafter": name,
        "tau_drafters": [
            {"drafter": "lookup", "n": 4, "tau_opt": 1.5, "throughput": 10.0,
             "alternative": False},
            {"drafter": name, "n": 8, "tau_opt": 2.5, "throughput": 20.0,
             "alternative": alternative},
        ],
    }  # fmt: skip


def test_the_explorer_tries_the_profile_drafter_first() -> None:
    plan = Plan(drafter="lookup")
    mechs = [get("drafter_choice")]
    (hint,) = drafter_hint(_report("suffix"), CTX, plan, mechs)
    assert (hint.mechanism, hint.params, hint.source) == ("drafter_choice", {"drafter": "suffix"},
                                                          "profile")  # fmt: skip
    assert get("drafter_choice").apply(plan, hint.params).drafter == "suffix"
    # nothing to hint: the plan's own drafter won, a drafter this context cannot build, the
    # plan already drafts with it, drafter_choice not in this direction, no report
    assert drafter_hint(_report("suffix", alternative=False), CTX, plan, mechs) == []
    assert drafter_hint(_report("head"), CTX, plan, mechs) == []
    assert drafter_hint(_report("suffix"), CTX, Plan(drafter="suffix"), mechs) == []
    assert drafter_hint(_report("suffix"), CTX, plan, [get("chain_length")]) == []
    assert drafter_hint(None, CTX, plan, mechs) == []


def test_alternative_drafters_are_the_contexts_others() -> None:
    loaded = SimpleNamespace(tokenizer=None, fingerprint=None)
    alts = alternative_drafters(loaded, "lookup")
    assert list(alts) == ["suffix"] and alts["suffix"]().name.startswith("suffix")
    assert list(alternative_drafters(loaded, "none")) == ["lookup", "suffix"]
