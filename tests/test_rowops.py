"""Row ops (RMSNorm, add + RMSNorm, RoPE with q/k norms, SiLU / GELU-tanh GLU): values, the
row-op contract (rows, threads, ISAs, the documented order), the model with the ops on, and the
fallback without a compiler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpilot import kernels
from specpilot.kernels import build, rowops
from specpilot.kernels.rowops import rotate_half

pytestmark = pytest.mark.skipif(
    not rowops.available(), reason=rowops.unavailable_reason() or "kernels unavailable"
)

AVX2 = rowops.available() and torch.ops.specpilot.isa_available(2) == 1
ISAS = kernels.runnable_isas() or ["portable"]
VECTOR = [i for i in ISAS if i != "portable"]
"""The vector paths this CPU runs (AVX2, AVX-512): each must give the portable bits."""


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def rope_tables(rows: int, hd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 4000, (rows,), generator=gen(seed)).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)
    return emb.cos(), emb.sin()


def torch_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's formula: qk (R, heads, hd), cos/sin (R, hd)."""
    return (qk * cos[:, None]) + (rotate_half(qk) * sin[:, None])


def glu_fp64(g: torch.Tensor, u: torch.Tensor, kind: str) -> torch.Tensor:
    g64, u64 = g.double(), u.double()
    if kind == "silu":
        return g64 * torch.sigmoid(g64) * u64
    inner = (2 / np.pi) ** 0.5 * (g64 + 0.044715 * g64**3)
    return g64 * torch.sigmoid(2 * inner) * u64  # 0.5 (1 + tanh(y)) = sigmoid(2y), no cancellation


