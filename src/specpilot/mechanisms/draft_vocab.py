"""Mechanism ``draft_vocab`` (kernel): a draft model with a reduced output vocabulary.

With a 49k vocabulary the LM head dominates a small draft model's step; restricting the draft
head to frequent tokens cuts it (FR-Spec, Zhao et al. 2025). The draft can then only propose
kept tokens; the target still verifies every one, so the output is unchanged. Tokens are kept
by id: byte-level BPE assigns ids in merge order, so low ids are the frequent merges (a corpus
count would be sharper; this needs no data). Runtime: the draft model's
:meth:`specpilot.model.Transformer.set_head_rows`, options
``{"keep": V}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specpilot.errors import ConfigError
from specpilot.mechanisms.base import (
    Context,
    Param,
    RuntimeSetup,
    parse_dataclass,
    require,
    with_option,
)
from specpilot.plan import Plan

MIN_KEEP = 256


@dataclass(frozen=True)
class VocabOptions:
    keep: int
    """Draft only token ids below this."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.keep, int) and self.keep >= 2,
            "plan options: draft_vocab",
            "keep must be an integer >= 2",
        )


def _uses_draft_model(plan: Plan) -> bool:
    hybrid = plan.options.get("hybrid_drafting")
    fallback = hybrid.get("fallback") if isinstance(hybrid, Mapping) else None
    return plan.drafter == "model" or fallback == "model"


class DraftVocab:
    id = "draft_vocab"
    factor = "kernel"
    description = "draft model LM head over the most frequent token ids only (FR-Spec)"

    @staticmethod
    def parse_options(raw: Any) -> VocabOptions:
        return parse_dataclass(VocabOptions, raw, "plan options: draft_vocab")

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return (Param("keep", "int", 8192, low=MIN_KEEP, high=65536, log=True),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        if "model" not in ctx.drafters:
            return "no draft model is loaded"
        return None if _uses_draft_model(plan) else "the plan does not draft with a draft model"

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return with_option(plan, self.id, {"keep": int(params["keep"])})

    def configure(self, setup: RuntimeSetup, options: VocabOptions) -> None:
        if setup.draft is None:
            raise ConfigError(
                "the plan's draft_vocab option needs a draft model (--draft-model PATH)"
            )
        setup.draft.set_head_rows(options.keep)
