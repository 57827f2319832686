"""The goodput verify budget: cost curve, calibrated acceptance, selection with hysteresis,
lossless decoding with it, decay to plain decoding, and drafters that skip steps."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.batch import BatchConfig, BatchEngine, BatchRequest
from specpilot.drafters.base import DraftContext
from specpilot.drafters.draft_model import DraftModelDrafter
from specpilot.drafters.head import HeadDrafter
from specpilot.drafters.prompt_lookup import PromptLookupDrafter
from specpilot.drafters.suffix import SuffixDrafter
from specpilot.drafters.union import UnionDrafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError
from specpilot.goodput import (
    AcceptanceStats,
    CostCurve,
    Selector,
    best_nodes,
    calibrate_curve,
    choose,
    next_regime,
    node_gains,
)
from specpilot.tree import DraftTree, TreeSpec

from .conftest import tiny_model
from .test_trained_drafters import TAPS, make_net

GEN = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42, 3]]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_cost_curve_interpolates_and_learns() -> None:
    c = CostCurve([1, 4, 8], [0.010, 0.013, 0.021])
    assert c(1) == 0.010 and c(0) == 0.010
    assert c(2) == pytest.approx(0.011) and c(6) == pytest.approx(0.017)
    assert c(16) == pytest.approx(0.037)  # the last slope, extrapolated
    c.observe(8, 0.031)
    assert c(8) == pytest.approx(0.8 * 0.021 + 0.2 * 0.031)
    with pytest.raises(Exception, match="ascending"):
        CostCurve([4, 1], [0.1, 0.2])


def test_points_never_observed_follow_the_observed_level() -> None:
    """A calibration on a disturbed moment (every point 2x) is corrected where the selector
    never verifies: plain steps observed at 1 row pull the unobserved points down with it."""
    c = CostCurve([1, 2, 4], [0.020, 0.030, 0.040])
    for _ in range(40):
        c.observe(1, 0.010)
    assert c(1) == pytest.approx(0.010, rel=1e-3)
    assert c(2) == pytest.approx(0.015, rel=1e-3) and c(4) == pytest.approx(0.020, rel=1e-3)
    c.observe(2, 0.016)  # once observed, a point keeps its own reading
    two = c(2)
    c.observe(1, 0.005)
    assert c(2) == two and c(4) < 0.020


def test_a_point_no_longer_observed_follows_the_fresh_ones() -> None:
    """A row count the budget stopped choosing does not keep what its last steps left (a slow
    minute): after ``stale_after`` observations elsewhere it follows the fresh points' level from
    its calibration reading, as a point never observed does."""
    c = CostCurve([1, 3, 4], [0.010, 0.012, 0.013], stale_after=20)
    for _ in range(10):
        c.observe(3, 0.020)  # a slow minute at 3 rows
    high = c(3)
    assert high > 0.015
    for _ in range(15):
        c.observe(1, 0.010)
    assert c(3) == high  # observed lately: its own reading
    for _ in range(10):
        c.observe(1, 0.010)
    assert c(3) == pytest.approx(0.012, rel=1e-2)  # stale: its calibration, moved as 1 row moved
    assert c(4) == pytest.approx(0.013, rel=1e-2)


def test_calibration_passes_outlast_a_disturbed_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readings are taken in passes over all row counts, best per count: a disturbance lasting
    as long as one pass slows one reading of each count, never every reading of one count."""
    import specpilot.goodput.cost as gp

    clock = [0.0]
    calls = [0]

    def step(r: int) -> None:
        calls[0] += 1
        slow = 4 <= calls[0] < 10  # the warm-up pass, then a burst over the next two passes' calls
        clock[0] += (0.001 * (1 + r)) * (3.0 if slow else 1.0)

    monkeypatch.setattr(gp, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    c = calibrate_curve(step, (1, 2, 4), repeats=3)
    assert c.seconds == pytest.approx([0.002, 0.003, 0.005])


def test_acceptance_stats_calibrate_an_overconfident_drafter() -> None:
    stats = AcceptanceStats()
    tree = DraftTree.chain([1, 2], [math.log(0.9), math.log(0.85)])
    assert stats.estimate(1, 0.9) == pytest.approx(0.9)  # no evidence: the drafter's word
    for _ in range(40):
        stats.observe(tree, [])  # never accepted
    assert stats.estimate(1, 0.9) < 0.1 and stats.estimate(2, 0.85) < 0.1
    # a depth never seen follows the depths above it, not the drafter's word
    assert stats.estimate(3, 0.9) < 0.01
    assert stats.estimate(3, 0.9, regime=1) == pytest.approx(0.9)  # another regime: its prior


def test_a_certain_drafters_deep_nodes_start_below_its_shallow_ones() -> None:
    """Cold start: a suffix drafter says 1.0 for every node of a match; with evidence at depth 1
    only (right 2 times in 3), the deeper nodes of a chain start one factor of that rate lower
    per depth, not at depth 1's rate (a fresh batch verified 7-node chains for 8 sequences and
    committed a third of what it predicted)."""
    stats = AcceptanceStats()
    for i in range(30):
        stats.observe(DraftTree.chain([4]), [0] if i % 3 else [])
    gains = node_gains(DraftTree.chain([4, 5, 6, 7, 8], [0.0] * 5), stats)
    rate = gains[0]
    assert 0.55 < rate < 0.75
    for d in range(1, 5):
        assert gains[d] == pytest.approx(rate ** (d + 1), rel=0.15)
    # the budget then keeps the shallow nodes only where a row costs a fifth of a plain step
    curve = CostCurve([1, 8], [0.010, 0.024])
    assert 0 < choose([gains], curve, 0.0).width < 5


def test_choose_trades_tokens_for_time() -> None:
    flat = CostCurve([1, 64], [0.010, 0.0101])  # extra rows nearly free: verify everything
    steep = CostCurve([1, 2], [0.010, 0.020])  # every row costs a whole step: verify nothing
    gains = [[0.6, 0.5, 0.4, 0.1]]
    assert choose(gains, flat, 0.0).width == 4
    assert choose(gains, steep, 0.0).width == 0
    batch = [[0.6, 0.5], [0.6, 0.5], [0.6, 0.5], [0.6, 0.5]]
    assert choose(batch, CostCurve([1, 4, 12], [0.01, 0.011, 0.03]), 0.0).width == 0
    assert choose(batch, CostCurve([1, 4, 12], [0.01, 0.011, 0.012]), 0.0).width == 2


def test_best_nodes_are_ancestor_closed() -> None:
    t = DraftTree.from_parents([1, 2, 3, 4], [-1, 0, 1, -1])
    assert best_nodes(t, [0.1, 0.2, 0.9, 0.05], 3) == [0, 1, 2]
    assert best_nodes(t, [0.9, 0.2, 0.1, 0.5], 2) == [0, 3]


def test_selector_hysteresis_keeps_the_last_width_on_a_near_tie() -> None:
    curve = CostCurve([1, 2, 3], [0.0100, 0.0120, 0.0135])  # goodput 100, 125, 148
    sel = Selector(curve, hysteresis=0.2)
    tree = DraftTree.chain([1, 2], [math.log(0.5), math.log(0.5) + math.log(0.99)])
    sel.last = choose([[0.5, 0.495]], curve, 0.0, max_width=1)
    out = sel.select([tree])  # width 2 is 18% better, not 20%: stay at 1
    assert out[0].size == 1 and sel.last.width == 1
    sel = Selector(curve, hysteresis=0.0)
    sel.last = choose([[0.5, 0.495]], curve, 0.0, max_width=1)
    assert sel.select([tree])[0].size == 2


def test_probes_back_off_while_plain_decoding_wins_and_reset_when_nodes_pay() -> None:
    steep = CostCurve([1, 2], [0.010, 0.020])  # a row costs a whole step: nodes never pay
    sel = Selector(steep, probe_every=8, max_probe_gap=32, max_bound_skips=0)  # backoff alone
    weak = DraftTree.chain([1, 2], [math.log(0.3), math.log(0.1)])
    probes = []
    for step in range(200):
        if sel.should_draft():
            probes.append(step)
            sel.note_draft(0.001)
            assert sel.select([weak])[0].size == 0
        else:
            sel.note_skip()
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    # the first draft caught up on the prompt: the next step drafts once more to time a steady
    # one (a probe that chose plain decoding too), then the gaps double up to the cap
    assert probes[:2] == [0, 1] and gaps[1:5] == [16, 32, 32, 32], probes
    sel.curve = CostCurve([1, 64], [0.010, 0.0101])  # rows nearly free: the next probe drafts
    while not sel.should_draft():
        sel.note_skip()
    sel.note_draft(0.0)
    assert sel.select([weak])[0].size == 2 and sel.probe_gap == 8


def test_a_probe_that_cannot_pay_even_in_the_best_case_is_skipped_a_few_times_in_a_row() -> None:
    """At batch 32 the plain step costs 1.25 ms a token and drafting a sequence 5 ms: even the
    best tree drafted lately (a chain of 4 the target always follows) cannot buy that back, so
    the probes are skipped (at most ``max_bound_skips`` in a row: then one runs to refresh the
    statistics); at batch 1 the same best case says a probe could pay."""
    curve = CostCurve([1, 32, 64], [0.008, 0.040, 0.070])
    sure = DraftTree.chain([1, 2, 3, 4], [math.log(0.95)] * 4)

    def probes(skips: int, batch: int) -> list[int]:
        sel = Selector(curve, probe_every=2, max_probe_gap=2, max_bound_skips=skips)
        for _ in range(20):
            sel.stats.observe(sure, [0, 1, 2, 3])
        sel.note_draft(0.005, catchup=False)  # a steady draft's cost is known
        sel.select([sure])
        sel.last = choose([[]] * batch, curve, 0.005)  # plain decoding chosen
        out = []
        for step in range(30):
            if sel.should_draft(batch):
                out.append(step)
                sel.note_draft(0.005)
                sel._next_probe(0)
            else:
                sel.note_skip()
        return out

    sel = Selector(curve)
    assert sel.could_pay(32)  # nothing measured yet: probe
    sel.note_draft(0.005)
    for _ in range(20):
        sel.stats.observe(sure, [0, 1, 2, 3])
    sel.select([sure])  # the tree it drafted is the best case now
    assert sel.could_pay(1) and not sel.could_pay(32)
    every = probes(0, 32)
    assert every == list(range(1, 30, 2))  # the bound off: a probe every 2 steps
    bounded = probes(3, 32)
    gaps = [b - a for a, b in itertools.pairwise(bounded)]
    assert gaps and set(gaps) == {8}  # three probes skipped (2 steps each), then one runs
    assert probes(3, 1) == every  # at batch 1 the best case pays: every probe runs


def test_a_new_sequence_drafts_first_and_carries_a_plain_backoff_at_half_its_gap() -> None:
    """A new sequence drafts its first step; after one whose drafter drafted to the end the
    backoff starts afresh, after one where plain decoding won it carries over at half its gap
    and the steady draft cost is timed again by the draft after the first."""
    curve = CostCurve([1, 2, 8], [0.006, 0.0065, 0.009])
    sel = Selector(curve, probe_every=8)
    sure = DraftTree.chain([1, 2], [0.0, 0.0])
    sel.note_draft(0.004, catchup=False)
    assert sel.select([sure])[0].size == 2  # nodes chosen: the drafter on
    sel.probe_gap, sel.bound_skips = 16, 2
    sel.begin_sequence()
    assert sel.last is None and sel.should_draft()  # a new prompt: draft its first step
    assert sel.probe_gap == 0 and sel.bound_skips == 0

    weak = DraftTree.chain([1, 2], [math.log(0.95)] * 2)
    for _ in range(50):
        sel.stats.observe(weak, [])  # never accepted
    sel.select([weak])
    sel.last = choose([[]], curve, sel.draft_s)  # plain decoding won
    sel.probe_gap, sel.bound_skips = 64, 2
    assert not sel.should_draft()
    sel.draft_s = 0.05  # a slow early reading, never timed again while plain decoding won
    sel.begin_sequence()
    assert sel.last is None and sel.probe_gap == 32 and sel.bound_skips == 0
    drafts = []
    for step in range(70):
        if sel.should_draft():
            drafts.append(step)
            sel.note_draft(0.004)
            assert sel.select([weak])[0].size == 0
        else:
            sel.note_skip()
    # the prompt, the draft after it timing a steady one again (counted as a probe: the gap
    # doubles), then the next probe that gap in
    assert drafts == [0, 1, 65] and sel.draft_s == 0.004
    sel.probe_gap = 8
    sel.begin_sequence()
    assert sel.probe_gap == 8  # never below probe_every


def test_a_tiered_drafter_runs_its_dear_part_every_step_only_while_it_pays() -> None:
    """The copy part (a chain the target follows) drafts every step; the dear part (2 ms)
    proposes two more nodes. Unlikely ones: the full drafter stops after the first step and
    comes back only as a probe, the cheap part's nodes still verified in between. Likely ones:
    it keeps drafting every step."""
    curve = CostCurve([1, 2, 4, 8], [0.010, 0.011, 0.013, 0.017])
    copy = DraftTree.chain([5, 6], [0.0, 0.0])

    def run(p_head: float) -> list[int]:
        sel = Selector(curve, probe_every=4, max_bound_skips=0)
        full = DraftTree.chain([5, 6, 7, 8], [0.0, 0.0, math.log(p_head), 2 * math.log(p_head)])
        fulls = []
        for step in range(24):
            if sel.should_draft():
                fulls.append(step)
                sel.note_draft(0.002)
                out = sel.select([full], alternative=[copy])
            else:
                sel.note_skip()
                assert sel.cheap_tier()
                sel.note_draft(0.0001, cheap=True)
                out = sel.select([copy], drafted=0, cheap=1)
                assert out[0].size == 2  # the copy part's nodes pay: verified
            sel.observe(out, [list(range(out[0].size))], curve(1 + out[0].size))
        return fulls

    # the first draft caught up (a fresh context): step 1 times a steady one, then the probes
    # back off (8 steps: the steady draft counted as a probe that chose plain decoding)
    assert run(0.05) == [0, 1, 9]
    assert run(0.95) == list(range(24))
    sel = Selector(curve)
    sel.note_draft(0.0001, cheap=True)
    assert sel.cheap_s == 0.0001 and sel.draft_s == 0 and sel.idle == 0


def test_a_full_drafter_whose_choice_ties_the_cheap_parts_at_plain_decoding_stops() -> None:
    """At 8 sequences the heads paid once (full drafting every step), then neither they nor the
    copy part proposes a node worth verifying: both choices are plain decoding, and the heads'
    drafting (4 ms a step against a 13 ms step) buys nothing. The full drafter must stop within
    a few steps (judged by the choices alone, the two tied and it drafted every step on)."""
    curve = CostCurve([1, 8, 16, 24], [0.010, 0.013, 0.020, 0.028])
    sel = Selector(curve, probe_every=8, max_bound_skips=0)
    sure = [DraftTree.chain([5, 6, 7], [0.0] * 3)] * 8
    weak_full = [DraftTree.chain([5, 6], [math.log(0.05), 2 * math.log(0.05)])] * 8
    weak_copy = [DraftTree.chain([5], [math.log(0.05)])] * 8
    fulls = []
    for step in range(30):
        strong = step < 3
        if sel.should_draft(8):
            fulls.append(step)
            sel.note_draft(0.004, 8, catchup=False)
            out = sel.select(sure if strong else weak_full, packed=True,
                             alternative=[DraftTree.empty()] * 8 if strong else weak_copy)
        else:
            sel.note_skip()
            sel.note_draft(0.0002, 8, cheap=True)
            out = sel.select(weak_copy, packed=True, drafted=0, cheap=8)
        if not strong:
            assert all(t.size == 0 for t in out)  # nothing worth verifying
        paths = [list(range(t.size)) if strong else [] for t in out]
        sel.observe(out, paths, curve(8 + sum(t.size for t in out)), packed=True)
    late = [s for s in fulls if s >= 3]
    assert fulls[:3] == [0, 1, 2] and len(late) <= 3 + 30 // 8, fulls


def test_a_cheap_part_that_is_not_cheap_drafts_alone_only_while_its_trees_pay() -> None:
    """A cheap part costing a tenth of a step (past ``cheap_draft``) keeps drafting alone while
    its choices buy their drafting, and stops once they do not (plain decoding then), probing
    with a backoff until they pay again."""
    curve = CostCurve([1, 2, 4, 8], [0.010, 0.011, 0.013, 0.017])
    sel = Selector(curve)
    sel.note_draft(0.001, cheap=True)
    assert not sel.cheap(1) and sel.cheap_tier()  # dear, but not judged yet
    sure = DraftTree.chain([5, 6, 7], [0.0] * 3)
    for _ in range(5):
        assert sel.select([sure], drafted=0, cheap=1)[0].size == 3
    assert sel.cheap_edge is not None and sel.cheap_edge > 0 and sel.cheap_tier()
    for _ in range(50):
        sel.stats.observe(sure, [])  # the copies stopped matching
    for _ in range(10):
        sel.select([sure], drafted=0, cheap=1)
    assert sel.cheap_edge < 0 and not sel.cheap_tier()
    # sitting out, it probes with a backoff: steps 8, 24, 40, 56, ... (gaps up to 16)
    asked = [i for i in range(1, 60) if sel.cheap_tier()]
    assert asked == [7, 23, 39, 55] and sel.cheap_gap == sel.max_cheap_gap == 16
    sel.stats = type(sel.stats)()  # the copies match again: a probe's trees pay
    for _ in range(3):
        sel.select([sure], drafted=0, cheap=1)
    assert sel.cheap_edge > 0 and sel.cheap_gap == 0 and sel.cheap_tier()
    sel.cheap_edge, sel.cheap_gap = -1.0, 32
    sel.begin_sequence()
    assert sel.cheap_tier() and sel.cheap_gap == 0  # a new prompt may copy again


class WrongDrafter:
    """Claims probability 0.9 for a chain of tokens the target never picks (lossless anyway)."""

    name = "wrong"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.calls = 0

    def begin(self, prompt: list[int]) -> None:
        pass

    def finish(self, tokens: list[int]) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftTree:
        self.calls += 1
        bad = (ctx.tokens[-1] * 7 + 3) % 64  # not what the tiny target continues with
        return DraftTree.chain([bad] * 4, [math.log(0.9) * (d + 1) for d in range(4)])


def _engines(goodput: bool) -> Engine:
    return Engine(tiny_model("llama", seed=3, std=0.12), EngineConfig(goodput=goodput))


def test_goodput_decoding_is_lossless_and_decays_to_plain() -> None:
    plain = _engines(False)
    refs = [plain.generate(p, GEN).tokens for p in PROMPTS]
    eng = _engines(True)
    assert eng.generate(PROMPTS[0], GEN, drafter=SuffixDrafter()).tokens == refs[0]
    for p, ref in zip(PROMPTS, refs, strict=True):
        assert eng.generate(p, GEN, drafter=SuffixDrafter(), spec=TreeSpec(kind="chain", k=4)
                            ).tokens == ref
    assert eng.selector is not None and eng.selector.log  # predicted vs actual step times
    # a curve where 4 more rows cost 40% of a step (a tiny model's rows are nearly free; kept
    # fixed here): a drafter that is never right decays to plain decoding
    # (drafting counted as dear: cheap drafting runs every step, see the next test)
    eng.selector = Selector(CostCurve([1, 5], [0.010, 0.014], smoothing=0.0), cheap_draft=0.0)
    wrong, long = WrongDrafter(), GenerationConfig(max_new_tokens=90, stop_on_eos=False)
    res = eng.generate(PROMPTS[1], long, drafter=wrong, spec=TreeSpec(kind="chain", k=4))
    assert res.tokens == plain.generate(PROMPTS[1], long).tokens
    assert res.draft_nodes[0] == 4  # trusted at first
    assert sum(n == 0 for n in res.draft_nodes[-20:]) >= 17  # the last steps decode plainly
    assert wrong.calls < res.steps - 20  # drafting only to probe
    # the deep nodes' estimates, rarely verified once the budget shrank, keep their prior: they
    # must not count for more than the depth-1 node they hang under (node_gains caps them)
    gains = node_gains(wrong.propose(DraftContext([3, 4], 1, TreeSpec(kind="chain", k=4))),
                       eng.selector.stats)  # fmt: skip
    assert gains == sorted(gains, reverse=True)


def test_cheap_drafting_runs_every_step_while_plain_decoding_wins() -> None:
    """A drafter costing under ``cheap_draft`` of a plain step drafts every step (no probe
    backoff: it would miss the start of a copy run for nothing saved), and verifies nothing
    while its drafts do not pay; a dear one probes."""
    steep = CostCurve([1, 2], [0.010, 0.020])  # nodes never pay
    weak = DraftTree.chain([1, 2], [math.log(0.3), math.log(0.1)])

    def drafts(draft_s: float) -> int:
        sel, n = Selector(steep), 0
        for step in range(100):
            if sel.should_draft():
                n += 1
                assert step == 0 or sel.probing == (draft_s > 0.0001)  # a probe asks a few
                sel.note_draft(draft_s)
                assert sel.select([weak])[0].size == 0
            else:
                sel.note_skip()
        return n

    assert drafts(0.00005) == 100  # 0.5% of a step
    assert drafts(0.0003) < 20  # 3%


def test_a_run_of_full_acceptances_gets_statistics_of_its_own() -> None:
    """Deep nodes tried and rejected in one regime do not hold a copy run (every step accepted
    its whole path) to one node: that regime's cell starts at the drafter's word."""
    curve = CostCurve([1, 2, 4, 8], [0.008, 0.009, 0.012, 0.016], smoothing=0.0)
    sel = Selector(curve)
    chain = DraftTree.chain([1, 2, 3, 4], [0.0] * 4)  # a suffix match: probability 1 per node
    for _ in range(30):
        sel.observe([chain], [[0]], 0.010, regimes=[0])  # only depth 1 accepted
    assert sel.select([chain], regimes=[0])[0].size == 1
    assert sel.select([chain], regimes=[3])[0].size == 4
    assert next_regime(0, chain, [0, 1, 2, 3]) == 1 and next_regime(2, chain, [0]) == 0


def test_the_curve_learns_between_its_points() -> None:
    c = CostCurve([4, 8], [0.010, 0.020], smoothing=1.0)
    c.observe(6, 0.013)  # predicted 0.015: both points move by half the error
    assert c.seconds == pytest.approx([0.009, 0.019])
    c.observe(40, 0.5)  # far beyond the last point: not used
    assert c.seconds == pytest.approx([0.009, 0.019])


def test_batched_goodput_is_lossless() -> None:
    refs = [_engines(False).generate(p, GEN).tokens for p in PROMPTS]
    beng = BatchEngine(tiny_model("llama", seed=3, std=0.12), EngineConfig(goodput=True),
                       BatchConfig(max_batch=4, max_len=256))
    slots = [beng.add(BatchRequest(list(p), GEN, drafter=d, spec=TreeSpec(kind="chain", k=4)))
             for p, d in zip(PROMPTS, [SuffixDrafter(), WrongDrafter(), PromptLookupDrafter()],
                             strict=True)]
    shadowed = 0
    while beng.slots:
        beng.step()
        assert beng.selector is not None
        shadowed = max(shadowed, len(beng.selector.shadow.pending))
    assert [s.res.tokens for s in slots] == refs
    assert shadowed > 0 and not beng.selector.shadow.pending  # finished sequences forgotten


def _drafters(target: Any) -> dict[str, Callable[[], Any]]:
    draft = tiny_model("llama", seed=11, std=0.12)
    return {
        "lookup": PromptLookupDrafter,
        "suffix": SuffixDrafter,
        "model": lambda: DraftModelDrafter(draft, 512),
        "head": lambda: HeadDrafter(make_net("head", target)),
        "head+suffix": lambda: UnionDrafter(SuffixDrafter(), HeadDrafter(make_net("head", target))),
    }


@pytest.mark.parametrize("name", ["lookup", "suffix", "model", "head", "head+suffix"])
def test_a_drafter_that_skips_steps_drafts_as_if_it_never_had(name: str) -> None:
    """Draft every step vs. draft, skip k steps, draft again (the skipped steps' target states
    handed over together): the same trees wherever both draft."""
    target = tiny_model("llama", seed=3, std=0.12)
    eng = Engine(target, EngineConfig())
    prompt = PROMPTS[0]
    out = eng.generate(prompt, GenerationConfig(max_new_tokens=30, stop_on_eos=False)).tokens
    tokens = [*prompt, *out]
    taps = TAPS if name.startswith("head") else ()
    states = eng.hidden_states(tokens, taps) if taps else ()
    spec = TreeSpec(kind="dynamic", budget=8, topk=2, depth=3)
    make = _drafters(target)[name]
    every, skipping = make(), make()
    every.begin(prompt)
    skipping.begin(prompt)
    drafted_at = {len(prompt) + 1, len(prompt) + 2, len(prompt) + 7, len(prompt) + 8,
                  len(prompt) + 15}
    seen = {"every": 0, "skip": 0}
    for n in range(len(prompt) + 1, len(tokens)):  # committed = tokens[:n]
        def ctx(who: str, n: int = n) -> DraftContext:
            hidden = tuple(h[seen[who] : n - 1] for h in states) if taps else ()
            seen[who] = n - 1
            return DraftContext(tokens[:n], len(prompt), spec, hidden)

        a = every.propose(ctx("every"))
        if n in drafted_at:
            b = skipping.propose(ctx("skip"))
            assert a.tokens.tolist() == b.tokens.tolist(), (name, n)
            assert a.parents.tolist() == b.parents.tolist(), (name, n)


@st.composite
def _compositions(draw: st.DrawFn) -> list[tuple[list[int], DraftTree]]:
    """2..4 sequences, each a prompt of 1..24 tokens (its cache length) and a draft tree of
    0..6 nodes (any shape: every parent precedes its child)."""
    out = []
    for _ in range(draw(st.integers(2, 4))):
        prompt = draw(st.lists(st.integers(0, 63), min_size=1, max_size=24))
        n = draw(st.integers(0, 6))
        parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
        tokens = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n))
        out.append((prompt, DraftTree.from_parents(tokens, parents) if n else DraftTree.empty()))
    return out


