"""Mechanism ``suffix_options`` (tau): how the suffix drafter matches and how far it drafts.

SuffixDecoding (Oliaro et al. 2024; vLLM ``suffix_decoding_max_tree_depth``): the longest suffix
matched (``max_pattern``), the longest draft (``max_depth``), and how many tokens of earlier
outputs the global corpus keeps (``max_corpus_tokens``, 0 = the current sequence only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan

CORPUS_SIZES = (0, 4096, 65536, 262144)


class SuffixOptions:
    id = "suffix_options"
    factor = "tau"
    description = "suffix drafter: longest suffix matched, longest draft, corpus of past outputs"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        o = plan.drafter_options
        corpus = int(o.get("max_corpus_tokens", 65536))
        return (
            Param(
                "max_pattern",
                "int",
                min(int(o.get("max_pattern", 32)), 64),
                low=2,
                high=64,
                log=True,
            ),
            Param("max_depth", "int", min(int(o.get("max_depth", 16)), 32), low=1, high=32),
            Param(
                "max_corpus_tokens",
                "categorical",
                corpus if corpus in CORPUS_SIZES else 65536,
                choices=CORPUS_SIZES,
            ),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return None if plan.drafter == "suffix" else f"the drafter is {plan.drafter}, not suffix"

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        opts = {k: int(params[k]) for k in ("max_pattern", "max_depth", "max_corpus_tokens")}
        return plan.replace(drafter_options=opts)
