"""Decoding engine: plain autoregressive greedy (the reference) and speculative greedy decoding.

A speculative step reads as four named stages (after EAGLE's decode loop):
  1. draft   - the drafter proposes a tree continuing the committed tokens;
  2. verify  - one target forward over [root, nodes...] with the tree mask;
  3. accept  - greedy verification picks the accepted path and the bonus token;
  4. commit  - the accepted nodes' cache entries are compacted onto the committed prefix.
The root (last committed token) is not yet in the cache when a step starts; it is verified with
the tree, so a step with an empty tree is exactly one autoregressive step. Prefill and the
drafter's ``propose`` run in the named profiler ranges ``prefill`` and ``drafter`` (no-ops unless
:func:`specpilot.profiling.set_kernel_ranges` is on; read by :mod:`specpilot.costmodel`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specpilot import kernels
from specpilot.drafters.base import DraftContext, Drafter, is_tiered
from specpilot.errors import ConfigError, ContextLengthError
from specpilot.goodput import Selector, next_regime
from specpilot.goodput.curve import selector_curve
from specpilot.model import ATTENTION_KINDS, LINEAR_KINDS, Transformer
from specpilot.profiling import kernel_range
from specpilot.sampling import Sampler, SamplingParams
from specpilot.tree import DraftTree, TreeSpec
from specpilot.verify import (
    StepOutcome,
    VerifyRow,
    check_fixed_spec,
    committed_rows,
    prefill,
    verify_step,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Runtime choices for the target model."""

    device: str = "cpu"
    dtype: str = "float32"
    """float32 (CPU or GPU), bfloat16 / float16 (GPU)."""
    attention: str = "auto"
    """"fixed" (batch-invariant fp32 kernel, specpilot.kernels: the CPU default when the kernels
    build), "exact" (fp64 attention, batch-invariant: the CPU fallback), "sdpa" (native dtype),
    "auto"."""
    linear: str = "onednn"
    """"onednn" (prepacked, batch-invariant CPU fp32 GEMMs) or "torch"."""
    numerics: str = "fp32"
    """Numerics profile of native GGUF weights (:mod:`specpilot.kernels.int8`): "fp32" (fp32
    activations, the default) or "int8" (Q8 activation blocks, integer block dot products).
    Each profile is its own reference: plain decoding and speculation run the same one."""
    threads: int | None = None
    """CPU threads for torch (None = leave torch's default)."""
    static_buffers: bool = False
    """Verify with token/position/mask buffers reused across steps (see specpilot.fastverify)."""
    device_accept: bool = False
    """Greedy acceptance as tensor ops on the device, one host read per step."""
    cuda_graphs: bool = False
    """Replay the verify forward from CUDA graphs captured at padded static shapes (GPU only)."""
    fixed_width: int = 0
    """0 = off. N: every step, plain or verifying a chain of up to N - 1 drafts, runs one
    forward of exactly N rows per sequence over the whole cache (masked past each row; the
    batch engine: every cache row, empty ones as dummies), so a row's bits cannot depend on
    what else the call holds: lossless by construction with kernels that are not
    batch-invariant (stock GPU kernels), at the cost of N rows per plain step
    (:mod:`specpilot.fastverify`). Chains only: a tree node's key slot is not its position."""
    goodput: bool = False
    """Verify budget by expected tokens per second (:mod:`specpilot.goodput`): per step the
    draft nodes worth their measured cost, down to plain decoding."""
    goodput_hysteresis: float = 0.05
    """A new budget replaces the last one only if predicted this much better."""
    goodput_probe: int = 8
    """While plain decoding wins, draft every this many steps to refresh the estimates."""
    goodput_rows: int = 64
    """The cost curve is measured at 1, 2, 4, .. up to this many verify rows."""
    goodput_smoothing: float = 0.2
    """Weight of one observed step on the cost curve (0 = keep the measured curve)."""
    goodput_recalibrate: bool = False
    """Measure the cost curve anew even where one is cached for this machine, model and plan
    (also ``SPECPILOT_GOODPUT_RECALIBRATE=1``; :mod:`specpilot.goodput.curve`)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attention not in (*ATTENTION_KINDS, "auto"):
            raise ConfigError(
                f"attention must be auto, fixed, exact or sdpa, got {self.attention!r}"
            )
        if self.attention == "fixed":
            if self.device != "cpu" or self.dtype != "float32":
                raise ConfigError("attention fixed runs on CPU float32; use exact or sdpa")
            if not kernels.available():
                raise ConfigError(f"attention fixed: {kernels.unavailable_reason()}; use exact")
        if self.linear not in LINEAR_KINDS:
            raise ConfigError(f"linear must be one of {LINEAR_KINDS}, got {self.linear!r}")
        if self.numerics not in kernels.int8.PROFILES:
            choices = ", ".join(kernels.int8.PROFILES)
            raise ConfigError(f"--numerics must be one of {choices}, got {self.numerics!r}")
        if self.threads is not None and self.threads <= 0:
            raise ConfigError(f"--threads must be positive, got {self.threads}")
        dev = self.device.split(":")[0]
        if dev not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        if dev == "cpu" and self.dtype != "float32":
            raise ConfigError(f"--dtype {self.dtype} is for GPUs; use float32 on CPU")
        if dev == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but no CUDA device is available")
        if self.cuda_graphs and dev != "cuda":
            raise ConfigError("cuda_graphs needs a CUDA device; drop it from the plan on CPU")
        if not 0 <= self.fixed_width <= 64:
            raise ConfigError(f"fixed_width must be in [0, 64] (0 = off), got {self.fixed_width}")
        if not 0 <= self.goodput_hysteresis < 1 or self.goodput_probe < 1:
            raise ConfigError("goodput_hysteresis must be in [0, 1) and goodput_probe >= 1")
        if not 1 <= self.goodput_rows <= 64 or not 0 <= self.goodput_smoothing <= 1:
            raise ConfigError("goodput_rows must be in [1, 64] and goodput_smoothing in [0, 1]")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def resolved_attention(self) -> str:
        if self.attention != "auto":
            return self.attention
        if self.device != "cpu":
            return "sdpa"
        return "fixed" if kernels.available() else "exact"


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    stop_on_eos: bool = True
    stop_strings: tuple[str, ...] = ()
    record_margins: bool = False
    """Record the target's top-1 minus top-2 logit at each generated token (reference runs)."""
    temperature: float = 0.0
    """0 = greedy; > 0 = lossless speculative sampling (see :mod:`specpilot.sampling`)."""
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    """Seed of the sampling generator (None = random); ignored when greedy."""

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        _ = self.sampling  # validates temperature, top_k, top_p

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)