@settings(max_examples=25, deadline=None)
@given(batch=_compositions())
def test_packed_verify_gives_the_padded_bits(batch: list[tuple[list[int], DraftTree]]) -> None:
    """A packed batched verify (real rows only) computes every real row's logits and hidden
    states bit for bit as the padded one, and commits the same caches, for any batch
    composition (tree sizes and shapes, cache lengths)."""
    from specpilot.verify import VerifyRow, verify_step

    outs = []
    gen = GenerationConfig(max_new_tokens=8, stop_on_eos=False)
    for packed in (False, True):
        model = tiny_model("llama", seed=3, std=0.12)
        beng = BatchEngine(model, EngineConfig(), BatchConfig(max_batch=4, max_len=64))
        for prompt, _ in batch:
            beng.add(BatchRequest(list(prompt), gen))
        rows = [VerifyRow(s.committed[-1], s.cache_len, t)
                for s, (_, t) in zip(beng.slots, batch, strict=True)]
        b = len(rows)
        res = verify_step(model, rows, (1, 2), cache_rows=slice(0, b), scratch=63, packed=packed)
        caches = []
        for s, o in zip(beng.slots, res, strict=True):
            n = s.cache_len + len(o.path) + 1  # the committed prefix after this step
            layer = model.model.layers[0].self_attn.cache
            caches.append((layer.k[s.row, :, :n].clone(), layer.v[s.row, :, :n].clone()))
        outs.append((res, caches))
    (a, ca), (b_, cb) = outs
    for x, y in zip(a, b_, strict=True):
        assert torch.equal(x.logits, y.logits) and x.path == y.path and x.tokens == y.tokens
        assert all(torch.equal(h, g) for h, g in zip(x.hidden, y.hidden, strict=True))
    for (ka, va), (kb, vb) in zip(ca, cb, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("goodput", [False, True])
def test_seeded_sampled_bench_is_token_forced(goodput: bool) -> None:
    """bench --temperature T --seed S: speculative sampling gives the seeded AR text exactly
    (single and batched), so sampled runs are token-forced like greedy ones."""
    from specpilot.bench import BenchConfig, Candidate, run_bench
    from specpilot.bench_batch import BatchBenchConfig, run_batch_bench
    from specpilot.errors import ConfigError
    from specpilot.sampling import SamplingParams

    s = SamplingParams(temperature=1.0, top_p=0.95, seed=5)
    eng = _engines(goodput)
    cand = Candidate("suffix/chain", "suffix", SuffixDrafter, TreeSpec(kind="chain", k=4))
    prompts = [(str(i), p) for i, p in enumerate(PROMPTS)]
    res = run_bench(eng, prompts, [cand], BenchConfig(max_new_tokens=24, sampling=s))
    assert res.lossless and res.candidates[0].forcing.n_prompts == 3
    beng = BatchEngine(tiny_model("llama", seed=3, std=0.12), EngineConfig(goodput=goodput),
                       BatchConfig(max_batch=3, max_len=128))
    bres = run_batch_bench(beng, prompts, [cand],
                           BatchBenchConfig(batch_size=3, max_new_tokens=24, sampling=s))
    assert bres.lossless
    with pytest.raises(ConfigError, match="--seed"):
        BenchConfig(sampling=SamplingParams(temperature=1.0))


def test_batched_bench_repeats_alternate_the_modes_order() -> None:
    """bench --batch-size --repeats: plain, speculative, then speculative, plain (ABBA), so a
    drift of the host over a pair of repeats weighs on both alike; every round is kept."""
    from specpilot.bench import Candidate
    from specpilot.bench_batch import BatchBenchConfig, run_batch_bench

    cand = Candidate("suffix/chain", "suffix", SuffixDrafter, TreeSpec(kind="chain", k=4))
    beng = BatchEngine(tiny_model("llama", seed=3, std=0.12), EngineConfig(),
                       BatchConfig(max_batch=3, max_len=128))
    order: list[str] = []
    res = run_batch_bench(beng, [(str(i), p) for i, p in enumerate(PROMPTS)], [cand],
                          BatchBenchConfig(batch_size=3, max_new_tokens=8, repeats=4),
                          progress=lambda name, done, total: order.append(name))  # fmt: skip
    assert order == ["AR", "suffix/chain", "suffix/chain", "AR"] * 2
    assert len(res.ar.rounds_tok_s) == len(res.candidates[0].rounds_tok_s) == 4 and res.lossless


def test_goodput_step_stats_reach_metrics() -> None:
    from specpilot.server.metrics import ServerMetrics

    beng = BatchEngine(tiny_model("llama", seed=3, std=0.12), EngineConfig(goodput=True),
                       BatchConfig(max_batch=2, max_len=128))
    for p in PROMPTS[:2]:
        beng.add(BatchRequest(list(p), GEN, drafter=SuffixDrafter()))
    _, stats = beng.step()
    assert stats.predicted_verify_s is not None and stats.verify_s is not None
    m = ServerMetrics()
    m.observe_step(stats)
    body = m.render().decode()
    assert "specpilot_goodput_verify_seconds" in body and "specpilot_goodput_nodes" in body


def test_the_loop_runs_a_trial_of_the_goodput_budget(tmp_path: Any) -> None:
    """The optimization loop's trial harness applies goodput_budget with tuned hysteresis, probe
    interval and calibration to a tiny model in a child process, token-forces it against the
    trusted plain references and times it against the baseline plan."""
    from specpilot.pilot.trial import PASS, run_trial

    from .pilot_helpers import cases, job, prompts, references, tiny_model_dir

    model = tiny_model_dir(tmp_path / "model")
    ps = prompts(3, seed=4)
    cs = cases(ps, references(model, ps))
    params = {"on": True, "hysteresis": 0.1, "probe_every": 4, "curve_rows": 16,
              "smoothing": 0.1}
    res = run_trial(job("goodput", model, (("goodput_budget", params),), cs[:2], (cs[2:],),
                        work_dir=str(tmp_path)))
    assert res.status == PASS, res.reason
    assert res.forcing["status"] == PASS and res.forcing["n_prompts"] == 2
    assert res.speedup is not None and res.plan is not None
    assert res.plan["mechanisms"] == [{"id": "goodput_budget", "params": params}]
    engine = res.plan["engine"]
    assert engine["goodput"] is True and engine["goodput_hysteresis"] == 0.1
    assert engine["goodput_probe"] == 4 and engine["goodput_rows"] == 16
    assert engine["goodput_smoothing"] == 0.1


def test_prepare_sets_up_the_cache_and_the_curve_before_the_first_request() -> None:
    """A server prepares its batch engine before it reports healthy: the first request then
    pays neither the cache allocation nor the cost curve; plain serving measures no curve."""
    model = tiny_model("llama", seed=3, std=0.12)
    plain = BatchEngine(model, EngineConfig(goodput=True), BatchConfig(max_batch=2, max_len=64))
    plain.prepare(drafting=False)
    assert plain.selector is None and model.batch == 2 and model.max_len >= 64
    beng = BatchEngine(model, EngineConfig(goodput=True), BatchConfig(max_batch=2, max_len=64))
    beng.prepare()
    sel = beng.selector
    assert sel is not None
    slot = beng.add(BatchRequest([5, 6, 7], GEN, drafter=SuffixDrafter(), spec=TreeSpec(k=2)))
    assert beng.selector is sel  # admission reused it
    with pytest.raises(ConfigError, match="before any sequence"):
        beng.prepare()
    beng.remove(slot)


def test_a_probe_asks_a_few_sequences_in_turn() -> None:
    """While plain decoding wins, and on the first step, a probe asks ``probe_sequences``
    drafters of the batch, in turn, not all of them (each would also catch up on its skipped
    steps or its prompt); lossless."""
    prompts = [[*p, i] for i in range(2) for p in PROMPTS]  # 6 sequences
    gen = GenerationConfig(max_new_tokens=64, stop_on_eos=False)
    refs = [_engines(False).generate(p, gen).tokens for p in prompts]
    beng = BatchEngine(tiny_model("llama", seed=3, std=0.12), EngineConfig(goodput=True),
                       BatchConfig(max_batch=6, max_len=256))
    beng.prepare()
    # every row past the batch's own 6 costs 9x a plain step: plain decoding always wins
    # (drafting counted as dear: cheap drafting would run for every sequence every step)
    beng.selector = Selector(CostCurve([6, 7], [0.010, 0.100], smoothing=0.0), probe_sequences=2,
                             max_bound_skips=0, cheap_draft=0.0)
    drafters = [WrongDrafter() for _ in prompts]
    slots = [beng.add(BatchRequest(p, gen, drafter=d, spec=TreeSpec(kind="chain", k=4)))
             for p, d in zip(prompts, drafters, strict=True)]  # fmt: skip
    asked, who = [], []
    while beng.slots:
        before = [d.calls for d in drafters]
        beng.step()
        n = sum(d.calls - b for d, b in zip(drafters, before, strict=True))
        who.append({i for i, (d, b) in enumerate(zip(drafters, before, strict=True))
                    if d.calls > b})  # fmt: skip
        if n:
            asked.append(n)
    assert [s.res.tokens for s in slots] == refs
    # a draft right after a draft asks the same sequences (a steady draft, timed as one)
    follow = [(a, b) for a, b in itertools.pairwise(who) if a and b]
    assert follow and all(b <= a for a, b in follow)
    # nothing chosen yet: the first step is a probe too (every sequence would catch up on its
    # prompt first); then probes ask two, in turn
    assert len(asked) >= 3 and all(n == 2 for n in asked)
    assert set().union(*who) == set(range(len(prompts)))  # in turn: every one is asked


def test_idle_value_prices_a_token_by_the_makespan() -> None:
    """With a queue a token is worth a batch slot's share of a step; with none waiting only the
    row it saves: nodes that pay by the share do not by the makespan."""
    flat = CostCurve([1, 8, 16, 32], [0.020, 0.024, 0.030, 0.044])  # ~1 ms a row past 16
    sel = Selector(flat, seq_share=0.0)  # rows only (a sequence's own cost: the next tests)
    assert sel.idle_value(1) == 1.0
    v = sel.idle_value(32)
    assert 0 < v < 1 and math.isclose(v, (0.044 - flat(31)) * 32 / 0.044)
    trees = [DraftTree.chain([1], [math.log(0.9)]) for _ in range(32)]
    assert sum(t.size for t in sel.select(trees, packed=True)) > 0  # a queue: 0.9 x 1.4 ms > 0.9 ms
    sel = Selector(flat, seq_share=0.0)
    sel.token_value = v
    assert sum(t.size for t in sel.select(trees, packed=True)) == 0
    assert sel.recent and max(map(sum, sel.recent)) == pytest.approx(0.9, abs=0.1)  # raw gains


def test_no_probe_where_no_draft_could_pay_with_nothing_waiting() -> None:
    """With nothing waiting and a row worth next to nothing (idle_value), not even a tree of
    certain nodes pays: probes are skipped, not only backed off; with a queue they run."""
    flat = CostCurve([1, 8, 16, 32], [0.020, 0.024, 0.030, 0.044])
    runs = {}
    for value in (1.0, 0.01):
        sel = Selector(flat, probe_every=4, max_probe_gap=4)
        sel.note_draft(0.003, sequences=4)
        sel.select([DraftTree.chain([1, 2], [math.log(0.2), math.log(0.05)])] * 32, packed=True)
        assert sel.full_on is False  # plain decoding won
        sel.token_value = value
        drafted = 0
        for _ in range(40):
            if sel.should_draft(32):
                drafted += 1
                sel.note_draft(0.003, sequences=4, catchup=True)
                sel.select([DraftTree.empty()] * 32, packed=True, drafted=4)
            else:
                sel.note_skip()
        runs[value] = drafted
    assert runs[1.0] >= 2 and runs[0.01] == 0, runs


def test_unverified_nodes_teach_the_statistics() -> None:
    """Nodes the budget did not verify are scored against the tokens committed after them
    (goodput.shadow): a drafter that is always wrong loses its prior while plain decoding wins,
    without a single node verified."""
    steep = CostCurve([1, 2], [0.010, 0.020])  # a row costs a whole step: nothing is verified
    sel = Selector(steep)
    wrong = DraftTree.chain([7, 8], [0.0, 0.0])  # the drafter is sure; the text says 1, 2, 3...
    assert sel.stats.estimate(1, 1.0) == pytest.approx(1.0)
    for step in range(30):
        out = sel.select([wrong])
        assert out[0].size == 0
        sel.observe(out, [[]], 0.01, committed=[[step + 1]])
    assert sel.stats.estimate(1, 1.0) < 0.1
    assert sel.stats.estimate(1, 0.5) < 0.1  # a bin never seen: the pooled calibration


def test_shadow_waits_for_the_tokens_that_decide_a_node() -> None:
    from specpilot.goodput.shadow import Shadow

    stats = AcceptanceStats()
    sh = Shadow()
    tree = DraftTree.chain([4, 5, 6], [0.0, 0.0, 0.0])
    sh.note("a", tree, [0], regime=0)  # node 0 verified by the step itself: not counted here
    sh.advance("a", [4], stats)  # depth 2 and 3 undecided
    assert not stats.proposed
    sh.advance("a", [5, 9], stats)
    assert stats.proposed == {(0, 2, 9): 1.0, (0, 3, 9): 1.0}
    assert stats.accepted == {(0, 2, 9): 1.0, (0, 3, 9): 0.0}
    sh.note("b", tree, [], regime=1)
    sh.advance("b", [3], stats)  # the root's child is wrong: everything under it is decided
    assert stats.proposed[(1, 1, 9)] == 1.0 and stats.proposed[(1, 3, 9)] == 1.0
    sampled = DraftTree(tree.tokens, tree.parents, tree.depths, tree.scores, q=torch.ones(3, 10))
    sh.note("c", sampled, [], regime=2)  # rejection-sampled drafts are not scored
    assert "c" not in sh.pending


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_shadow_verdict_is_the_verifier_verdict(temperature: float) -> None:
    """The premise of goodput.shadow: a deterministic draft node is accepted exactly when its
    path equals the tokens committed after its root. Checked on every verified tree of real
    decoding (greedy, and seeded sampling at temperature 1) with a flat curve that verifies
    everything the suffix drafter proposes."""
    from specpilot.goodput.shadow import decide

    eng = _engines(True)
    eng.generate(PROMPTS[0], GEN, drafter=SuffixDrafter())  # makes the selector
    assert eng.selector is not None
    eng.selector = Selector(CostCurve([1, 64], [0.010, 0.0101], smoothing=0.0))
    checked = []
    orig = eng.selector.observe

    def observe(trees, paths, verify_s, packed=False, regimes=None, committed=None, keys=None):
        assert committed is not None
        for t, p, toks in zip(trees, paths, committed, strict=True):
            if t.size:
                checked.append(t.size)
                assert decide(t, toks) == [i in set(p) for i in range(t.size)]
        orig(trees, paths, verify_s, packed, regimes, committed, keys)

    eng.selector.observe = observe  # type: ignore[method-assign]
    gen = GenerationConfig(max_new_tokens=40, stop_on_eos=False, temperature=temperature, seed=7)
    for p in PROMPTS:
        eng.generate(p, gen, drafter=SuffixDrafter(), spec=TreeSpec(kind="chain", k=4))
    assert sum(checked) >= 20


def test_a_draft_that_caught_up_is_followed_by_one_that_times_a_steady_draft() -> None:
    """The first draft of a context catches up on the prompt (a head at batch 4: 15-30 ms
    against ~3.5 ms a steady step); judged by that cost alone the drafter never drafted two
    steps in a row, so its steady cost was never measured and it stayed off where it paid.
    One more draft follows a catch-up until a steady one is timed; after that, plain decoding
    holds until the next probe."""
    flat = CostCurve([1, 2], [0.010, 0.020])
    sel = Selector(flat, probe_every=8)
    weak = DraftTree.chain([1, 2], [math.log(0.3), math.log(0.1)])
    assert sel.should_draft()
    sel.note_draft(0.030)  # a catch-up
    sel.select([weak])
    assert sel.full_on is False and sel.draft_s == 0.030
    assert sel.should_draft()  # once more: a steady draft
    sel.note_draft(0.002)
    sel.select([weak])
    assert sel.draft_s == 0.002 and sel.probe_s == 0.030
    assert not sel.should_draft()  # steady cost known: back to the probes' backoff


def test_a_first_step_that_no_draft_could_pay_for_does_not_draft() -> None:
    """Before anything was drafted, a batch whose next token is worth only its row (nothing
    waiting) skips the first draft when even a perfect chain drafted for free could not pay for
    its rows; with a queue, or where rows are cheap, the first step drafts as before."""
    dear = CostCurve([1, 8, 16, 32, 64], [0.010, 0.012, 0.016, 0.028, 0.060])
    sel = Selector(dear)
    sel.token_value = sel.idle_value(32)
    assert sel.token_value < 1
    assert not sel.should_draft(32)
    sel.note_skip()
    assert sel.idle == 0 and sel.full_on is False  # plain decoding chosen
    asked = 0
    real = sel.could_pay

    def counted(*a: Any, **k: Any) -> bool:
        nonlocal asked
        asked += 1
        return real(*a, **k)

    sel.could_pay = counted  # type: ignore[method-assign]
    for _ in range(40):
        assert not sel.should_draft(32)
        sel.note_skip()
    assert 1 <= asked <= 3  # asked again at its probes only, backing off
    sel.token_value = 1.0  # a queue: a token is worth a slot's share of the step
    sel.idle = sel.max_probe_gap
    assert sel.should_draft(32)  # its probe drafts
    cheap_rows = Selector(CostCurve([1, 8, 16, 32, 64], [0.010, 0.0101, 0.0102, 0.0104, 0.0108]),
                          seq_share=0.0)  # nothing but rows costs
    cheap_rows.token_value = cheap_rows.idle_value(32)
    assert cheap_rows.should_draft(32)


def test_a_sequence_with_nodes_costs_a_share_of_a_step_beside_its_rows() -> None:
    """A packed batch's step costs its rows (the curve) plus, per sequence with nodes, a share of
    a one-row step (accepting and committing its tree): nodes over 32 sequences that pay by the
    rows alone do not; the curve learns the rows' cost only."""

    def cost(rows: int) -> float:
        return 0.010 + 0.001 * rows

    def curve() -> CostCurve:
        return CostCurve([1, 8, 16, 32, 64], [cost(r) for r in (1, 8, 16, 32, 64)])

    sure = [DraftTree.chain([1], [math.log(0.95)])] * 32
    rows_only = Selector(curve(), seq_share=0.0)
    assert sum(t.size for t in rows_only.select(sure, packed=True)) > 0
    sel = Selector(curve(), seq_share=0.2)  # 2.2 ms a sequence
    assert sel.seq_cost() == pytest.approx(0.2 * cost(1))
    assert sum(t.size for t in sel.select(sure, packed=True)) == 0
    one = [DraftTree.chain([1, 2], [0.0, 0.0])] * 8 + [DraftTree.empty()] * 24
    for _ in range(30):  # 48 rows, 8 sequences with nodes, as the model says
        sel.observe(one, [[]] * 32, cost(48) + 8 * sel.seq_cost(), packed=True)
    assert sel.curve(48) == pytest.approx(cost(48), rel=0.01)
    assert sel.log[-1][2] == pytest.approx(cost(48) + 8 * sel.seq_cost(), rel=0.01)


def test_no_cheap_probe_where_no_draft_could_pay_with_nothing_waiting() -> None:
    """While a token is worth less than a step's share (nothing waiting), the cheap parts'
    probes are skipped when not even certain chains could pay for their drafting; with a
    queue they run."""
    flat = CostCurve([1, 8, 16, 32, 64], [0.020, 0.024, 0.030, 0.044, 0.080])
    sel = Selector(flat)
    sel.note_draft(0.0004, cheap=True)  # past cheap_draft: judged by its edge
    sel.recent = [[0.9, 0.8]]
    sel.cheap_edge = -0.1  # its trees did not pay lately
    sel.token_value = sel.idle_value(32)
    assert not any(sel.cheap_tier(32) for _ in range(40))
    sel.token_value = 1.0
    assert any(sel.cheap_tier(32) for _ in range(40))
