"""Mechanism ``draft_vocab`` (kernel): a draft model with a reduced output vocabulary.

With a 49k vocabulary the LM head dominates a small draft model's step; restricting the draft
head to frequent tokens cuts it (FR-Spec, Zhao et al. 2025). The draft can then only propose
kept tokens; the target still verifies every one, so the output is unchanged. Tokens are kept
by id: byte-level BPE assigns ids in merge order, so low ids are the frequent merges (a corpus
count would be sharper; this needs no data). Runtime: :func:`set_head_rows`, options
``{"keep": V}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from specpilot.mechanisms.base import Context, Param, parse_dataclass, require, with_option
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


def set_head_rows(model: Any, keep: int) -> None:
    """Make ``model``'s LM head compute logits for ids ``[0, keep)`` only (reversible: the full
    head is kept on the model)."""
    from specpilot.model import PackedLinear

    full = getattr(model, "_specpilot_full_head", None)
    if full is None:
        full = model.head_weight()
        model._specpilot_full_head = full
    keep = min(keep, full.shape[0])
    w = full[:keep].contiguous()  # (keep, dim)
    if model._head_plain is not None:  # prepacked model: a packed head of the kept rows
        model.lm_head = PackedLinear(w, None)
    else:
        head = nn.Linear(w.shape[1], keep, bias=False, device=w.device, dtype=w.dtype)
        head.weight = nn.Parameter(w, requires_grad=False)
        model.lm_head = head


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
