"""Batched speculative decoding: several sequences per target step, ragged acceptance.

One batched cache holds every running sequence in its own row; sequences are packed into rows
``[0, n)`` (a finished sequence's row is refilled by the last one). Each sequence keeps its own
cache length; a step verifies every row's root and draft tree in one forward through
:func:`specpilot.verify.verify_step` (the layout and pad rows are described there) and each row
commits its own accepted path plus one token (ragged acceptance). Every real row sees exactly the
keys it would see decoded alone, and with the batch-invariant kernels of :mod:`specpilot.model`
(oneDNN GEMMs, fp64 attention) its logits are the same bits, so batched speculative greedy output
equals each sequence decoded alone.

Verify budget. Verification work grows with the batch, so the node budget must shrink with it
(vLLM #6494, #19254): :class:`VerifyBudget` maps batch size to nodes per sequence, and
:func:`allocate_nodes` spends the batch's total budget on the nodes with the highest expected gain
across all requests (TETRIS, Wu et al. 2025): a node's gain is the probability its path is
accepted, ``exp(score)`` with the drafter's cumulative log-probability score.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from specpilot.drafters.base import DraftContext, Drafter, is_tiered, propose_all
from specpilot.engine import (
    EngineConfig,
    GenerationConfig,
    GenerationResult,
    Stopper,
    TokenCallback,
    frozen_heap,
    join_chunks,
)
from specpilot.errors import ConfigError, ContextLengthError
from specpilot.goodput import Selector, allocate_nodes, next_regime
from specpilot.goodput.choice import VerifyBudget
from specpilot.goodput.curve import selector_curve
from specpilot.model import Transformer
from specpilot.profiling import kernel_range
from specpilot.sampling import Sampler
from specpilot.tree import DraftTree, TreeSpec
from specpilot.verify import VerifyRow, check_fixed_spec, prefill, verify_step

_EMPTY = DraftTree.empty()
"""The tree of a sequence that does not draft this step: one shared instance (trees are read,
never written), not four fresh tensors per sequence and step."""


@dataclass(frozen=True)
class BatchConfig:
    """Shape of the batched cache and the verify budget."""

    max_batch: int = 8
    """Sequences decoded together (rows of the cache)."""
    max_len: int = 1024
    """Cache slots per sequence: prompt + new tokens + draft nodes (one more is scratch)."""
    budget: VerifyBudget = field(default_factory=VerifyBudget)
    min_gain: float = 0.0
    """Verify only draft nodes whose expected gain (path acceptance probability, ``exp(score)``)
    is at least this; 0 = every node the budget allows. A verified row costs target compute, so
    at large batch sizes unlikely nodes cost more than they return."""
    packed: bool = True
    """Run the verify forward's row-wise work on the real rows only (no padding to the widest
    tree; :class:`specpilot.model.Packing`); the output is the same bits either way."""

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.max_batch}")
        if self.max_len < 8:
            raise ConfigError(f"max_len must be >= 8 cache slots, got {self.max_len}")
        if not 0 <= self.min_gain <= 1:
            raise ConfigError(f"--min-gain must be in [0, 1], got {self.min_gain}")


@dataclass
class BatchRequest:
    """One sequence to decode in a batch."""

    prompt: list[int]
    gen: GenerationConfig
    drafter: Drafter | None = None
    spec: TreeSpec | None = None
    on_tokens: TokenCallback | None = None
    """Called from the decoding thread with each step's newly committed tokens."""


@dataclass
class Slot:
    """A running sequence: its row of the cache, committed tokens and result so far."""

    req: BatchRequest
    row: int
    committed: list[int]
    res: GenerationResult
    sampler: Sampler
    stopper: Stopper
    spec: TreeSpec
    hidden: list[tuple[Tensor, ...]] = field(default_factory=list)
    """Target states the drafter has not seen yet, one entry per forward (prefill, steps):
    joined once when the drafter is next asked, so a step that skips drafting only appends
    (concatenating every step copied the whole backlog, the prompt's states included)."""
    t_admit: float = 0.0
    done: bool = False
    regime: int = 0
    """The goodput budget's record of this sequence's recent acceptance
    (:func:`specpilot.goodput.next_regime`)."""
    full_at: int = -1
    """The engine step after this sequence's last full draft (a draft at that step is one in
    a row: no catch-up; :meth:`BatchEngine._propose`)."""

    def take_context(self) -> DraftContext:
        """The drafter's context for this step; the target states it has not seen go to it."""
        ctx = DraftContext(self.committed, self.res.prompt_len, self.spec, join_chunks(self.hidden))
        self.hidden = []
        return ctx

    @property
    def cache_len(self) -> int:
        """Committed tokens in the cache (the root, ``committed[-1]``, is not yet)."""
        return len(self.committed) - 1


