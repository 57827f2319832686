"""Defaults shared by the command line and the library, in a module that imports nothing heavy
(the command line builds its help text before torch is loaded)."""

from __future__ import annotations

UNION_DEFAULTS: dict[str, float | int] = {"trust": 2, "trained_depth": 3, "min_prob": 0.2}
"""X+suffix drafters (:class:`specpilot.drafters.union.UnionDrafter`): a suffix match of 2+
tokens drafts alone, the trained head drafts at most 3 deep and stops below path probability
0.2. Chosen from acceptance runs on SmolLM2-135M (bench/union_tau.py); the speed runs compare
the gated union with suffix drafting (BENCHMARKS.md, "Trained drafters"); 0 turns each off."""