# -- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_and_add_rms_norm_against_fp64(isa: str, offset: bool) -> None:
    n = 77  # a tail of 5 after the 8-lane chunks
    x = torch.randn(9, n, generator=gen(1)) * 3
    res = torch.randn(9, n, generator=gen(2))
    w = torch.randn(n, generator=gen(3))
    scale = (1 + w.double()) if offset else w.double()
    for a in (x, x + res):
        ref = F.rms_norm(a.double(), (n,), scale, 1e-6)
        y = rowops.rms_norm(a, w, 1e-6, offset, isa)
        assert torch.allclose(y.double(), ref, rtol=2e-6, atol=1e-6)
    h, y = rowops.add_rms_norm(x, res, w, 1e-6, offset, isa)
    assert torch.equal(h, x + res)  # the sum is the plain fp32 add
    assert torch.equal(bits(y), bits(rowops.rms_norm(x + res, w, 1e-6, offset, isa)))
    assert torch.allclose(y, F.rms_norm(x + res, (n,), 1 + w if offset else w, 1e-6), atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_rope_equals_the_torch_formula_bit_for_bit(isa: str) -> None:
    """Without q/k norms the op is the model's torch formula exactly (products, then the sum)."""
    rows, h, hk, hd = 6, 4, 2, 20  # hd / 2 = 10: one 8-wide chunk and a scalar tail
    qkv = torch.randn(rows, (h + 2 * hk) * hd, generator=gen(4)) * 2
    cos, sin = rope_tables(rows, hd, seed=5)
    want = torch_rope(qkv[:, : (h + hk) * hd].reshape(rows, h + hk, hd), cos, sin)
    fused = rowops.rope_qk(qkv, qkv, cos, sin, h, hk, hd, k_offset=h * hd, isa=isa)
    q, k = qkv[:, : h * hd].contiguous(), qkv[:, h * hd : (h + hk) * hd].contiguous()
    apart = rowops.rope_qk(q, k, cos, sin, h, hk, hd, isa=isa)
    assert fused.shape == (rows, h + hk, hd)
    assert torch.equal(bits(fused), bits(want)) and torch.equal(bits(apart), bits(want))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("offset", [False, True])
def test_rope_with_qk_norms_against_torch(isa: str, offset: bool) -> None:
    rows, h, hk, hd = 5, 3, 1, 32
    qk = torch.randn(rows, (h + hk) * hd, generator=gen(6)) * 4
    qw, kw = torch.randn(hd, generator=gen(7)), torch.randn(hd, generator=gen(8))
    cos, sin = rope_tables(rows, hd, seed=9)
    heads = qk.reshape(rows, h + hk, hd)
    sq, sk = (1 + qw, 1 + kw) if offset else (qw, kw)
    normed = torch.cat([F.rms_norm(heads[:, :h], (hd,), sq, 1e-6),
                        F.rms_norm(heads[:, h:], (hd,), sk, 1e-6)], dim=1)  # fmt: skip
    got = rowops.rope_qk(qk, qk, cos, sin, h, hk, hd, h * hd, qw, kw, 1e-6, offset, isa)
    assert torch.allclose(got, torch_rope(normed, cos, sin), atol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_glu_against_fp64_and_torch(isa: str, kind: str) -> None:
    n = 203
    g = torch.randn(7, n, generator=gen(10)) * 4
    g[0, :6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 100.0, -100.0])
    u = torch.randn(7, n, generator=gen(11))
    ref = glu_fp64(g, u, kind)
    g64 = g.double()
    z = g64 if kind == "silu" else 2 * (2 / np.pi) ** 0.5 * (g64 + 0.044715 * g64**3)
    rel = 2e-6 + 2.4e-7 * z.abs()  # exp(-z)'s condition: z itself is rounded to fp32
    for y in (rowops.glu(g, u, kind, isa), rowops.glu(torch.cat([g, u], dim=1), None, kind, isa)):
        err = (y.double() - ref).abs()
        assert bool((err <= rel * ref.abs() + 1e-35).all())
    act = F.silu(g) if kind == "silu" else F.gelu(g, approximate="tanh")
    assert torch.allclose(rowops.glu(g, u, kind, isa), act * u, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="16 elements"):
        rowops.rms_norm(x, torch.ones(15), 1e-6)
    with pytest.raises(RuntimeError, match="does not match"):
        rowops.add_rms_norm(x, torch.randn(3, 15), torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="rows too short"):
        rowops.rope_qk(x, x, *rope_tables(3, 8, 0), 2, 1, 8, k_offset=12)
    with pytest.raises(ValueError, match="unknown gated activation"):
        rowops.glu(x, None, "relu")


# -- the documented order -----------------------------------------------------------------


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fused multiply-add via fp64 (exact product; a double rounding is vanishingly rare)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def doc_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The package docstring's row-op order written out in numpy, one row at a time."""
    f = np.float32
    y = np.empty_like(x)
    for r in range(x.shape[0]):
        a = np.zeros(8, dtype=f)
        for k in range(x.shape[1]):
            a[k % 8] = fma32(x[r, k], x[r, k], a[k % 8])
        s = a[:4] + a[4:]
        t = s[:2] + s[2:]
        inv = f(1) / np.sqrt(f(t[0] + t[1]) / f(x.shape[1]) + f(eps))
        y[r] = (x[r] * inv) * w
    return y


def doc_exp(x: np.ndarray) -> np.ndarray:
    """The kernels' one exp (csrc/fixed_exp.h), as the contract writes it."""
    f = np.float32
    c = np.minimum(x, f(88.0))
    t = fma32(c, f(1.44269504088896341), f(12582912.0))
    n = t - f(12582912.0)
    r = fma32(n, f(-0.693359375), c)
    r = fma32(n, f(2.12194440e-4), r)
    p = np.full_like(c, f(1.9875691500e-4))
    for k in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = fma32(p, r, np.full_like(c, f(k)))
    y = fma32(p, r * r, r) + f(1)
    out = y * np.ldexp(np.ones_like(c), n.astype(np.int32)).astype(f)
    return np.where(x < f(-87.33654), f(0), out).astype(f)


def test_ops_follow_the_documented_order() -> None:
    x = (torch.randn(4, 45, generator=gen(12)) * 2).numpy()
    w = torch.randn(45, generator=gen(13)).numpy()
    g = (torch.randn(3, 64, generator=gen(14)) * 5).numpy()
    u = torch.randn(3, 64, generator=gen(15)).numpy()
    f = np.float32
    silu = (g / (f(1) + doc_exp(-g))) * u
    t = ((g * g) * f(0.0713548162726) + f(1.5957691216057308))
    gelu = (g / (f(1) + doc_exp(-(g * t)))) * u
    for isa in ISAS:
        y = rowops.rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-5, isa=isa).numpy()
        assert np.array_equal(y.view(np.int32), doc_rms_norm(x, w, 1e-5).view(np.int32))
        for kind, want in (("silu", silu), ("gelu_tanh", gelu)):
            got = rowops.glu(torch.from_numpy(g), torch.from_numpy(u), kind, isa).numpy()
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), (kind, isa)


# -- the contract: rows, threads, ISAs --------------------------------------------------------

OPS = ["rms_norm", "add_rms_norm", "rope", "rope_norms", "silu", "gelu_tanh"]