@dataclass(frozen=True)
class StepStats:
    """What one batched target step did (for metrics)."""

    batch: int
    nodes: int
    """Draft nodes verified over the batch."""
    accepted: tuple[int, ...]
    """Accepted draft tokens per sequence."""
    seconds: float
    predicted_verify_s: float | None = None
    """With the goodput budget: its predicted time of :attr:`verify_s`."""
    verify_s: float = 0.0
    """The verify step: the target's forward, acceptance and commit of the cache."""
    draft_s: float = 0.0
    """Drafting and the budget's choice (before the verify forward)."""
    drafted: str = "none"
    """What drafted (:attr:`BatchEngine.drafted`)."""


class BatchEngine:
    """Owns the target model and a batched cache; steps all running sequences together.

    Single-threaded: one thread calls :meth:`add`, :meth:`step` and :meth:`remove`.
    """

    def __init__(
        self,
        model: Transformer,
        cfg: EngineConfig | None = None,
        bcfg: BatchConfig | None = None,
        eos_ids: Sequence[int] = (),
        detok: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.cfg = cfg or EngineConfig()
        self.bcfg = bcfg or BatchConfig()
        if self.cfg.threads is not None:
            torch.set_num_threads(self.cfg.threads)
        self.model = model
        self.attention = self.cfg.resolved_attention
        model.prepack(self.cfg.linear)
        self.max_len = min(self.bcfg.max_len, model.cfg.max_position + 1)
        self.eos_ids = tuple(eos_ids)
        self.detok = detok
        self.slots: list[Slot] = []
        self.selector: Selector | None = None
        """The goodput budget's state (``cfg.goodput``)."""
        self.waiting: int | None = None
        """Requests queued for a free row (set by :func:`run_batch` before each step); None:
        unknown, taken as a queue (a server: each request's latency counts). With none
        waiting, the goodput budget values a draft token by the makespan
        (:meth:`~specpilot.goodput.selector.Selector.idle_value`)."""
        self._probe_at = 0
        self.drafted = "none"
        """What drafted in the last step: none, full (every step's drafter) or probe (a draft
        while plain decoding wins), each maybe with +cheap (tiered drafters' cheap parts)."""
        self._steps = 0
        """Batched steps run so far."""
        """Where the next probe starts asking (:meth:`_probe_slots`)."""

    # -- admission -----------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return self.bcfg.max_batch - len(self.slots)

    def check(self, req: BatchRequest, drafted: bool | None = None) -> None:
        """Raise ContextLengthError / ConfigError if ``req`` can never run here. ``drafted``:
        whether a drafter will be attached (default: whether ``req`` has one now)."""
        if not req.prompt:
            raise ConfigError("empty prompt")
        if drafted is None:
            drafted = req.drafter is not None
        nodes = (req.spec or TreeSpec()).max_nodes if drafted else 0
        if self.cfg.fixed_width and drafted:
            check_fixed_spec(req.spec or TreeSpec(), self.cfg.fixed_width)
        nodes = max(nodes, self.cfg.fixed_width - 1)  # a fixed-width step writes its pad rows
        need = len(req.prompt) + req.gen.max_new_tokens + nodes + 1
        if need > self.max_len - 1:
            raise ContextLengthError(
                f"prompt of {len(req.prompt)} tokens + {req.gen.max_new_tokens} new tokens "
                f"(+ {nodes} draft nodes) exceeds the {self.max_len - 1} cache slots per "
                "sequence; shorten the prompt or lower max_tokens"
            )
        if req.gen.stop_strings and self.detok is None:
            raise ConfigError("stop strings need a detokenizer")

    def _ensure_cache(self) -> None:
        m = self.model
        if (
            m.batch != self.bcfg.max_batch
            or m.max_len < self.max_len
            or m.attention != (self.attention)
        ):
            m.setup_cache(self.max_len, batch=self.bcfg.max_batch, attention=self.attention)

    def prepare(self, drafting: bool = True) -> None:
        """Allocate the batched cache and, with the goodput budget and ``drafting``, load or
        measure its cost curve now, on the empty cache: a server calls this before it reports
        healthy, so its first request does not pay for either."""
        if self.slots:
            raise ConfigError("prepare() runs before any sequence is admitted")
        self._ensure_cache()
        if drafting and self.cfg.goodput and self.selector is None:
            self._measure_curve()

    @torch.no_grad()
    def add(self, req: BatchRequest) -> Slot:
        """Prefill ``req`` into a free row and return its slot (which may already be done)."""
        self.check(req)
        if self.free <= 0:
            raise ConfigError("no free row in the batch; wait for a sequence to finish")
        self._ensure_cache()
        if self.cfg.goodput and self.selector is None:
            self._measure_curve()
        if self.selector is not None and not self.slots:
            self.selector.begin_sequence()  # an empty batch starts a new context
        prompt = list(req.prompt)
        spec = req.spec or TreeSpec()
        slot = Slot(
            req,
            len(self.slots),
            [],
            GenerationResult(prompt_len=len(prompt), tokens=[]),
            Sampler(req.gen.sampling),
            Stopper(req.gen, self.eos_ids, self.detok),
            spec,
            t_admit=time.perf_counter(),
        )
        taps = tuple(req.drafter.hidden_layers) if req.drafter is not None else ()
        with kernel_range("prefill"):
            out = prefill(self.model, prompt, taps, row=slot.row)
            first = slot.sampler.first(out.logits[0, -1])
        slot.hidden = [tuple(h[0] for h in out.hidden)] if out.hidden else []
        slot.res.prefill_s = time.perf_counter() - slot.t_admit
        slot.committed = [*prompt, first]
        if req.drafter is not None:
            req.drafter.begin(prompt)
        self.slots.append(slot)
        slot.done = slot.stopper.push(slot.res, [first], req.on_tokens)
        if slot.done:
            self.remove(slot)
        return slot

    def remove(self, slot: Slot) -> None:
        """Drop a sequence (finished or cancelled); the last row moves into its place."""
        if slot not in self.slots:
            return
        last = self.slots[-1]
        if last is not slot:
            self.model.move_cache_row(last.row, slot.row, last.cache_len)
            last.row = slot.row
            self.slots[slot.row] = last
        self.slots.pop()
        if self.selector is not None:
            self.selector.shadow.forget(id(slot))
        drafter = slot.req.drafter
        if drafter is not None:
            drafter.finish(slot.committed[: slot.res.prompt_len + len(slot.res.tokens)])

    # -- one batched step ----------------------------------------------------------------------

    def _propose(self) -> list[DraftTree]:
        sel = self._goodput()
        b = len(self.slots)
        if sel is not None:
            sel.token_value = 1.0 if self.waiting is None or self.waiting else sel.idle_value(b)
        full = sel is None or sel.should_draft(b)
        # cheap parts draft where full ones do not (asked only then: it counts their probes)
        cheap = sel is not None and (not full or sel.probing) and sel.cheap_tier(b)
        drafting = full and any(s.req.drafter for s in self.slots)
        probing = drafting and sel is not None and sel.probing
        self.drafted = ("probe" if probing else "full" if drafting else "none") + (
            "+cheap" if cheap else "")  # fmt: skip
        if sel is not None and not full:
            sel.note_skip()
            if not cheap:
                return [_EMPTY] * len(self.slots)
        probe = self._probe_slots(sel) if sel is not None and full and sel.probing else None
        asked = None if probe is None else {id(s) for s in probe}
        trees = [_EMPTY] * len(self.slots)
        spent = dict.fromkeys(("steady", "catchup", "cheap"), 0.0)  # drafting seconds
        count = dict.fromkeys(spent, 0)
        whole = [s for s in self.slots
                 if s.req.drafter and full and (asked is None or id(s) in asked)]  # fmt: skip
        ids = {id(s) for s in whole}
        for j, s in enumerate(self.slots):
            if cheap and s.req.drafter and id(s) not in ids and is_tiered(s.req.drafter):
                td = time.perf_counter()
                with kernel_range("drafter"):
                    trees[j] = s.req.drafter.propose_cheap(s.take_context())  # type: ignore[attr-defined]
                s.res.draft_s += (dt := time.perf_counter() - td)
                spent["cheap"] += dt
                count["cheap"] += 1
        if whole:  # the full drafts in one call: drafters that batch read their weights once
            td = time.perf_counter()
            with kernel_range("drafter"):
                got = propose_all([s.req.drafter for s in whole], [s.take_context() for s in whole])  # type: ignore[misc]
            per = (time.perf_counter() - td) / len(whole)  # shared evenly
            for s, tree in zip(whole, got, strict=True):
                s.res.draft_s += per
                kind = "steady" if s.full_at == self._steps else "catchup"
                spent[kind] += per
                count[kind] += 1
                s.full_at = self._steps + 1
                assert tree.size <= s.spec.max_nodes, "drafter returned too many nodes"
                trees[s.row] = tree
        alt = [s.req.drafter.last_cheap if id(s) in ids and is_tiered(s.req.drafter) else trees[j]  # type: ignore[union-attr]
               for j, s in enumerate(self.slots)]  # fmt: skip
        if sel is not None:
            for kind, n in count.items():
                if n:
                    sel.note_draft(spent[kind], n, cheap=kind == "cheap", catchup=kind == "catchup")
            tiered = any(is_tiered(s.req.drafter) for s in self.slots)
            full_n = count["steady"] + count["catchup"]
            return sel.select(trees, packed=self.bcfg.packed, drafted=full_n,
                              cheap=count["cheap"], regimes=[s.regime for s in self.slots],
                              alternative=alt if full and tiered else None)  # fmt: skip
        if any(t.size for t in trees):
            total = self.bcfg.budget.total(len(self.slots))
            trees = allocate_nodes(trees, total, self.bcfg.min_gain)
        return trees

    def _probe_slots(self, sel: Selector) -> list[Slot]:
        """The sequences a probe asks: up to ``sel.probe_sequences`` drafting ones, in turn
        (the others keep their unseen target states for a later draft); right after a draft,
        the sequences that drafted then, so that theirs is timed as a steady draft (asked in
        turn, every draft was a catch-up: the budget never read a steady one, and drafted
        every other step at batch 16 for nothing)."""
        drafting = [s for s in self.slots if s.req.drafter is not None]
        if sel.idle == 0:
            again = [s for s in drafting if s.full_at == self._steps]
            if again:
                return again
        k = min(len(drafting), max(1, sel.probe_sequences))
        start = self._probe_at % len(drafting) if drafting else 0
        self._probe_at = start + k
        return [drafting[(start + i) % len(drafting)] for i in range(k)]

    def _goodput(self) -> Selector | None:
        """The goodput selector when ``cfg.goodput`` and some running request drafts."""
        if not self.cfg.goodput or not any(s.req.drafter for s in self.slots):
            return None
        return self.selector

    def _measure_curve(self) -> None:
        """The goodput selector's cost curve, cached per machine, model and plan or measured
        before the first sequence is admitted (the cache rows are all free then)."""
        assert not self.slots, "the cost curve is measured on an empty cache"
        cfg = self.cfg
        got = selector_curve(self.model, self.max_len, self.attention, cfg.goodput_rows,
                             cache_rows=slice(0, 1), recalibrate=cfg.goodput_recalibrate)
        got.curve.smoothing = cfg.goodput_smoothing
        self.selector = Selector(got.curve, hysteresis=cfg.goodput_hysteresis,
                                 probe_every=cfg.goodput_probe, curve_source=got.source)

    @torch.no_grad()
    def step(self) -> tuple[list[Slot], StepStats]:
        """Draft, verify, accept and commit one step for every running sequence.

        Returns the sequences that finished in this step (already removed) and the step's stats.
        """
        t0 = time.perf_counter()
        if not self.slots:
            return [], StepStats(0, 0, (), 0.0)
        self._ensure_cache()
        slots = list(self.slots)
        trees = self._propose()
        t_drafted = time.perf_counter()
        self._steps += 1
        taps = tuple(
            sorted({i for s in slots if s.req.drafter for i in s.req.drafter.hidden_layers})
        )
        rows = [
            VerifyRow(s.committed[-1], s.cache_len, tr, s.sampler)
            for s, tr in zip(slots, trees, strict=True)
        ]
        tv = time.perf_counter()
        outcomes = verify_step(
            self.model,
            rows,
            taps,
            cache_rows=slice(0, len(slots)),
            scratch=self.max_len - 1,
            packed=self.bcfg.packed,
            fixed_width=self.cfg.fixed_width,
        )
        dt = time.perf_counter() - tv
        if self.selector is not None and self.cfg.goodput:
            paths = [o.path for o in outcomes]
            regimes = [s.regime for s in slots]
            self.selector.observe(trees, paths, dt, packed=self.bcfg.packed, regimes=regimes,
                                  committed=[o.tokens for o in outcomes],
                                  keys=[id(s) for s in slots])  # fmt: skip
            for s, tr, path in zip(slots, trees, paths, strict=True):
                s.regime = next_regime(s.regime, tr, path)
        finished: list[Slot] = []
        accepted: list[int] = []
        for s, tr, o in zip(slots, trees, outcomes, strict=True):
            want = s.req.drafter.hidden_layers if s.req.drafter else ()
            if want:
                s.hidden.append(tuple(o.hidden[taps.index(i)] for i in want))
            s.res.steps += 1
            s.res.accept_lengths.append(len(o.path))
            s.res.draft_nodes.append(tr.size)
            accepted.append(len(o.path))
            s.committed.extend(o.tokens)
            if s.stopper.push(s.res, o.tokens, s.req.on_tokens):
                finished.append(s)
        now = time.perf_counter()
        for s in finished:
            s.done = True
            s.res.decode_s = now - s.t_admit - s.res.prefill_s
            self.remove(s)
        nodes = sum(tr.size for tr in trees)
        stats = StepStats(len(slots), nodes, tuple(accepted), now - t0, verify_s=dt,
                          draft_s=t_drafted - t0, drafted=self.drafted)  # fmt: skip
        if self.selector is not None and self.cfg.goodput and self.selector.log:
            stats = replace(stats, predicted_verify_s=self.selector.log[-1][2])
        return finished, stats


@dataclass
class BatchOutput:
    """One request's result from :func:`run_batch`."""

    result: GenerationResult
    latency_s: float
    """From the start of the run to the request's last token (queueing included)."""
    wait_s: float
    """From the start of the run to admission (prefill)."""


def run_batch(
    engine: BatchEngine,
    requests: Sequence[BatchRequest],
    on_step: Callable[[StepStats], None] | None = None,
) -> list[BatchOutput]:
    """Decode all ``requests``, continuously batched: a free row is refilled before each step."""
    for req in requests:
        engine.check(req)
    t0 = time.perf_counter()
    pending = list(enumerate(requests))
    slots: dict[int, Slot] = {}
    waits: dict[int, float] = {}
    ends: dict[int, float] = {}
    # a full collection over the loaded model's objects (~190k) stalls the step it falls in
    with frozen_heap():
        try:
            while pending or engine.slots:
                while pending and engine.free > 0:
                    i, req = pending.pop(0)
                    waits[i] = time.perf_counter() - t0
                    slots[i] = engine.add(req)
                    if slots[i].done:
                        ends[i] = time.perf_counter() - t0
                engine.waiting = len(pending)
                done, stats = engine.step()
                if on_step is not None and stats.batch:
                    on_step(stats)
                for s in done:
                    i = next(k for k, v in slots.items() if v is s)
                    ends[i] = time.perf_counter() - t0
        finally:
            engine.waiting = None
    return [BatchOutput(slots[i].res, ends[i], waits[i]) for i in range(len(requests))]