@dataclass
class GenerationResult:
    prompt_len: int
    tokens: list[int]
    """Generated tokens (EOS included when generation stopped on it)."""
    stop_reason: str = "length"
    """"eos", "stop" (a stop string), or "length"."""
    steps: int = 0
    """Target forward passes after prefill (each verifies one tree)."""
    accept_lengths: list[int] = field(default_factory=list)
    """Accepted draft tokens per step (the bonus token not counted)."""
    draft_nodes: list[int] = field(default_factory=list)
    """Draft nodes verified per step (the node budget actually used)."""
    margins: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    """Part of decode_s spent in the drafter."""

    @property
    def tau(self) -> float:
        """Mean tokens committed per target step (accepted + bonus); 1.0 for plain decoding."""
        return (sum(self.accept_lengths) + self.steps) / self.steps if self.steps else 1.0

    def acceptance_by_depth(self, max_depth: int) -> list[float]:
        """Fraction of steps whose accepted path reached depth d, d = 1..max_depth."""
        n = len(self.accept_lengths) or 1
        return [sum(a >= d for a in self.accept_lengths) / n for d in range(1, max_depth + 1)]


TokenCallback = Callable[[list[int]], None]


class Engine:
    """Owns the target model and its cache; generates one sequence at a time."""

    def __init__(self, model: Transformer, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        if self.cfg.threads is not None:
            torch.set_num_threads(self.cfg.threads)
        self.model = model
        self.attention = self.cfg.resolved_attention
        model.prepack(self.cfg.linear)
        if self.cfg.numerics != "fp32" or getattr(model, "native", False):
            model.set_numerics(self.cfg.numerics)  # ConfigError unless the weights are native
        self.context_len = model.cfg.max_position
        self._fast = None
        c = self.cfg
        if c.static_buffers or c.device_accept or c.cuda_graphs or c.fixed_width:
            from specpilot.fastverify import FastVerifier

            self._fast = FastVerifier(
                model,
                static_buffers=c.static_buffers,
                device_accept=c.device_accept,
                cuda_graphs=c.cuda_graphs,
                fixed_width=c.fixed_width,
            )
        self.selector: Selector | None = None
        """The goodput budget's state (``cfg.goodput``), made at the first generate."""

    def _selector(self) -> Selector:
        """The goodput selector, its cost curve cached per machine, model and plan or measured
        once per engine (:func:`specpilot.goodput.curve.selector_curve`); the hysteresis state
        starts afresh per sequence (:meth:`~specpilot.goodput.Selector.begin_sequence`)."""
        if self.selector is None:
            cfg = self.cfg
            got = selector_curve(self.model, min(self.context_len, 1024), self.attention,
                                 cfg.goodput_rows, prepare=self._ensure_cache,
                                 recalibrate=cfg.goodput_recalibrate)  # fmt: skip
            got.curve.smoothing = cfg.goodput_smoothing
            self.selector = Selector(got.curve, hysteresis=cfg.goodput_hysteresis,
                                     probe_every=cfg.goodput_probe, curve_source=got.source)
        self.selector.begin_sequence()
        return self.selector

    def _ensure_cache(self, need: int) -> None:
        m = self.model
        if self.cfg.fixed_width:  # one key length for every step: the whole context
            need = self.context_len
        if need > m.max_len or m.attention != self.attention or m.batch != 1:
            size = max(need, 256)
            size = -(-size // 256) * 256
            self.model.setup_cache(min(size, max(need, self.context_len)), attention=self.attention)

    @torch.no_grad()
    def hidden_states(self, tokens: Sequence[int], layers: Sequence[int]) -> tuple[Tensor, ...]:
        """Per tapped layer, the target's hidden states (len(tokens), dim) of ``tokens`` in one
        causal forward (what a trained drafter reads; the cost model's replay uses it)."""
        n = len(tokens)
        if n == 0:
            raise ConfigError("empty token sequence")
        self._ensure_cache(n + 1)
        return tuple(h[0] for h in prefill(self.model, tokens, tuple(layers)).hidden)

    @torch.no_grad()
    def generate(
        self,
        prompt: Sequence[int],
        gen: GenerationConfig,
        drafter: Drafter | None = None,
        spec: TreeSpec | None = None,
        eos_ids: Sequence[int] = (),
        detok: Callable[[list[int]], str] | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        """Greedy decoding (or sampling, ``gen.temperature > 0``) of ``prompt``; speculative
        when a drafter is given.

        ``detok`` turns generated tokens into text (needed only for stop strings).
        """
        prompt = list(prompt)
        if not prompt:
            raise ConfigError("empty prompt")
        spec = spec or TreeSpec()
        n_nodes = spec.max_nodes if drafter is not None else 0
        if self.cfg.fixed_width:  # every step writes fixed_width rows past its cache
            if drafter is not None:
                check_fixed_spec(spec, self.cfg.fixed_width)
            n_nodes = max(n_nodes, self.cfg.fixed_width - 1)
        need = len(prompt) + gen.max_new_tokens + n_nodes + 1
        if need > self.context_len:
            raise ContextLengthError(
                f"prompt of {len(prompt)} tokens + {gen.max_new_tokens} new tokens exceeds the "
                f"model context of {self.context_len}; shorten the prompt or lower "
                "--max-new-tokens"
            )
        if gen.stop_strings and detok is None:
            raise ConfigError("stop strings need a detokenizer")
        sel = self._selector() if self.cfg.goodput and drafter is not None else None
        self._ensure_cache(need)
        res = GenerationResult(prompt_len=len(prompt), tokens=[])
        stopper = Stopper(gen, tuple(eos_ids), detok)
        sampler = Sampler(gen.sampling)

        with frozen_heap():
            self._decode(prompt, gen, drafter, spec, sel, stopper, sampler, res, on_tokens)
        return res

    def _decode(
        self, prompt: list[int], gen: GenerationConfig, drafter: Drafter | None, spec: TreeSpec,
        sel: Selector | None, stopper: Stopper, sampler: Sampler, res: GenerationResult,
        on_tokens: TokenCallback | None,
    ) -> None:  # fmt: skip
        """Prefill, the decode loop and the drafter's finish of :meth:`generate` into ``res``."""
        taps = tuple(drafter.hidden_layers) if drafter is not None else ()
        n_nodes = spec.max_nodes if drafter is not None else 0
        t0 = time.perf_counter()
        p = len(prompt)
        with kernel_range("prefill"):
            out = prefill(self.model, prompt, taps)
            first = sampler.first(out.logits[0, -1])
        if gen.record_margins:
            res.margins.append(_margin(out.logits[0, -1]))
        # target states the drafter has not seen yet, one chunk per forward (joined at its next
        # draft: a step that skips drafting only appends, it does not copy the backlog)
        pending = [tuple(h[0] for h in out.hidden)] if out.hidden else []
        res.prefill_s = time.perf_counter() - t0
        committed = [*prompt, first]
        if drafter is not None:
            drafter.begin(prompt)
        done = stopper.push(res, [first], on_tokens)

        t1 = time.perf_counter()
        regime = 0  # the goodput budget's view of this sequence's recent acceptance
        while not done:
            cache_len = len(committed) - 1  # the root committed[-1] is not cached yet
            tree, drafted = _draft(
                drafter,
                sel,
                lambda h=pending: DraftContext(committed, p, spec, join_chunks(h)),
                res,
                regime,
            )
            if drafted:
                pending = []
            assert tree.size <= n_nodes, f"drafter returned {tree.size} > {n_nodes} nodes"
            tv = time.perf_counter()
            step = self.step(committed[-1], cache_len, tree, taps, sampler)
            if sel is not None:
                sel.observe([tree], [step.path], time.perf_counter() - tv, regimes=[regime],
                            committed=[step.tokens])  # fmt: skip
                regime = next_regime(regime, tree, step.path)
            if step.hidden:
                pending.append(step.hidden)
            res.steps += 1
            res.accept_lengths.append(len(step.path))
            res.draft_nodes.append(tree.size)
            if gen.record_margins:
                res.margins.extend(_margin(step.logits[r]) for r in committed_rows(step.path))
            committed.extend(step.tokens)
            done = stopper.push(res, step.tokens, on_tokens)
        res.decode_s = time.perf_counter() - t1
        if drafter is not None:
            drafter.finish(committed[: p + len(res.tokens)])
        if gen.record_margins:
            res.margins = res.margins[: len(res.tokens)]

    def step(
        self,
        root: int,
        cache_len: int,
        tree: DraftTree,
        taps: tuple[int, ...] = (),
        sampler: Sampler | None = None,
    ) -> StepOutcome:
        """Verify ``tree`` under ``root`` and commit the accepted path (see
        :mod:`specpilot.verify`); the overhead mechanisms' verifier takes greedy steps."""
        if self._fast is not None and (sampler is None or sampler.greedy):
            return self._fast.step(root, cache_len, tree, taps)
        row = VerifyRow(root, cache_len, tree, sampler)
        return verify_step(self.model, [row], taps, fixed_width=self.cfg.fixed_width)[0]


def _draft(
    drafter: Drafter | None,
    sel: Selector | None,
    context: Callable[[], DraftContext],
    res: GenerationResult,
    regime: int = 0,
) -> tuple[DraftTree, bool]:
    """This step's tree (empty without a drafter, or when the goodput budget skips drafting;
    a tiered drafter's cheap part alone when the budget sits its full drafter out:
    :class:`specpilot.drafters.base.Tiered`) and whether the drafter proposed (then it has
    seen the pending hidden states). ``context`` builds the drafter's input only when it runs;
    ``regime``: the sequence's for the budget."""
    if drafter is None:
        return _EMPTY, False
    full = sel is None or sel.should_draft()
    if sel is not None and not full:
        sel.note_skip()
        if not (is_tiered(drafter) and sel.cheap_tier()):
            return _EMPTY, False
    propose = drafter.propose if full or not is_tiered(drafter) else drafter.propose_cheap
    td = time.perf_counter()
    with kernel_range("drafter"):
        tree = propose(context())
    dt = time.perf_counter() - td
    res.draft_s += dt
    if sel is not None:
        sel.note_draft(dt, cheap=not full)
        alt = [drafter.last_cheap] if full and is_tiered(drafter) else None
        tree = sel.select([tree], regimes=[regime], drafted=int(full), cheap=int(not full),
                          alternative=alt)[0]  # fmt: skip
    return tree, True


_EMPTY = DraftTree.empty()
"""The tree of a step that does not draft (plain decoding): one immutable instance, not four
fresh tensors per step."""


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Run the body with every object alive at its start in the garbage collector's permanent
    generation (:func:`gc.freeze`), moved back at the end (:func:`gc.unfreeze`).

    After a model load the heap holds ~190k tracked objects (torch's modules, the model's), and
    a full collection that walks them takes 100-300 ms: one that falls inside a decode stalls
    that token. Frozen, a collection walks only what the decode itself made, so garbage made
    during it is still collected; a frozen object that becomes garbage during the body (a
    drafter's state replaced at ``begin``) is collected by the first collection after it, which
    sees every object again. Both calls are O(1) list splices. Left alone when the collector
    is off or objects are frozen already (a caller's own :func:`gc.freeze`, another generate in
    progress)."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def join_chunks(chunks: Sequence[tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """Hidden states the drafter has not seen yet, from one chunk per forward: per tapped layer,
    the rows of every chunk in order (one copy; none for a single chunk)."""
    if len(chunks) <= 1:
        return chunks[0] if chunks else ()
    return tuple(torch.cat(layer, dim=0) for layer in zip(*chunks, strict=True))


def _margin(row: Tensor) -> float:
    top = torch.topk(row.float(), 2).values
    return float(top[0] - top[1])


class Stopper:
    """Appends committed tokens to a result, applying EOS / length / stop-string rules."""

    def __init__(
        self, gen: GenerationConfig, eos: tuple[int, ...], detok: Callable[[list[int]], str] | None
    ) -> None:
        self.gen, self.eos, self.detok = gen, set(eos), detok

    def push(self, res: GenerationResult, new: list[int], cb: TokenCallback | None) -> bool:
        take: list[int] = []
        reason = ""
        for tok in new:
            take.append(tok)
            if self.gen.stop_on_eos and tok in self.eos:
                reason = "eos"
                break
            if len(res.tokens) + len(take) >= self.gen.max_new_tokens:
                reason = "length"
                break
            if self.gen.stop_strings and self._hits_stop(res.tokens + take):
                reason = "stop"
                break
        res.tokens.extend(take)
        if cb is not None and take:
            cb(take)
        if reason:
            res.stop_reason = reason
            return True
        return False

    def _hits_stop(self, toks: list[int]) -> bool:
        assert self.detok is not None
        text = self.detok(toks[-64:])
        return any(s in text for s in self.gen.stop_strings)
