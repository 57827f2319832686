"""Token forcing: the losslessness check that runs before any timing.

Greedy speculative decoding is *lossless*: for every prompt it must emit exactly the tokens that
plain autoregressive greedy decoding of the target emits. **Token forcing** checks this directly:
the reference (plain decoding) output of each prompt is recorded once, and a candidate engine
configuration's output is compared with it token by token - same tokens, same length.

Why it comes first: the optimizer is rewarded for speed, and the cheapest way to be fast is to
change the outputs (accept draft tokens the target would not have chosen, stop early). A candidate
that fails forcing gets no speed measurement at all.

Words:
  * divergence - the first position where a candidate differs from its reference: a different
    token, a candidate that ends early (candidate token None), a candidate that runs on past the
    reference's end (reference token None), or a missing candidate (position 0, candidate None).
  * margin     - at a reference position, the target's top-1 minus top-2 logit. A divergence at a
    margin below ``near_tie`` is a **near-tie**: batched/tree verification computes logits in a
    different order than plain decoding, and floating-point rounding can flip an argmax there.

``check`` in strict mode fails on any divergence; in non-strict mode it tolerates token
divergences that are near-ties (never length divergences, never missing candidates). Tokens after
a tolerated near-tie are not compared: once an argmax flips, the continuation legitimately differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

PASS = "PASS"
MISMATCH = "MISMATCH"


@dataclass(frozen=True)
class Reference:
    """The plain autoregressive greedy output of one prompt."""

    prompt_id: str
    tokens: tuple[int, ...]
    """Generated tokens (prompt excluded)."""
    margins: tuple[float, ...] | None = None
    """Top-1 minus top-2 logit at each generated position (same length as tokens), if recorded."""

    def __post_init__(self) -> None:
        if self.margins is not None and len(self.margins) != len(self.tokens):
            raise ValueError(
                f"reference {self.prompt_id!r}: {len(self.margins)} margins for "
                f"{len(self.tokens)} tokens; record one margin per generated token"
            )


@dataclass(frozen=True)
class Divergence:
    """The first position where a candidate's output differs from its reference."""

    prompt_id: str
    position: int
    """Index into the generated tokens (0 = first generated token)."""
    reference_token: int | None
    """None when the candidate ran on past the end of the reference."""
    candidate_token: int | None
    """None when the candidate ended early or is missing."""
    ref_margin: float | None
    """Reference top-1 minus top-2 logit at ``position``; None if not recorded or past the end."""

    @property
    def is_token_mismatch(self) -> bool:
        """Both outputs have a token here and they differ (not a length divergence)."""
        return self.reference_token is not None and self.candidate_token is not None

    def is_near_tie(self, near_tie: float) -> bool:
        """A token mismatch where the reference's margin is below ``near_tie``."""
        return self.is_token_mismatch and self.ref_margin is not None and self.ref_margin < near_tie

    def describe(self) -> str:
        ref = "<end>" if self.reference_token is None else str(self.reference_token)
        cand = "<end>" if self.candidate_token is None else str(self.candidate_token)
        margin = "" if self.ref_margin is None else f", margin {self.ref_margin:.3g}"
        return f"{self.prompt_id} at token {self.position}: ref {ref} vs cand {cand}{margin}"


@dataclass(frozen=True)
class ForcingReport:
    """Result of comparing candidate outputs with their references."""

    status: str
    """"PASS" or "MISMATCH"."""
    n_prompts: int
    n_tokens: int
    """Reference tokens checked, over all prompts."""
    divergences: tuple[Divergence, ...]
    """Every divergence found (at most one per prompt), tolerated near-ties included."""
    near_ties: int
    """How many of the divergences are near-ties (counted in strict mode too, for diagnosis)."""
    tie_threshold: float = 1e-3
    """The ``near_tie`` margin the divergences were classified with."""

    def __post_init__(self) -> None:
        assert self.status in (PASS, MISMATCH), f"unknown forcing status {self.status!r}"

    @property
    def ok(self) -> bool:
        return self.status == PASS

    def summary(self) -> str:
        """One line for the CLI or a log."""
        head = f"{self.status}: {self.n_prompts} prompts, {self.n_tokens} tokens"
        if not self.divergences:
            return f"{head}, identical"
        if self.ok:
            return f"{head}; {self.near_ties} near-tie divergence(s) tolerated"
        hard = [d for d in self.divergences if not d.is_near_tie(self.tie_threshold)]
        first = (hard or list(self.divergences))[0]
        return (
            f"{head}; {len(self.divergences)} prompt(s) diverge ({self.near_ties} near-tie); "
            f"first: {first.describe()}"
        )


def check(
    references: Sequence[Reference],
    candidates: Mapping[str, Sequence[int]],
    strict: bool = True,
    near_tie: float = 1e-3,
) -> ForcingReport:
    """Compare each candidate's tokens with its reference; MISMATCH on any divergence that counts.

    Example: reference (5, 6, 7, 8) with margins (2.0, 1.5, 0.0004, 3.0) and candidate
    (5, 6, 9, 8) diverge at position 2 (ref 7, cand 9, margin 0.0004): strict -> MISMATCH;
    non-strict with near_tie=1e-3 -> PASS with near_ties=1.
    """
    if near_tie < 0:
        raise ValueError(f"near_tie must be >= 0, got {near_tie}")
    ids = [r.prompt_id for r in references]
    if len(set(ids)) != len(ids):
        raise ValueError("reference prompt ids must be unique")
    extra = sorted(set(candidates) - set(ids))
    if extra:
        raise ValueError(
            f"candidates for prompts without a reference: {extra[:5]}; "
            "compare against references recorded for the same workload"
        )

    divergences: list[Divergence] = []
    n_tokens = 0
    for ref in references:
        n_tokens += len(ref.tokens)
        cand = candidates.get(ref.prompt_id)
        if cand is None:
            divergences.append(_divergence(ref, 0, None))
            continue
        d = _first_divergence(ref, [int(t) for t in cand])
        if d is not None:
            divergences.append(d)

    near = sum(d.is_near_tie(near_tie) for d in divergences)
    tolerated = 0 if strict else near
    status = PASS if len(divergences) == tolerated else MISMATCH
    return ForcingReport(status, len(references), n_tokens, tuple(divergences), near, near_tie)


def margins_from_logits(logits: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 logit of each row: logits (T, V) -> T floats (all >= 0)."""
    if logits.ndim != 2 or logits.shape[1] < 2:
        raise ValueError(f"expected logits of shape (T, V) with V >= 2, got {tuple(logits.shape)}")
    top2 = torch.topk(logits.float(), 2, dim=-1).values  # (T, 2)
    return (top2[:, 0] - top2[:, 1]).tolist()


def _first_divergence(ref: Reference, cand: list[int]) -> Divergence | None:
    for pos, (r, c) in enumerate(zip(ref.tokens, cand, strict=False)):  # lengths compared below
        if r != c:
            return _divergence(ref, pos, c)
    n_ref, n_cand = len(ref.tokens), len(cand)
    if n_cand < n_ref:  # ended early
        return _divergence(ref, n_cand, None)
    if n_cand > n_ref:  # ran on
        return Divergence(ref.prompt_id, n_ref, None, cand[n_ref], None)
    return None


def _divergence(ref: Reference, pos: int, cand_token: int | None) -> Divergence:
    ref_token = ref.tokens[pos] if pos < len(ref.tokens) else None
    margin = ref.margins[pos] if ref.margins is not None and pos < len(ref.margins) else None
    return Divergence(ref.prompt_id, pos, ref_token, cand_token, margin)
