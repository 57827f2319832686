"""Recall: memory's best remembered winners stacked onto the start plan (pure function), and a
stacked trial records no per-mechanism effect."""

from __future__ import annotations

from pathlib import Path

from specpilot.mechanisms import get
from specpilot.mechanisms.base import Context, apply_checked
from specpilot.pilot.memory import Memory
from specpilot.pilot.recall import label, recall_steps
from specpilot.plan import Plan
from specpilot.tree import TreeSpec

CPU = Context("llama", 135.0, "suffix", "cpu", "float32", 1, 2)
OTHER = Context("qwen3", 7000.0, "lookup", "NVIDIA H200", "bfloat16", 8, 0)


def _result(speedup: float, spread: float = 0.02, status: str = "PASS") -> dict:
    forcing = {"status": "PASS", "n_prompts": 3, "n_tokens": 96, "summary": "PASS"}
    return {"status": status, "reason": "", "speedup": speedup, "spread": spread,
            "forcing": forcing}  # fmt: skip


def _apply(plan: Plan, mid: str, params: dict) -> Plan:
    return apply_checked(get(mid), CPU, plan, params)


def _memory(tmp_path: Path) -> Memory:
    mem = Memory(tmp_path / "m.sqlite")
    mem.add_mechanisms([get("chain_length"), get("linear_backend"), get("threads")])
    rec = mem.record_trial
    rec("a/1", "a", 0, "explore", CPU, [("chain_length", {"k": 8})], _result(1.30), "sample")
    rec("a/2", "a", 0, "explore", CPU, [("chain_length", {"k": 3})], _result(1.10), "sample")
    rec("a/3", "a", 0, "integrate", CPU, [("linear_backend", {"linear": "torch"})],
        _result(1.08), "full")  # fmt: skip
    rec("a/4", "a", 0, "explore", CPU, [("threads", {"threads": 1})], _result(0.7), "sample")
    rec("a/5", "a", 0, "explore", CPU, [("threads", {"threads": 2})], _result(1.5, 0.6), "sample")
    return mem


def test_recall_stacks_the_best_winner_of_each_mechanism(tmp_path: Path) -> None:
    mem = _memory(tmp_path)
    start = Plan(tree=TreeSpec(kind="chain", k=5))
    mechs = {m: get(m) for m in ("chain_length", "linear_backend", "threads")}
    steps = recall_steps(mem, mechs, CPU, start, _apply)
    # k=8 beats k=3; torch linears recalled; threads: 0.7x is no win and 1.5x +- 0.6 is within
    # its spread
    assert steps == [("linear_backend", {"linear": "torch"}), ("chain_length", {"k": 8})]
    assert label(steps) == "memory[linear_backend+chain_length]"
    mem.close()


def test_recall_skips_what_the_plan_already_has_and_weak_or_foreign_priors(tmp_path: Path) -> None:
    mem = _memory(tmp_path)
    mechs = {m: get(m) for m in ("chain_length", "linear_backend")}
    has_k8 = Plan(tree=TreeSpec(kind="chain", k=8))
    assert recall_steps(mem, mechs, CPU, has_k8, _apply) == [
        ("linear_backend", {"linear": "torch"})
    ]
    # far from every remembered context: similarity-weighted gains fall under the threshold
    assert recall_steps(mem, mechs, OTHER, has_k8, _apply, min_score=0.05) == []
    mem.close()


def test_a_stacked_trial_records_no_effect(tmp_path: Path) -> None:
    mem = Memory(tmp_path / "m.sqlite")
    mem.add_mechanisms([get("chain_length"), get("linear_backend")])
    steps = [("linear_backend", {"linear": "torch"}), ("chain_length", {"k": 8})]
    assert mem.record_trial("b/1", "b", 0, "recall", CPU, steps, _result(1.4), "full")
    assert mem.counts()["trials"] == 1 and mem.list_entries() == []
    mem.close()
