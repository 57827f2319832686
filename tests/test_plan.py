"""Plans: JSON round trip, validation of bad files, atomic save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot.engine import EngineConfig
from specpilot.errors import ConfigError
from specpilot.mechanisms.base import Param
from specpilot.plan import AppliedMechanism, Plan, load_plan, save_plan
from specpilot.tree import TreeSpec


def test_round_trip(tmp_path: Path) -> None:
    plan = Plan(
        drafter="lookup",
        drafter_options={"min_n": 2},
        tree=TreeSpec(kind="static", paths=((0,), (1,), (0, 0))),
        engine=EngineConfig(threads=2),
        options={"adaptive": {"threshold": 0.3}},
        mechanisms=(AppliedMechanism("static_tree", {"paths": "0;1;0.0"}),),
    )
    path = save_plan(plan, tmp_path / "run" / "plan.json")
    assert load_plan(path) == plan
    assert load_plan(path.parent) == plan  # a run directory reads DIR/plan.json
    assert plan.describe() == "lookup/static 3 nodes"
    assert [p.name for p in tmp_path.joinpath("run").iterdir()] == ["plan.json"]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "expected a JSON object"),
        ({"drafter": "suffix", "speed": 2}, "unknown key"),
        ({"version": 9}, "plan version"),
        ({"tree": {"kind": "chain", "k": 0}}, "k must be a positive"),
        ({"tree": {"width": 3}}, "unknown key"),
        ({"engine": {"dtype": "int4"}}, "engine: 'dtype' must be one of"),  # the field, no flag
        ({"engine": {"threads": -4}}, "engine: 'threads' must be positive"),
        ({"tree": {"kind": "chain", "k": "five"}}, "'k' must be an integer, got 'five'"),
        ({"tree": {"kind": "static", "paths": "0;1"}}, "'paths' must be a list"),
        ({"mechanisms": [{"params": {}}]}, "string 'id'"),
        ({"drafter": ""}, "non-empty"),
    ],
)
def test_bad_plans_are_rejected(tmp_path: Path, doc: object, message: str) -> None:
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=message):
        load_plan(p)


def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no plan file"):
        load_plan(tmp_path / "nope.json")
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON plan"):
        load_plan(tmp_path)


def test_param_checks() -> None:
    k = Param("k", "int", 5, low=1, high=16)
    assert k.check("7") == 7
    with pytest.raises(ConfigError, match="outside"):
        k.check(17)
    c = Param("attention", "categorical", "exact", choices=("exact", "sdpa"))
    with pytest.raises(ConfigError, match="not in"):
        c.check("flash")
    with pytest.raises(ConfigError, match="low <= high"):
        Param("x", "float", 1.0, low=2.0, high=1.0)
