"""The lean native forward (:mod:`specpilot.kernels.step`) gives the module forward's bits: the
same logits, hidden states and KV caches over prefill, one-row decoding, tree verification with
scattered slots on one cache row, batched per-row slots with pad rows, and packed rows; for
native Llama (fused and unfused q/k/v, a dense fallback layer), Qwen2 (q/k/v biases), Gemma 3
(q/k norms, sliding window) and fp32 Qwen3 weights with the row ops on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpilot import kernels
from specpilot.kernels import step
from specpilot.kernels.linear import set_schedule
from specpilot.loading.native import load_native
from specpilot.model import Packing, Transformer, causal_mask
from specpilot.profiling import KERNEL_CLASSES, clocking, kernel_range, set_kernel_ranges

from .conftest import tiny_model
from .test_native_load import files  # noqa: F401  (the tiny GGUF files fixture)

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=kernels.unavailable_reason() or "kernels unavailable"
)

LEN, SCRATCH = 48, 47


def _mask(g: torch.Generator, b: int, t: int, kv: int, seen: int) -> torch.Tensor:
    m = torch.rand(b, t, kv, generator=g) > 0.4
    m[:, :, :seen] = True
    return m


def _drive(m: Transformer, vocab: int) -> list[torch.Tensor]:
    """Every output of a fixed sequence of calls, then the caches."""
    g = torch.Generator().manual_seed(0)
    n = m.cfg.n_layers
    out: list[torch.Tensor] = []

    def call(toks, pos, slots, kv, mask=None, **kw):  # type: ignore[no-untyped-def]
        r = m(toks, pos, slots, kv, mask, hidden_layers=(0, n - 1, n), **kw)
        out.extend([r.logits, *r.hidden])

    ids = lambda b, t: torch.randint(3, vocab, (b, t), generator=g)  # noqa: E731
    m.setup_cache(LEN, batch=3, attention="fixed")
    with torch.inference_mode():
        call(ids(3, 12), torch.arange(12).repeat(3, 1), 0, 12, causal_mask(0, 12, 12, m.device))
        call(ids(3, 1), torch.full((3, 1), 12), 12, 13)  # one-row decoding, every row
        call(ids(1, 1), torch.tensor([[13]]), 13, 14, cache_rows=slice(2, 3))
        tree = torch.tensor([20, 14, 16, 15, 18, 17])  # scattered, unsorted slots
        pos = torch.tensor([[13, 14, 14, 15, 15, 16]])
        call(ids(1, 6), pos, tree, 21, _mask(g, 1, 6, 21, 13), cache_rows=slice(1, 2))
        m.compact_cache(torch.tensor([14, 16]), 14, row=1)
        slots = torch.tensor([[13, 14, 15, SCRATCH], [16, 17, 18, 19], [14, SCRATCH, SCRATCH,
                              SCRATCH]])  # fmt: skip
        pos = slots.clamp(max=20)
        call(ids(3, 4), pos, slots, 20, _mask(g, 3, 4, 20, 13))
        pack = Packing(torch.tensor([0, 1, 2, 4, 5, 6, 7, 8]), 3, 4)
        call(ids(3, 4), pos, slots, 20, _mask(g, 3, 4, 20, 13), pack=pack,
             logits_rows=torch.tensor([0, 3, 7]))  # fmt: skip
        for layer in m.model.layers:
            out += [layer.self_attn.cache.k, layer.self_attn.cache.v]
    return out


def _both(make) -> None:  # type: ignore[no-untyped-def]
    lean, plain = make(), make()
    plain._lean_plan = lambda: None  # the module forward
    want = _drive(plain, plain.cfg.vocab_size)
    assert plain._plan is None
    got = _drive(lean, lean.cfg.vocab_size)
    assert lean._plan is not None  # the lean forward ran
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, i
        assert torch.equal(a, b), i


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_native_lean_forward_is_the_module_forward(name: str, files: dict[str, Path]) -> None:  # noqa: F811
    _both(lambda: load_native(files[name])[0])


def test_fp32_weights_with_row_ops() -> None:
    def make() -> Transformer:
        m = tiny_model("qwen3", seed=4)
        assert m.set_rowops(True)
        return m

    _both(make)


def test_module_forward_without_fixed_attention_lean_one_with_ranges(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:  # fmt: skip
    """Exact attention runs the module forward; with the profiler ranges on, the lean forward
    runs: its Python loop emits every kernel class's range itself; the one-op forward emits
    none inside (the LM head's, outside it, only) and times every class with its own clock
    when that is on (a profile measures the forward that runs)."""
    for loop in (True, False):
        with monkeypatch.context() as mp:
            if loop:
                mp.setattr(step.stack, "pack", lambda *a: None)
            m = load_native(files["llama"])[0]
            m.setup_cache(LEN, attention="exact")
            m(torch.tensor([[5, 6]]), torch.arange(2)[None], 0, 2)
            assert m._plan is None
            m.setup_cache(LEN, attention="fixed")
            set_kernel_ranges(True)
            try:
                with torch.profiler.profile() as prof:
                    m(torch.tensor([[5, 6]]), torch.arange(2)[None], 0, 2)
                assert m._plan is not None and (m._plan.stack is None) == loop
            finally:
                set_kernel_ranges(False)
            with clocking() as clock:
                m(torch.tensor([[5, 6]]), torch.arange(2)[None], 0, 2)
        names = {e.name for e in prof.events()}
        if loop:
            assert set(KERNEL_CLASSES) <= names, set(KERNEL_CLASSES) - names
            assert not clock
        else:
            assert "specpilot::lean_run" in names and "lm_head" in names  # the LM head GEMM
            assert not set(KERNEL_CLASSES) - {"lm_head"} & names
            assert sorted(clock) == sorted(KERNEL_CLASSES)
            assert all(s > 0 for s in clock.values()), clock


def test_the_op_clock_keeps_the_bits_and_skips_outer_ranges(files: dict[str, Path]) -> None:  # noqa: F811
    """With its clock on the one-op forward gives the same bits; its classes sum to at most the
    forward's wall time; inside an outer range (prefill, drafter) it is not clocked: that
    range's time holds it."""
    import time

    m = load_native(files["gemma3"])[0]
    m.set_numerics("int8")
    m.setup_cache(LEN, attention="fixed")
    toks, pos = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    with torch.inference_mode():
        want = m(toks, pos, 0, 3).logits
        with clocking() as clock:
            t = time.perf_counter()
            got = m(toks, pos, 0, 3).logits
            wall = time.perf_counter() - t
        seen = dict(clock)
        with clocking() as clock, kernel_range("prefill"):
            inner = m(toks, pos, 0, 3).logits
    assert m._plan is not None and m._plan.stack is not None
    assert torch.equal(got, want) and torch.equal(inner, want)
    assert sorted(seen) == sorted(KERNEL_CLASSES) and 0 < sum(seen.values()) <= wall
    assert not clock


def test_prepack_after_a_forward_rebuilds_the_plan() -> None:
    def make() -> Transformer:
        m = tiny_model("llama", seed=5)
        assert m.set_rowops(True)
        m.setup_cache(LEN, attention="fixed")
        return m

    toks, pos = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    lean, plain = make(), make()
    plain._lean_plan = lambda: None
    with torch.inference_mode():
        lean(toks, pos, 0, 3)  # the plan now holds the unpacked projections
        lean.prepack()
        plain.prepack()
        if not lean.prepacked:
            pytest.skip("oneDNN prepacking unavailable")
        got = lean(toks, pos, 0, 3).logits
        assert lean._plan is not None and lean._plan.layers[0].o_proj.__self__ is (
            lean.model.layers[0].self_attn.o_proj
        )
        assert torch.equal(got, plain(toks, pos, 0, 3).logits)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("numerics", ["fp32", "int8"])
@pytest.mark.parametrize("name", ["llama", "untied", "qwen2", "gemma3"])
def test_one_op_for_the_layers_gives_the_python_loops_bits(
    name: str, numerics: str, threads: int, files: dict[str, Path],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``specpilot::lean_run`` (:mod:`specpilot.kernels.stack`) on ``threads`` threads against
    the Python loop of :func:`specpilot.kernels.step.run` on two, over every call of ``_drive``
    (1 to 12 rows, packed calls too), in both numerics profiles."""

    def make() -> Transformer:
        m = load_native(files[name])[0]
        m.set_numerics(numerics)
        return m

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with monkeypatch.context() as mp:
            mp.setattr(step.stack, "pack", lambda *a: None)
            loop = make()
            want = _drive(loop, loop.cfg.vocab_size)
            assert loop._plan is not None and loop._plan.stack is None
        torch.set_num_threads(threads)
        one = make()
        got = _drive(one, one.cfg.vocab_size)
    finally:
        torch.set_num_threads(before)
    assert one._plan is not None and one._plan.stack is not None  # the op ran
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i


def test_a_linear_the_op_does_not_run_keeps_the_python_loop(files: dict[str, Path]) -> None:  # noqa: F811
    """A projection swapped for a stock ``nn.Linear``: the plan has no op, the loop runs it."""
    def make() -> Transformer:
        m = load_native(files["untied"])[0]
        att = m.model.layers[1].self_attn
        dense = torch.nn.Linear(att.o_proj.in_features, att.o_proj.out_features, bias=False)
        dense.weight.data.copy_(att.o_proj.weight)
        att.o_proj = dense
        return m

    _both(make)
    m = make()
    m.setup_cache(LEN, attention="fixed")
    m(torch.tensor([[5, 6]]), torch.arange(2)[None], 0, 2)
    assert m._plan is not None and m._plan.stack is None


def test_new_tiles_or_numerics_read_the_layers_again(files: dict[str, Path]) -> None:  # noqa: F811
    """The op's plan holds each linear's tiles and profile: changing either after a forward
    makes the next forward read the layers again, and its output follows the new profile."""
    m = load_native(files["gemma3"])[0]
    m.setup_cache(LEN, attention="fixed")
    toks, pos = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    with torch.inference_mode():
        fp32 = m(toks, pos, 0, 3).logits
        first = m._plan
        set_schedule(m, (1, 2), (8, 3))
        assert torch.equal(m(toks, pos, 0, 3).logits, fp32)  # tiles never change a bit
        assert m._plan is not first
        m.set_numerics("int8")
        q8 = m(toks, pos, 0, 3).logits
        ref = load_native(files["gemma3"])[0]
        ref.set_numerics("int8")
        ref.setup_cache(LEN, attention="fixed")
        assert torch.equal(q8, ref(toks, pos, 0, 3).logits)
        assert not torch.equal(q8, fp32)