def run_op(op: str, rows: torch.Tensor, aux: torch.Tensor, isa: str) -> torch.Tensor:
    """One op over ``rows`` (m, width); ``aux`` supplies a second input of the same shape."""
    width = rows.shape[1]
    w = aux[0]
    if op == "rms_norm":
        return rowops.rms_norm(rows, w, 1e-6, True, isa)
    if op == "add_rms_norm":
        h, y = rowops.add_rms_norm(rows, aux, w, 1e-6, False, isa)
        return torch.cat([h, y], dim=1)
    if op in ("silu", "gelu_tanh"):
        return rowops.glu(rows * 6, aux, op, isa)
    hd = 2 * max(1, width // 6)  # three heads: two q, one k
    cos, sin = torch.cos(aux[:, :hd] * 40), torch.sin(aux[:, :hd] * 40)
    norms = (w[:hd], aux[-1, :hd]) if op == "rope_norms" else (None, None)
    return rowops.rope_qk(rows, rows, cos, sin, 2, 1, hd, 2 * hd, *norms, 1e-6, False, isa)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    op=st.sampled_from(OPS),
    width=st.integers(6, 300),
    m=st.integers(1, 64),
    pos=st.integers(0, 63),
    isa=st.sampled_from(ISAS),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_rows_bit_identical_across_counts_threads_isas(
    op: str, width: int, m: int, pos: int, isa: str, threads: int, seed: int
) -> None:
    x = torch.randn(m, width, generator=gen(seed))
    aux = torch.randn(m, width, generator=gen(seed + 1))
    pos = pos % m
    one = aux[pos : pos + 1]  # every row gets the same second input (and weights) as row pos
    ref = run_op(op, x[pos : pos + 1], one, "portable")
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = run_op(op, x, one.expand(m, width).contiguous(), isa)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(bits(full[pos : pos + 1]), bits(ref))


def test_thread_split_does_not_change_bits() -> None:
    """Rows long enough that two threads really split them (grain: 16384 / width rows)."""
    m, width = 64, 2048
    x = torch.randn(m, width, generator=gen(16))
    aux = torch.randn(m, width, generator=gen(17))
    prev = torch.get_num_threads()
    try:
        for op in OPS:
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outs.append(run_op(op, x, aux, ISAS[-1]))
            assert torch.equal(bits(outs[0]), bits(outs[1])), op
    finally:
        torch.set_num_threads(prev)


@pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2+FMA")
def test_portable_path_equals_avx2_bit_for_bit() -> None:
    x = torch.randn(33, 333, generator=gen(18)) * 3
    aux = torch.randn(33, 333, generator=gen(19))
    for op in OPS:
        a, b = run_op(op, x, aux, "portable"), run_op(op, x, aux, "avx2")
        assert torch.equal(bits(a), bits(b)), op


def test_ops_trace_under_torch_compile() -> None:
    """The op handles (as the model calls them) trace with their fake kernels, no graph break."""
    ops = rowops.ops()
    x, r = torch.randn(5, 48, generator=gen(20)), torch.randn(5, 48, generator=gen(21))
    w = torch.randn(48, generator=gen(22))
    cos, sin = rope_tables(5, 16, seed=23)

    def step(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        h, a = ops.add_rms_norm.default(x, r, w, 1e-6, False, 0)
        a = ops.rms_norm.default(a, w, 1e-6, True, 0)
        qk = ops.rope_qk.default(a, a, 32, cos, sin, 2, 1, 16, None, None, 1e-6, False, 0)
        return ops.glu.default(h, None, 1, 0) + qk.reshape(5, 48)[:, :24]

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, r), step(x, r))


# -- the model with the row ops on --------------------------------------------------------


def run_generate(model, prompts, drafter_factory):  # type: ignore[no-untyped-def]
    from specpilot.engine import Engine, EngineConfig, GenerationConfig
    from specpilot.tree import TreeSpec

    gen_cfg = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    eng = Engine(model, EngineConfig(attention="exact"))
    spec = TreeSpec(kind="dynamic", budget=10, topk=3, depth=5)
    for prompt in prompts:
        ref = eng.generate(prompt, gen_cfg).tokens
        res = eng.generate(prompt, gen_cfg, drafter=drafter_factory(), spec=spec)
        assert res.tokens == ref, prompt


PROMPTS = ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 4, 9, 11], [42])


