"""The goodput budget's per-engine state (:class:`Selector`): the cost curve, the acceptance
statistics, the drafting costs, the last choice with its hysteresis, the probes while plain
decoding wins, and the tiers of a tiered drafter (its cheap part alone every step, the full
drafter only while it pays over that)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specpilot.errors import ConfigError
from specpilot.goodput.acceptance import AcceptanceStats, node_gains
from specpilot.goodput.choice import Choice, best_nodes, choose, choose_packed, spent_goodput
from specpilot.goodput.cost import CostCurve
from specpilot.goodput.shadow import Shadow
from specpilot.tree import DraftTree, subtree

__all__ = ["Selector"]


@dataclass
class Selector:
    """Per-engine state of the goodput budget: the curve, the acceptance statistics, the last
    choice (hysteresis) and the drafting time per step."""

    curve: CostCurve
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    hysteresis: float = 0.05
    """A new width replaces the last one only if its predicted goodput is this much higher."""
    probe_every: int = 8
    """While plain decoding wins, still draft every this many steps to keep the estimates
    fresh (the drafter sees every committed token either way)."""
    max_probe_gap: int = 64
    """A probe that still chooses plain decoding doubles the gap to the next one, up to this
    many steps (a probe drafts for every sequence: at a large batch, where a node rarely pays,
    probing every ``probe_every`` steps costs more than it finds); choosing nodes resets it."""
    probe_gap: int = 0
    """Steps between probes now (0: ``probe_every``)."""
    draft_s: float = 0.0
    """Moving average of drafting seconds per drafting sequence on a step after a drafted one
    (a step's drafting costs this times the sequences that draft, while the drafter drafts
    every step; the first reading of any kind until such a step is seen)."""
    probe_s: float = 0.0
    """The same for drafts after skipped steps or at a prompt, where the drafter first
    catches up on the target states it missed (a head drafted in ~3 ms a step and in 10-25 ms
    after a gap: counted in one average, that held it off where it paid)."""
    _fresh: bool = True
    _steady: bool = False
    probe_sequences: int = 4
    """A probe (a draft while plain decoding wins) asks at most this many sequences of a batch,
    in turn: each drafter proposing also catches up on the target states of the steps it
    skipped, and a large batch paid that for every sequence at every probe. Their gains decide;
    once nodes are chosen again, every sequence drafts."""
    last: Choice | None = None
    idle: int = 0
    """Steps since the selector last drafted."""
    curve_source: str = "measured"
    """Where the curve came from (:attr:`specpilot.goodput.curve.MeasuredCurve.source`)."""
    log: list[tuple[int, int, float, float]] = field(default_factory=list)
    """(batch, rows, predicted verify s, actual verify s) of the last steps (metrics,
    reports)."""
    steps: int = 0
    plain_steps: int = 0
    """Steps verified without draft nodes."""

    shadow: Shadow = field(default_factory=Shadow)
    """Unverified draft nodes waiting for the tokens that decide them
    (:mod:`specpilot.goodput.shadow`), then counted in :attr:`stats`."""
    _drafted: list[tuple[DraftTree, list[int], int]] | None = None
    """This step's drafted trees, the nodes kept of each, and their regimes (:meth:`select`,
    consumed by :meth:`observe`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.hysteresis < 1:
            raise ConfigError(f"goodput hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.probe_every < 1:
            raise ConfigError(f"goodput probe_every must be >= 1, got {self.probe_every}")

    recent: list[list[float]] = field(default_factory=list)
    """The calibrated gains of the trees drafted lately (up to ``recent_trees``, the best
    ``probe_sequences`` of a step): the best case :meth:`could_pay` judges by."""
    recent_trees: int = 16
    max_bound_skips: int = 2
    """Probes in a row :meth:`could_pay` may skip (then one runs anyway: the trees it judges
    by are only refreshed by drafting, and a new context may suit the drafter again)."""
    bound_skips: int = 0
    perfect_depth: int = 8
    """The depth of the perfect chain :meth:`could_pay` judges by before anything was drafted."""
    cheap_draft: float = 0.01
    """Drafting that costs at most this fraction of a plain step (all drafting sequences
    together) runs every step, for every sequence, even while plain decoding wins: probing by
    backoff saves next to nothing there and misses the start of a copy run. (At 3%, a suffix
    part of 0.1-0.2 ms against a 7.4 ms step ran on every step of sampled chat, where it never
    paid: 2-3% of the time. Dearer parts are judged by their edge, :meth:`cheap_tier`.)"""
    _every: bool = False
    cheap_s: float = 0.0
    """Moving average of a tiered drafter's cheap part drafting alone, seconds per sequence
    (:class:`specpilot.drafters.base.Tiered`)."""
    full_pays: bool | None = None
    """The last full draft's verdict against its cheap part alone (a tiered drafter): whether
    the dear part's nodes bought their drafting; None: no such comparison, the verdict is
    whether the last choice verified nodes at all (:attr:`full_on`)."""
    cheap_steps: int = 0
    """Steps whose trees came from cheap parts only."""
    edge: float = 0.0
    """Moving average of log(full choice's goodput / cheap parts' choice's) over the full
    drafts of tiered drafters while the full drafter runs every step; a probe starts it afresh
    (:meth:`_full_edge`)."""
    edge_smoothing: float = 0.3
    cheap_edge: float | None = None
    """Moving average of log(goodput of the cheap parts' choice, their drafting included /
    plain decoding's) over the steps they drafted alone and, as the alternative, the full
    drafts of tiered drafters (:meth:`cheap_tier`); None until the first."""
    cheap_gap: int = 0
    """Steps between the cheap parts' probes while their edge is below 0 (0: ``probe_every``),
    doubled after each probe up to ``max_cheap_gap``, reset when the edge turns positive."""
    max_cheap_gap: int = 16
    """The cheap parts' longest gap between probes: a probe costs one cheap draft (~0.1-0.4 ms,
    no catch-up worth the name), and each step of the gap can miss the start of a copy run."""
    cheap_idle: int = 0
    """Steps the cheap parts sat out since their last draft (:meth:`cheap_tier`)."""

    seq_share: float = 0.05
    """What a sequence with draft nodes adds to a packed verify step beside its rows (accepting
    and committing its tree, its own attention call), as a share of a one-row step
    (:meth:`seq_cost`). The curve is measured on one sequence and misses it: on a 2-core EPYC,
    64 rows cost 78 ms in one sequence and 92 ms in 32 (``bench/verify_shapes.py``), ~0.43 ms
    a sequence against a 7.5 ms one-row step, and at 32 sequences the budget chose steps of
    48-136 rows predicted at 63-126 ms that took 77-169 (0.93x batched plain decoding). Learned
    online beside the curve it was not identifiable (a sequence's nodes grow the rows too, and
    the curve took all of it), so it is this measured share."""
    token_value: float = 1.0
    """What one accepted draft token is worth against a plain step's token (a batch slot's
    share of the step) on this step: 1 while a freed slot is refilled (a queue, or unknown),
    :meth:`idle_value` once nothing waits; the engine sets it before each step."""

    def idle_value(self, batch: int) -> float:
        """What an accepted token is worth when no request waits for a slot: the run ends with
        its last sequence, so a sequence that finishes early frees nothing and a token saves
        only the cost of that sequence's row in the steps left (the curve's cost of one more
        row) instead of its share of a step (the step / ``batch``). A 32-sequence step of 44
        ms grew ~0.2 ms a row: nodes that paid by the share (1.4 ms a token) lost by the
        makespan, 0.88x of batched plain decoding on chat. 1 for one sequence."""
        if batch <= 1:
            return 1.0
        step = self.curve(batch)
        if step <= 0:
            return 1.0
        return min(1.0, max(0.0, step - self.curve(batch - 1)) * batch / step)

    @property
    def full_on(self) -> bool | None:
        """Whether the full drafter runs every step (None: not known yet, the first step)."""
        if self.last is None:
            return None
        return self.full_pays if self.full_pays is not None else self.last.width > 0

    def cheap_tier(self, batch: int = 1) -> bool:
        """Whether a tiered drafter's cheap part drafts alone for ``batch`` sequences on a step
        the full drafter sits out: while its cost is at most :attr:`cheap_draft` of a plain
        step, or while its trees pay for their drafting (:attr:`cheap_edge`: not yet known, or
        above 0; at batch 4 a suffix drafter's 0.3-0.4 ms a sequence is a tenth of a step, and
        its copy runs still paid for it). Below 0 they probe, backing off like the full
        drafter (:attr:`cheap_gap`): the edge is only updated by drafting, and without probes
        one unpaid patch sat the suffix part out for the rest of the sequence, the copy runs
        that come later in a HumanEval answer included (tau 1.17 with the head against 1.52
        for the suffix drafter alone, once a plain step cost 4.4 ms and a suffix draft 0.3);
        their gap grows to :attr:`max_cheap_gap` only."""
        if self.cheap_s * batch <= self.cheap_draft * self.curve(batch):
            return True
        if self.cheap_edge is None or self.cheap_edge > 0:
            return True
        self.cheap_idle += 1
        if self.cheap_idle < (self.cheap_gap or self.probe_every):
            return False
        self.cheap_idle = 0
        gap = self.cheap_gap or self.probe_every
        self.cheap_gap = min(max(self.max_cheap_gap, self.probe_every), 2 * gap)
        return self.token_value >= 1 or self._cheap_could_pay(batch)

    def _cheap_could_pay(self, batch: int) -> bool:
        """Whether the cheap parts' probe could choose nodes in the best case: every sequence a
        chain of certain nodes as deep as the widest tree seen lately, at the cheap parts'
        drafting cost for all ``batch`` sequences. Asked at their probes while a token is worth
        less than a step's share (:meth:`idle_value`): at 32 sequences with nothing waiting
        no node pays, and a probe every 16 steps drafted for all 32 (~0.4 ms each)."""
        if not self.recent or self.cheap_s <= 0:
            return True
        return self._pays([1.0] * max(map(len, self.recent)), batch, batch, self.cheap_s)

    def cheap(self, batch: int = 1) -> bool:
        """Whether drafting for ``batch`` sequences is cheap enough to run every step
        (:attr:`cheap_draft`; False while its cost is unmeasured)."""
        return 0 < self.draft_s * batch <= self.cheap_draft * self.curve(batch)

    def should_draft(self, batch: int = 1) -> bool:
        """Whether to run the drafter this step for a batch of ``batch`` sequences (False while
        plain decoding wins, except for a probe every ``probe_every`` steps, backing off; a
        probe that even the best case seen lately says cannot pay is skipped, at most
        ``max_bound_skips`` in a row, and backs off like one that chose plain decoding: see
        :meth:`could_pay`; a new sequence carries the backoff over or starts it afresh:
        :meth:`begin_sequence`). Cheap drafting (:meth:`cheap`) always runs. Until a draft
        right after a draft has been timed, a draft that caught up (the prompt, skipped steps)
        is followed by one more: its cost stood in for a steady draft's (a head's first draft
        at batch 4 read 22-30 ms against 3.6 ms steady), and held the drafter off where it
        paid."""
        gap = self.probe_gap or self.probe_every
        self._every = self.cheap(batch)
        if (self.full_on is None and self.token_value < 1
                and not self.could_pay(batch, perfect=True)):  # fmt: skip
            # the first step, but no draft could pay (32 sequences, none waiting): plain decoding
            # is the choice, and later steps ask again only at its probes (asked every step,
            # the check alone cost ~2% of a 32-sequence step)
            self.last = Choice(0, self.curve(batch), float(batch))
            return self._skip_probe()
        if self.full_on is not False or self._every:
            return True
        caught_up = not self._steady and self.draft_s > 0 and self.idle == 0 and not self._fresh
        if caught_up and (self.token_value >= 1 or self.could_pay(batch, perfect=True)):
            return True  # the last draft caught up: one more times a steady one
        if self.idle + 1 < gap:
            return False
        if self.token_value < 1 and not self.could_pay(batch, perfect=True):  # none could
            return self._skip_probe()
        if self.bound_skips < self.max_bound_skips and not self.could_pay(batch):
            self.bound_skips += 1
            return self._skip_probe()
        self.bound_skips = 0
        return True

    def begin_sequence(self) -> None:
        """A new context (a single sequence, or the first of a batch that was empty): its first
        step drafts (a fresh prompt may suit the drafter, whatever the last one did). Where the
        last one ended with plain decoding winning (the full drafter out), the probes' backoff
        carries over at half its gap, else it starts afresh: started afresh per prompt, a head
        that never paid on sampled chat probed at 8, 24 and 56 steps of every 96-token prompt
        (3-10 ms each, catching up on the steps it skipped). After such a sequence the steady
        draft cost is timed again (the draft after the first)."""
        carry = self.full_on is False
        self.probe_gap = max(self.probe_every, self.probe_gap // 2) if carry else 0
        # the steady draft cost is only timed by steady drafts, which stop while plain decoding
        # wins: time one again after this sequence's first draft (one slow early reading had
        # sat a head out of a whole HumanEval run)
        self._steady = self._steady and not carry
        self.idle, self.bound_skips, self.last = 0, 0, None
        self.full_pays, self.cheap_edge, self._fresh = None, None, True
        self.cheap_gap, self.cheap_idle = 0, 0
        self.shadow.clear()
        self._drafted = None

    def could_pay(self, batch: int = 1, perfect: bool = False) -> bool:
        """Whether a probe of ``batch`` sequences could choose nodes in the best case seen
        lately: each sequence a probe asks (``probe_sequences``) proposing the tree of highest
        expected acceptance among the last ``recent_trees`` drafted (their calibrated gains), at
        the measured drafting cost. At a large batch a drafted sequence's extra
        tokens rarely buy its drafting time, and a probe there was pure cost. True while nothing
        is known (no drafting time or acceptance measured yet). ``perfect``: each tree a chain
        as deep as the widest seen, every node certain (False: no draft could pay here, as
        with nothing waiting at 32 sequences, :meth:`idle_value`; probes are skipped then);
        with nothing drafted yet, a chain of :attr:`perfect_depth` drafted at no cost."""
        cost = self.probe_s or self.draft_s  # a probe's drafter catches up first
        if perfect and not self.recent:  # nothing drafted yet: a deep chain, drafted for free
            cost, best = 0.0, [1.0] * self.perfect_depth
        elif cost <= 0 or not self.recent:
            return True
        elif perfect:
            best = [1.0] * max(map(len, self.recent))
        else:
            best = max(self.recent, key=sum)  # gains as calibrated when drafted
        return self._pays(best, min(batch, max(1, self.probe_sequences)), batch, cost)

    def _pays(self, best: list[float], k: int, batch: int, cost: float) -> bool:
        """Whether ``k`` of ``batch`` sequences, each proposing a tree of node gains ``best``
        (valued at :attr:`token_value`) at ``cost`` seconds of drafting each, would verify
        nodes."""
        best = [g * self.token_value for g in best]
        gains = [best] * k + [[] for _ in range(batch - k)]
        if batch > 1:
            return choose_packed(gains, self.curve, cost * k, seq_s=self.seq_cost())[0].width > 0
        return choose(gains, self.curve, cost).width > 0

    def _skip_probe(self) -> bool:
        """Sit out a probe as if it had run and chosen plain decoding (backing off); False."""
        self.idle = -1  # the caller's note_skip makes it 0: counted as after a probe
        self._next_probe(False)
        return False

    def _next_probe(self, paid: bool) -> None:
        """Back off after a probe whose full draft did not pay; reset once one does."""
        if paid:
            self.probe_gap = self.probe_every
        elif self.full_on is False:
            gap = self.probe_gap or self.probe_every
            self.probe_gap = min(max(self.max_probe_gap, self.probe_every), 2 * gap)

    def select(self, trees: Sequence[DraftTree], packed: bool = False,
               drafted: int | None = None, regimes: Sequence[int] | None = None,
               cheap: int = 0,
               alternative: Sequence[DraftTree] | None = None) -> list[DraftTree]:  # fmt: skip
        """Cut every tree to this step's budget (all empty for plain decoding); ``packed``: the
        verify costs the rows the trees have (:func:`choose_packed`), else B x the widest.
        ``drafted``: sequences whose full drafter ran (default: all; a probe asks fewer);
        ``cheap``: sequences whose tiered drafter's cheap part drafted alone; ``regimes``: each
        sequence's (:func:`next_regime`; default 0). ``alternative``: on a step with full drafts
        by tiered drafters, each sequence's cheap-part tree (the others' own trees): the full
        drafter keeps drafting every step only while its choice beats the alternative's."""
        regimes = regimes if regimes is not None else [0] * len(trees)
        raw = [node_gains(t, self.stats, r) for t, r in zip(trees, regimes, strict=True)]
        gains = self._valued(raw)
        full = len(trees) if drafted is None else drafted
        draft_s = self.draft_s * full + self.cheap_s * cheap
        packed = packed and len(trees) > 1
        new, counts = self._choose(gains, draft_s, packed)
        if full:
            drafted_gains = sorted((g for g in raw if g), key=sum, reverse=True)
            fresh = drafted_gains[: self.probe_sequences]
            self.recent = [*self.recent, *fresh][-self.recent_trees :]
            paid = new.width > 0
            if alternative is not None:
                alt_raw = [node_gains(t, self.stats, r)
                           for t, r in zip(alternative, regimes, strict=True)]  # fmt: skip
                alt_gains = self._valued(alt_raw)
                alt_s = self.cheap_s * (full + cheap)
                alt = self._choose(alt_gains, alt_s, packed, False)[0]
                paid = self._full_edge(new, draft_s, alt, alt_s)
                self._cheap_edge(alt, alt_s, len(trees))
            self._next_probe(paid)
            self.full_pays = paid if alternative is not None else None
        if not full and cheap:
            self.cheap_steps += 1
            self._cheap_edge(new, draft_s, len(trees))
        self.last = new
        out = []
        self._drafted = []
        for t, g, k, r in zip(trees, gains, counts, regimes, strict=True):
            keep = best_nodes(t, g, k)
            out.append(t if len(keep) == t.size else subtree(t, keep))
            self._drafted.append((t, keep, r))
        return out

    def _valued(self, gains: list[list[float]]) -> list[list[float]]:
        """Node gains in plain-step tokens (:attr:`token_value`)."""
        v = self.token_value
        return gains if v == 1.0 else [[g * v for g in gs] for gs in gains]

    def _full_edge(self, full: Choice, full_s: float, alt: Choice, alt_s: float) -> bool:
        """Whether the full drafter pays over its cheap parts alone: the moving average of
        their goodputs' log ratio (one step's trees are a noisy sample of the drafter's worth:
        a head that adds a token on half the steps stopped at the first step it added none)
        above 0 while it runs every step, above the hysteresis to start again after a
        probe. Each side counts the drafting it spent (``full_s``, ``alt_s``), also where it
        chose plain decoding (:func:`spent_goodput`): two plain choices used to tie, and the
        average, only decaying towards 0, kept 8 heads drafting on 343 of a server's 1,215 steps
        at tau 1.04 (BENCHMARKS.md, 2026-12-08)."""
        if (gf := spent_goodput(full, full_s)) <= 0 or (ga := spent_goodput(alt, alt_s)) <= 0:
            return False
        x = math.log(gf / ga)
        on = self.full_on is True and self.full_pays is not None
        self.edge = (1 - self.edge_smoothing) * self.edge + self.edge_smoothing * x if on else x
        return self.edge > (0.0 if on else math.log1p(self.hysteresis))

    def _cheap_edge(self, c: Choice, draft_s: float, batch: int) -> None:
        """Fold one step's cheap-part choice into :attr:`cheap_edge` (its drafting is spent
        even where it chose plain decoding)."""
        got = spent_goodput(c, draft_s)
        plain = batch / self.curve(batch)
        if got <= 0 or plain <= 0:
            return
        x = math.log(got / plain)
        old = self.cheap_edge
        a = self.edge_smoothing
        self.cheap_edge = x if old is None else (1 - a) * old + a * x
        if self.cheap_edge > 0:
            self.cheap_gap, self.cheap_idle = 0, 0

    def _choose(self, gains: list[list[float]], draft_s: float, packed: bool,
                hold: bool = True) -> tuple[Choice, list[int]]:  # fmt: skip
        """This step's choice and nodes per sequence (:func:`choose_packed` or :func:`choose`);
        ``hold``: with hysteresis against the last choice's width."""

        def pick(limit: int | None) -> tuple[Choice, list[int]]:
            if packed:
                return choose_packed(gains, self.curve, draft_s, limit, self.seq_cost())
            c = choose(gains, self.curve, draft_s, limit)
            return c, [c.width] * len(gains)

        new = pick(None)
        keep = self.last.width if self.last is not None and hold else new[0].width
        if keep != new[0].width and (packed or keep <= max(map(len, gains), default=0)):
            old = pick(keep)
            if new[0].goodput <= old[0].goodput * (1 + self.hysteresis):
                new = old
        return new

    @property
    def probing(self) -> bool:
        """This draft is a probe: the last choice was plain decoding or there is none yet (the
        first step of a batch), and drafting is not cheap enough to run for every sequence
        (:meth:`cheap`). A first step that asked every sequence of a 32-sequence batch paid
        32 prompt catch-ups (0.27 s of a 6.2 s HumanEval run) where nodes never paid."""
        return self.full_on is not True and not self._every

    def note_draft(self, seconds: float, sequences: int = 1, cheap: bool = False,
                   catchup: bool | None = None) -> None:  # fmt: skip
        """``seconds`` of drafting by ``sequences`` drafters this step; ``cheap``: by tiered
        drafters' cheap parts alone (the full drafter sat the step out: :meth:`note_skip`);
        ``catchup``: drafters that did not draft the step before (a prompt, skipped steps:
        they caught up first; None: judged by this selector's own last steps, right for one
        sequence)."""
        per = seconds / max(1, sequences)
        if cheap:
            self.cheap_s = _average(self.cheap_s, per)
            return
        if catchup is None:
            catchup = self.idle > 0 or self._fresh
        if catchup:
            self.probe_s = _average(self.probe_s, per)
            if self.draft_s == 0:
                self.draft_s = per
        else:
            self.draft_s = per if not self._steady else _average(self.draft_s, per)
            self._steady = True
        self.idle, self._fresh = 0, False

    def note_skip(self) -> None:
        self.idle += 1

    def observe(
        self,
        trees: Sequence[DraftTree],
        paths: Sequence[Sequence[int]],
        verify_s: float,
        packed: bool = False,
        regimes: Sequence[int] | None = None,
        committed: Sequence[Sequence[int]] | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> None:
        """After a step: acceptance statistics (each tree in the regime it was selected in) and
        the curve at the step's rows. ``committed``: the tokens each sequence committed this
        step, which decide the drafted nodes this step did not verify (:attr:`shadow`);
        ``keys``: the sequences' identities across steps (default: their positions)."""
        regimes = regimes if regimes is not None else [0] * len(trees)
        for t, p, r in zip(trees, paths, regimes, strict=True):
            if t.size:
                self.stats.observe(t, p, r)
        drafted, self._drafted = self._drafted, None
        if committed is not None:
            keys = keys if keys is not None else range(len(committed))
            if drafted is not None and len(drafted) == len(committed):
                for key, (raw, keep, r) in zip(keys, drafted, strict=True):
                    if raw.size:
                        self.shadow.note(key, raw, keep, r)
            if self.shadow.pending:  # nothing waits on most plain steps
                for key, toks in zip(keys, committed, strict=True):
                    self.shadow.advance(key, toks, self.stats)
        width = max((t.size for t in trees), default=0)
        rows = len(trees) + sum(t.size for t in trees) if packed else len(trees) * (1 + width)
        seqs = sum(t.size > 0 for t in trees) if packed and len(trees) > 1 else 0
        extra = self.seq_cost() * seqs  # not the rows': the curve learns the rows' cost
        self.log.append((len(trees), rows, self.curve(rows) + extra, verify_s))
        del self.log[:-256]
        self.steps += 1
        self.plain_steps += width == 0
        self.curve.observe(rows, verify_s - extra)

    def seq_cost(self) -> float:
        """Seconds a sequence with draft nodes adds to a packed verify step beside its rows
        (:attr:`seq_share` of a one-row step)."""
        return self.seq_share * self.curve(1)

    def summary(self) -> dict[str, Any]:
        """Steps, plain steps, mean predicted and measured verify time of the logged steps, the
        curve and whether it was measured or cached (what ``bench`` and ``/metrics`` show)."""
        n = max(len(self.log), 1)
        return {
            "steps": self.steps,
            "plain_steps": self.plain_steps,
            "cheap_steps": self.cheap_steps,
            "draft_ms": 1e3 * self.draft_s,
            "probe_draft_ms": 1e3 * self.probe_s,
            "cheap_draft_ms": 1e3 * self.cheap_s,
            "predicted_ms": 1e3 * sum(e[2] for e in self.log) / n,
            "actual_ms": 1e3 * sum(e[3] for e in self.log) / n,
            "mean_rows": sum(e[1] for e in self.log) / n,
            "curve": {"rows": list(self.curve.rows), "seconds": list(self.curve.seconds)},
            "curve_source": self.curve_source,
        }


def _average(mean: float, x: float) -> float:
    """Moving average of drafting seconds (0 = none yet); one reading counts at most 4x the
    mean (a collection or a stalled core made one suffix draft of ~0.2 ms take 120 ms, and the
    average then held the cheap part dear for ~20 steps).

    >>> _average(0.0, 0.5), round(_average(1.0, 2.0), 6), round(_average(1.0, 100.0), 6)
    (0.5, 1.2, 1.6)
    """
    return x if mean == 0 else 0.8 * mean + 0.2 * min(x, 4 * mean)
