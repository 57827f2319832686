"""Token forcing: identical outputs pass; any token, length or missing-output divergence fails."""

from __future__ import annotations

import pytest
import torch

from specpilot.forcing import (
    MISMATCH,
    PASS,
    Divergence,
    ForcingReport,
    Reference,
    check,
    margins_from_logits,
)

TOKENS = (11, 12, 13, 14, 15, 16)
MARGINS = (2.0, 1.5, 0.9, 0.4, 0.0002, 3.0)


def _refs() -> list[Reference]:
    return [
        Reference("a", TOKENS, MARGINS),
        Reference("b", (21, 22, 23), (1.0, 1.0, 1.0)),
    ]


def _cands(**override: list[int]) -> dict[str, list[int]]:
    cands = {"a": list(TOKENS), "b": [21, 22, 23]}
    cands.update(override)
    return cands


def test_identical_outputs_pass() -> None:
    report = check(_refs(), _cands())
    assert report.status == PASS and report.ok
    assert report.n_prompts == 2 and report.n_tokens == 9
    assert report.divergences == () and report.near_ties == 0
    assert report.summary() == "PASS: 2 prompts, 9 tokens, identical"


def test_swapped_token_is_a_mismatch_at_its_position() -> None:
    cand = list(TOKENS)
    cand[3] = 99
    report = check(_refs(), _cands(a=cand))
    assert report.status == MISMATCH and not report.ok
    assert report.divergences == (Divergence("a", 3, 14, 99, 0.4),)
    assert "a at token 3: ref 14 vs cand 99" in report.summary()


def test_only_the_first_divergence_per_prompt_is_reported() -> None:
    report = check(_refs(), _cands(a=[11, 77, 78, 79, 80, 81]))
    assert len(report.divergences) == 1
    assert report.divergences[0].position == 1


def test_early_stop_is_a_divergence() -> None:
    report = check(_refs(), _cands(b=[21, 22]))
    assert not report.ok
    assert report.divergences == (Divergence("b", 2, 23, None, 1.0),)
    assert "cand <end>" in report.summary()


def test_empty_candidate_diverges_at_zero() -> None:
    report = check(_refs(), _cands(b=[]))
    assert report.divergences == (Divergence("b", 0, 21, None, 1.0),)


def test_run_on_is_a_divergence() -> None:
    report = check(_refs(), _cands(b=[21, 22, 23, 2]))
    assert not report.ok
    assert report.divergences == (Divergence("b", 3, None, 2, None),)
    assert "ref <end> vs cand 2" in report.summary()


def test_missing_candidate_is_a_divergence() -> None:
    report = check(_refs(), {"a": list(TOKENS)})
    assert not report.ok
    assert report.divergences == (Divergence("b", 0, 21, None, 1.0),)


def test_candidate_without_reference_is_rejected() -> None:
    with pytest.raises(ValueError, match="without a reference"):
        check(_refs(), _cands(c=[1, 2]))


def test_duplicate_reference_ids_rejected() -> None:
    with pytest.raises(ValueError, match="unique"):
        check([Reference("a", (1,)), Reference("a", (1,))], {"a": [1]})


def test_candidate_tensor_tokens_are_compared_by_value() -> None:
    report = check(_refs(), _cands(a=torch.tensor(TOKENS)))  # type: ignore[arg-type]
    assert report.ok


def _near_tie_candidate() -> list[int]:
    # Diverges at position 4, where the reference margin is 0.0002 (< 1e-3); then continues
    # differently, as it legitimately would after an argmax flip.
    return [11, 12, 13, 14, 55, 56]


def test_strict_mode_fails_on_near_tie_but_counts_it() -> None:
    report = check(_refs(), _cands(a=_near_tie_candidate()), strict=True)
    assert report.status == MISMATCH
    assert report.near_ties == 1
    assert report.divergences == (Divergence("a", 4, 15, 55, 0.0002),)


def test_non_strict_mode_tolerates_near_tie() -> None:
    report = check(_refs(), _cands(a=_near_tie_candidate()), strict=False)
    assert report.status == PASS and report.ok
    assert report.near_ties == 1
    assert len(report.divergences) == 1
    assert "1 near-tie divergence(s) tolerated" in report.summary()


def test_non_strict_threshold_is_respected() -> None:
    report = check(_refs(), _cands(a=_near_tie_candidate()), strict=False, near_tie=1e-4)
    assert report.status == MISMATCH and report.near_ties == 0


def test_non_strict_mode_still_fails_large_margin_divergence() -> None:
    cand = list(TOKENS)
    cand[0] = 99  # margin 2.0
    report = check(_refs(), _cands(a=cand), strict=False)
    assert report.status == MISMATCH
    assert report.near_ties == 0


def test_non_strict_mixed_near_tie_and_hard_divergence_fails_and_names_the_hard_one() -> None:
    refs = [Reference("a", TOKENS, MARGINS), Reference("b", (21, 22, 23), (1.0, 1.0, 1.0))]
    report = check(refs, _cands(a=_near_tie_candidate(), b=[21, 99, 23]), strict=False)
    assert report.status == MISMATCH
    assert report.near_ties == 1 and len(report.divergences) == 2
    assert "first: b at token 1" in report.summary()


def test_non_strict_never_tolerates_length_divergence_even_at_low_margin() -> None:
    report = check(_refs(), _cands(a=[11, 12, 13, 14]), strict=False)  # stops where margin 0.0002
    assert report.divergences[0].ref_margin == pytest.approx(0.0002)
    assert report.status == MISMATCH and report.near_ties == 0


def test_non_strict_without_margins_is_strict() -> None:
    refs = [Reference("a", TOKENS, None)]
    report = check(refs, {"a": _near_tie_candidate()}, strict=False)
    assert report.status == MISMATCH
    assert report.divergences[0].ref_margin is None


def test_reference_margins_must_match_tokens() -> None:
    with pytest.raises(ValueError, match="one margin per generated token"):
        Reference("a", (1, 2, 3), (0.5, 0.5))


def test_negative_near_tie_rejected() -> None:
    with pytest.raises(ValueError, match="near_tie"):
        check(_refs(), _cands(), near_tie=-1.0)


def test_report_status_is_validated() -> None:
    with pytest.raises(AssertionError):
        ForcingReport("OK", 1, 1, (), 0)


def test_margins_from_logits() -> None:
    logits = torch.tensor(
        [
            [1.0, 5.0, 3.0, -2.0],  # top1 5, top2 3 -> 2
            [0.5, 0.5, 0.1, 0.0],  # exact tie -> 0
            [-1.0, -4.0, -1.25, -9.0],  # -1 vs -1.25 -> 0.25
        ],
        dtype=torch.bfloat16,
    )
    assert margins_from_logits(logits) == pytest.approx([2.0, 0.0, 0.25])
    assert margins_from_logits(torch.zeros(0, 8)) == []


@pytest.mark.parametrize("shape", [(4,), (2, 1), (1, 2, 3)])
def test_margins_from_logits_rejects_bad_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"\(T, V\)"):
        margins_from_logits(torch.zeros(shape))


def test_margins_feed_check() -> None:
    logits = torch.tensor([[0.0, 3.0], [2.0, 2.0000001]])
    ref = Reference("a", (1, 1), tuple(margins_from_logits(logits)))
    report = check([ref], {"a": [1, 0]}, strict=False)
    assert report.ok and report.near_ties == 1
