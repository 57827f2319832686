"""Workload loading: built-in sets, JSONL prompts files, every error path, and the holdout split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot.errors import ConfigError, WorkloadError
from specpilot.workloads import WORKLOADS, Prompt, load_workload, split_holdout


def _write(tmp_path: Path, lines: list[str], name: str = "p.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _rec(pid: str, prompt: str = "hello", **extra: object) -> str:
    return json.dumps({"id": pid, "prompt": prompt, **extra})


# --- built-in workloads ---------------------------------------------------------------------


def test_humaneval_has_164_unique_completion_prompts() -> None:
    prompts = load_workload("humaneval")
    assert len(prompts) == 164
    assert len({p.id for p in prompts}) == 164
    assert prompts[0].id == "HumanEval/0"
    assert prompts[-1].id == "HumanEval/163"
    assert all(not p.chat for p in prompts)
    assert "def has_close_elements" in prompts[0].text


def test_chat_workload() -> None:
    prompts = load_workload("chat")
    assert len(prompts) >= 48
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.chat for p in prompts)
    assert [p.id for p in prompts] == [f"chat-{i:03d}" for i in range(len(prompts))]
    assert all(len(p.text) > 40 for p in prompts)
    assert len({p.text for p in prompts}) == len(prompts)


def test_workloads_table_names_every_builtin() -> None:
    assert set(WORKLOADS) == {"humaneval", "chat"}
    for name in WORKLOADS:
        assert load_workload(name, limit=1)


def test_limit_takes_the_first_n() -> None:
    full = load_workload("humaneval")
    assert load_workload("humaneval", limit=5) == full[:5]
    assert load_workload("humaneval", limit=1000) == full


@pytest.mark.parametrize("limit", [0, -3])
def test_limit_below_one_is_rejected(limit: int) -> None:
    with pytest.raises(WorkloadError, match="limit must be an integer >= 1"):
        load_workload("chat", limit=limit)


def test_unknown_workload_lists_valid_names() -> None:
    with pytest.raises(WorkloadError, match="unknown workload 'mbpp'") as e:
        load_workload("mbpp")
    assert "humaneval" in str(e.value) and "chat" in str(e.value)


def test_both_name_and_file_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, [_rec("a")])
    with pytest.raises(WorkloadError, match="exactly one"):
        load_workload("chat", prompts_file=path)


def test_neither_name_nor_file_rejected() -> None:
    with pytest.raises(WorkloadError, match="exactly one"):
        load_workload()


# --- prompts files ----------------------------------------------------------------------------


def test_prompts_file_roundtrip(tmp_path: Path) -> None:
    path = _write(tmp_path, [_rec("a", "first"), "", _rec("b", "second", chat=True)])
    prompts = load_workload(prompts_file=str(path))
    assert prompts == [Prompt("a", "first", False), Prompt("b", "second", True)]
    assert load_workload(prompts_file=path, limit=1) == [Prompt("a", "first", False)]


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(WorkloadError, match="not found") as e:
        load_workload(prompts_file=missing)
    assert str(missing) in str(e.value)


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="not a regular file"):
        load_workload(prompts_file=tmp_path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(WorkloadError, match="empty") as e:
        load_workload(prompts_file=path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"id": "x", "prompt": ', "not valid JSON"),
        ('["x", "hello"]', "expected a JSON object"),
        ('{"id": "x"}', 'missing "prompt"'),
        ('{"prompt": "hello"}', 'missing "id"'),
        ('{"id": 7, "prompt": "hello"}', '"id" must be a string, got int'),
        ('{"id": "x", "prompt": ["hello"]}', '"prompt" must be a string, got list'),
        ('{"id": "x", "prompt": "   "}', '"prompt" is empty'),
        ('{"id": "x", "prompt": "hello", "chat": "yes"}', '"chat" must be true or false'),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = _write(tmp_path, [_rec("a"), "", bad_line, _rec("z")])
    with pytest.raises(WorkloadError) as e:
        load_workload(prompts_file=path)
    msg = str(e.value)
    assert f"{path}: line 3:" in msg
    assert message in msg


def test_duplicate_id_names_both_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, [_rec("a"), _rec("b"), _rec("a", "again")])
    with pytest.raises(WorkloadError) as e:
        load_workload(prompts_file=path)
    msg = str(e.value)
    assert f"{path}: line 3:" in msg
    assert "duplicate id 'a'" in msg and "line 1" in msg


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "caf\xe9"}\n')
    with pytest.raises(WorkloadError, match="not UTF-8"):
        load_workload(prompts_file=path)


# --- holdout split --------------------------------------------------------------------------


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", f"text {i}", False) for i in range(n)]


def test_split_is_disjoint_complete_and_ordered() -> None:
    prompts = _prompts(20)
    kept, held = split_holdout(prompts, 0.25, seed=1)
    assert len(held) == 5 and len(kept) == 15
    assert {p.id for p in kept}.isdisjoint({p.id for p in held})
    assert {p.id for p in kept} | {p.id for p in held} == {p.id for p in prompts}
    assert kept == sorted(kept, key=prompts.index)
    assert held == sorted(held, key=prompts.index)


def test_split_is_deterministic_and_depends_on_seed() -> None:
    prompts = _prompts(50)
    assert split_holdout(prompts, 0.2, seed=3) == split_holdout(prompts, 0.2, seed=3)
    held_by_seed = {tuple(p.id for p in split_holdout(prompts, 0.2, seed=s)[1]) for s in range(5)}
    assert len(held_by_seed) > 1


def test_split_keeps_both_sides_non_empty() -> None:
    kept, held = split_holdout(_prompts(3), 0.01, seed=0)
    assert len(held) == 1 and len(kept) == 2
    kept, held = split_holdout(_prompts(3), 0.99, seed=0)
    assert len(held) == 2 and len(kept) == 1


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_rejects_bad_fraction(fraction: float) -> None:
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        split_holdout(_prompts(10), fraction, seed=0)


def test_split_rejects_too_few_or_duplicate_prompts() -> None:
    with pytest.raises(WorkloadError, match="at least 2"):
        split_holdout(_prompts(1), 0.5, seed=0)
    dup = [Prompt("a", "x", False), Prompt("a", "y", False)]
    with pytest.raises(WorkloadError, match="unique"):
        split_holdout(dup, 0.5, seed=0)