@pytest.fixture(scope="module")
def native_gguf(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from gguf import GGMLQuantizationType as T

    from .conftest import tiny_model
    from .test_loading import VOCAB, write_gguf

    tmp = tmp_path_factory.mktemp("rowops")
    src = tiny_model("llama", seed=3, std=0.12, vocab=VOCAB, dim=64, intermediate_size=128)
    quant = {f"blk.{i}.{n}.weight": T.Q4_1 for i in range(2)
             for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
    quant.update({"token_embd.weight": T.Q8_0, "blk.0.ffn_down.weight": T.Q8_0,
                  "blk.1.ffn_down.weight": T.Q8_0})  # fmt: skip
    path = tmp / "tiny.gguf"
    write_gguf(path, src, quant=quant)
    return path, tmp / "cache"


def test_native_model_runs_the_row_ops_and_speculative_equals_plain(native_gguf) -> None:  # type: ignore[no-untyped-def]
    from specpilot.drafters import make_drafter
    from specpilot.loading import load_model
    from specpilot.model import Transformer

    path, cache_dir = native_gguf
    target: Transformer = load_model(str(path), cache_dir=cache_dir, weights="native").model
    draft = load_model(str(path), cache_dir=cache_dir, weights="native").model
    assert target.native and target.rowops
    layer = target.model.layers[0]
    assert layer.rowop is not None and layer.self_attn.rowop is not None
    assert layer.mlp.rowop is not None and target.model.norm.rowop is not None
    run_generate(target, PROMPTS, lambda: make_drafter("suffix"))
    run_generate(target, PROMPTS[:1], lambda: make_drafter("model", draft=draft))
    # the row ops change only rounding: the torch formulas give nearly the same logits
    target.setup_cache(32, attention="exact")
    toks, pos = torch.tensor([[1, 5, 9, 2, 7]]), torch.arange(5)[None]
    with torch.no_grad():
        on = target(toks, pos, 0, 5).logits
        assert not target.set_rowops(False) and layer.rowop is None
        off = target(toks, pos, 0, 5).logits
        assert target.set_rowops(True)
    assert on is not None and off is not None
    assert torch.allclose(on, off, atol=1e-4)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3", "qwen2"])
def test_row_ops_on_other_architectures_keep_speculative_equal_plain(arch: str) -> None:
    """Gemma (offset norms, q/k norms, GELU-tanh, four norms), Qwen3 (q/k norms), Qwen2 (biases)
    with the row ops turned on over fp32 weights."""
    from specpilot.drafters import make_drafter

    from .conftest import tiny_model

    kw = {"qk_norm": True} if arch == "gemma3" else {}
    model = tiny_model(arch, seed=4, std=0.15, **kw)
    model.setup_cache(64, attention="exact")
    toks, pos = torch.tensor([[1, 5, 9, 2, 7, 3]]), torch.arange(6)[None]
    with torch.no_grad():
        off = model(toks, pos, 0, 6).logits
        assert model.set_rowops(True)
        on = model(toks, pos, 0, 6).logits
    assert on is not None and off is not None
    assert torch.allclose(on, off, atol=1e-4) and not torch.equal(on, off)
    assert (model.model.layers[0].rowop is None) == (arch == "gemma3")  # no add+norm in Gemma
    run_generate(model, PROMPTS, lambda: make_drafter("suffix"))


def test_without_a_compiler_the_model_keeps_the_torch_formulas(
    monkeypatch: pytest.MonkeyPatch, native_gguf  # type: ignore[no-untyped-def]
) -> None:
    from specpilot.loading import load_model

    from .conftest import tiny_model

    model = tiny_model("llama", seed=5)
    model.setup_cache(32, attention="exact")
    toks, pos = torch.tensor([[1, 5, 9, 2]]), torch.arange(4)[None]
    with torch.no_grad():
        want = model(toks, pos, 0, 4).logits
    reason = "native GGUF kernels unavailable: no C++ compiler found (set CXX or install g++)"
    monkeypatch.setattr(build, "_state", {"reason": reason})
    assert not rowops.available()
    assert not model.set_rowops(True) and not model.rowops
    assert all(getattr(m, "rowop", None) is None for m in model.modules())
    with torch.no_grad():
        got = model(toks, pos, 0, 4).logits
    assert got is not None and want is not None and torch.equal(got, want)
    path, cache_dir = native_gguf
    loaded = load_model(str(path), cache_dir=cache_dir, weights="native")
    assert not loaded.model.native and not loaded.model.rowops
    assert any("no C++ compiler" in n for n in loaded.notes)
