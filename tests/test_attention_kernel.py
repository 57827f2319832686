"""Batch-invariant fp32 attention (``attention="fixed"``): values, the order contract, the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpilot import kernels
from specpilot.batch import BatchConfig, BatchEngine, BatchRequest, run_batch
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError
from specpilot.kernels import build
from specpilot.model import causal_mask

from .conftest import tiny_model
from .test_engine import SPECS, OracleDrafter

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=kernels.unavailable_reason() or "kernels unavailable"
)

AVX2 = torch.ops.specpilot.isa_available(2) == 1 if kernels.available() else False
ISAS = kernels.runnable_isas() or ["portable"]
VECTOR = [i for i in ISAS if i != "portable"]
"""The vector paths this CPU runs (AVX2, AVX-512): each must give the portable bits."""


def inputs(b: int, h: int, hk: int, t: int, hd: int, length: int, seed: int):  # type: ignore[no-untyped-def]
    """q (B, H, T, hd) as the model lays it out (a transposed (B, T, H, hd)); a cache-like
    k/v (B, Hk, length + 3, hd) of which the first ``length`` slots are used."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, hd, generator=g).transpose(1, 2)
    k = torch.randn(b, hk, length + 3, hd, generator=g)
    v = torch.randn(b, hk, length + 3, hd, generator=g)
    return q, k, v


def random_mask(b: int, t: int, length: int, seed: int, p: float = 0.6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, t, length, generator=g) < p
    m[:, :, 0] = True  # every row sees a key (fully masked rows: their own test)
    return m


def sdpa64(q, k, v, length, mask, scale=None):  # type: ignore[no-untyped-def]
    m = None if mask is None else mask.unsqueeze(1)
    kk, vv = k[:, :, :length].double(), v[:, :, :length].double()
    return F.scaled_dot_product_attention(
        q.double(), kk, vv, attn_mask=m, enable_gqa=True, scale=scale
    )


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "b,h,hk,t,hd,length",
    [(1, 9, 3, 1, 64, 200), (2, 4, 2, 7, 16, 37), (1, 4, 4, 3, 256, 600), (3, 6, 1, 5, 12, 1),
     (1, 8, 2, 64, 64, 129), (2, 2, 1, 2, 40, 9)],
)  # fmt: skip
@pytest.mark.parametrize("masked", [False, True])
def test_matches_fp64_sdpa(b, h, hk, t, hd, length, masked, isa) -> None:  # type: ignore[no-untyped-def]
    q, k, v = inputs(b, h, hk, t, hd, length, seed=length + hd)
    mask = random_mask(b, t, length, seed=t) if masked else None
    scale = 0.3 if hd == 40 else None  # Gemma's query_pre_attn_scalar: a scale not 1/sqrt(hd)
    out = kernels.fixed_attention(q, k, v, length, mask, scale, isa)
    ref = sdpa64(q, k, v, length, mask, scale)
    assert out.shape == (b, h, t, hd) and out.dtype == torch.float32
    assert out.transpose(1, 2).is_contiguous()  # (B, T, H * hd) for o_proj without a copy
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)


def test_broadcast_mask_and_fully_masked_rows() -> None:
    q, k, v = inputs(2, 4, 2, 3, 16, 10, seed=1)
    causal = causal_mask(7, 3, 10, torch.device("cpu"))  # (1, T, kv_len), broadcast over B
    out = kernels.fixed_attention(q, k, v, 10, causal)
    torch.testing.assert_close(out.double(), sdpa64(q, k, v, 10, causal), rtol=1e-5, atol=2e-6)
    mask = causal.expand(2, 3, 10).clone()
    mask[1, 2] = False  # one row sees nothing: zeros, not NaN
    out = kernels.fixed_attention(q, k, v, 10, mask)
    assert torch.equal(out[1, :, 2], torch.zeros(4, 16))
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], kernels.fixed_attention(q[:1], k[:1], v[:1], 10, mask[:1])[0])
    empty = kernels.fixed_attention(q, k, v, 0, None)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_bad_shapes_are_refused() -> None:
    q, k, v = inputs(1, 4, 2, 2, 16, 8, seed=2)
    with pytest.raises(RuntimeError, match="group"):
        kernels.fixed_attention(q[:, :3], k, v, 8)
    with pytest.raises(RuntimeError, match="expected"):
        kernels.fixed_attention(q, k, v, 100)
    with pytest.raises(RuntimeError, match="mask"):
        kernels.fixed_attention(q, k, v, 8, torch.ones(1, 2, 7, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.fixed_attention(q.double(), k, v, 8)


def one_row(q, k, v, length, mask, b, h, t, isa):  # type: ignore[no-untyped-def]
    """Row (b, h, t) computed alone: one query row, one head group, one batch entry."""
    group = q.shape[1] // k.shape[1]
    kh = h // group
    m = None if mask is None else mask[b : b + 1, t : t + 1]
    qq = q[b : b + 1, h : h + 1, t : t + 1]
    return kernels.fixed_attention(
        qq, k[b : b + 1, kh : kh + 1], v[b : b + 1, kh : kh + 1], length, m, None, isa
    )[0, 0, 0]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 3),
    group=st.sampled_from([(2, 2), (4, 2), (6, 3), (3, 1), (8, 2), (9, 3), (4, 1)]),
    t=st.integers(1, 64),
    hd=st.sampled_from([8, 16, 64, 24, 12]),
    length=st.integers(1, 300),
    masked=st.booleans(),
    isa=st.sampled_from(ISAS),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 10_000),
)
def test_rows_bit_identical_across_counts_positions_threads_isas(
    b, group, t, hd, length, masked, isa, threads, seed
) -> None:  # type: ignore[no-untyped-def]
    h, hk = group
    q, k, v = inputs(b, h, hk, t, hd, length, seed)
    mask = random_mask(b, t, length, seed) if masked else None
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = kernels.fixed_attention(q, k, v, length, mask, None, isa)
    finally:
        torch.set_num_threads(prev)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        bi, hi, ti = (int(torch.randint(n, (1,), generator=g)) for n in (b, h, t))
        alone = one_row(q, k, v, length, mask, bi, hi, ti, "portable")
        assert torch.equal(bits(full[bi, hi, ti]), bits(alone)), (bi, hi, ti)


def test_thread_split_and_isas_give_the_same_bits() -> None:
    """Large enough that two threads really split the rows (grain here: 1 row)."""
    q, k, v = inputs(2, 8, 2, 16, 64, 1024, seed=3)
    mask = random_mask(2, 16, 1024, seed=3)
    prev = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs += [kernels.fixed_attention(q, k, v, 1024, mask, None, isa) for isa in ISAS]
    finally:
        torch.set_num_threads(prev)
    for o in outs[1:]:
        assert torch.equal(bits(o), bits(outs[0]))


def prefill_mask(kind: str, t: int, length: int, seed: int) -> torch.Tensor | None:
    """(1, t, length): the last t slots are the rows' own. ``causal``: row i sees slots up to its
    own; ``tree``: row i sees the prefix, its ancestors in a random tree over the t rows (parent
    of node i: a node before it, or none) and itself; ``none``: every row sees all."""
    past = length - t
    if kind == "none":
        return None
    if kind == "causal":
        return causal_mask(past, t, length, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(1, t, length, dtype=torch.bool)
    m[0, :, :past] = True
    for i in range(t):
        parent = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
        m[0, i, past + i] = True
        if parent >= 0:
            m[0, i] |= m[0, parent]
    return m


@pytest.mark.skipif("avx512" not in ISAS, reason="the CPU (or the build) has no AVX-512 path")
@pytest.mark.parametrize("hd", [64, 32, 24, 40, 12])  # 24, 40: a half register; 12: portable
@pytest.mark.parametrize("h,hk", [(4, 4), (9, 3), (8, 2), (10, 2), (12, 2)])  # groups 1-6
@pytest.mark.parametrize("kind", ["causal", "tree", "none"])
def test_avx512_avx2_portable_same_bits_on_prefill_shapes(kind, h, hk, hd) -> None:  # type: ignore[no-untyped-def]
    """The AVX-512 path against the AVX2 and portable ones, bit for bit, on prefill / verify
    shapes: 1 to 70 query rows sharing most of up to 300 keys, tiles of every size (groups of
    1, 3, 4, 5, 6 heads), full and half last registers."""
    for t, length in [(1, 1), (1, 250), (2, 9), (5, 130), (8, 250), (16, 17), (33, 300), (70, 70),
                      (70, 291)]:  # fmt: skip
        seed = 1000 * t + length + hd
        q, k, v = inputs(1, h, hk, t, hd, length, seed)
        mask = prefill_mask(kind, t, length, seed)
        outs = {isa: kernels.fixed_attention(q, k, v, length, mask, None, isa)
                for isa in ("portable", "avx2", "avx512")}  # fmt: skip
        for isa in ("avx2", "avx512"):
            assert torch.equal(bits(outs[isa]), bits(outs["portable"])), (isa, t, length)


@pytest.mark.parametrize("isa", ISAS)
def test_rank_not_slot_orders_the_keys(isa: str) -> None:
    """A tree row sees the prefix and its ancestors at scattered slots; the plain-decoding row at
    the same position sees the same keys contiguously. Same keys in the same order: same bits."""
    p, hd = 21, 64
    q, k, v = inputs(1, 4, 2, 1, hd, p + 12, seed=4)
    tree_slots = [*range(p), p + 2, p + 5, p + 6, p + 11]  # ancestors among other nodes
    plain_slots = list(range(p + 4))
    kt, vt = k.clone(), v.clone()
    kp, vp = torch.zeros_like(k), torch.zeros_like(v)
    kp[:, :, plain_slots], vp[:, :, plain_slots] = kt[:, :, tree_slots], vt[:, :, tree_slots]
    tree_mask = torch.zeros(1, 1, p + 12, dtype=torch.bool)
    tree_mask[0, 0, tree_slots] = True
    tree = kernels.fixed_attention(q, kt, vt, p + 12, tree_mask, None, isa)
    plain = kernels.fixed_attention(q, kp, vp, p + 4, None, None, isa)
    assert torch.equal(bits(tree), bits(plain))


def test_planted_slot_lanes_would_change_bits() -> None:
    """The rank rule matters: summing the same weights with lanes by slot instead of rank (what
    a kernel that ignored the mask's gaps would do) gives other bits, so the test above can
    fail."""

    def red(a: torch.Tensor) -> torch.Tensor:
        s = a[:4] + a[4:]
        t = s[:2] + s[2:]
        return t[0] + t[1]

    differ = 0
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(40, generator=g) * 2).exp()  # softmax weights span magnitudes
        by_rank, by_slot = torch.zeros(8), torch.zeros(8)
        for i in range(40):
            by_rank[i % 8] += w[i]
            by_slot[(i + (3 if i >= 20 else 0)) % 8] += w[i]  # three masked slots before key 20
        differ += not torch.equal(red(by_rank), red(by_slot))
    assert differ >= 3


def test_fixed_exp_is_one_function() -> None:
    x = torch.cat(
        [
            torch.linspace(-100.0, 0.0, 200_001),
            torch.tensor([0.0, -0.0, -87.33654, -87.3365, -1e-30, -88.0, -float("inf"), 1.0]),
        ]
    )
    outs = [kernels.fixed_exp(x, isa) for isa in ISAS]
    for o in outs[1:]:
        assert torch.equal(bits(o), bits(outs[0]))
    e = outs[0].double()
    ref = x.double().exp()
    ok = x >= -87.33654
    assert ((e[ok] - ref[ok]).abs() / ref[ok]).max() < 2.5e-7  # ~2 ulp
    assert torch.equal(e[~ok], torch.zeros_like(e[~ok]))
    assert e[x == 0].eq(1.0).all()


def test_custom_op_traces_under_torch_compile() -> None:
    q, k, v = inputs(1, 4, 2, 3, 16, 12, seed=6)
    mask = random_mask(1, 3, 12, seed=6)

    def f(q, k, v, mask):  # type: ignore[no-untyped-def]
        o = kernels.fixed_attention(q, k, v, 12, mask)
        return o.transpose(1, 2).reshape(1, 3, 64) * 2.0

    want = f(q, k, v, mask)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v, mask), want)


# -- the model ------------------------------------------------------------------------------------


def test_model_forward_traces_under_torch_compile() -> None:
    """The whole forward with attention fixed is one graph (the op's fake kernel), same bits."""
    model = tiny_model("llama", seed=1, dim=64, n_heads=4, n_kv_heads=2)
    model.setup_cache(32, attention="fixed")
    ids, pos = torch.tensor([[5, 9, 2, 7, 7, 1]]), torch.arange(6)[None]
    mask = causal_mask(0, 6, 6, model.device)
    with torch.no_grad():
        want = model(ids, pos, 0, 6, mask).logits
        compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(ids, pos, 0, 6, mask).logits, want)


def test_auto_picks_fixed_on_cpu_and_model_matches_exact() -> None:
    assert EngineConfig().resolved_attention == "fixed"
    model = tiny_model("llama", seed=2, dim=64, n_heads=4, n_kv_heads=2)
    ids = torch.tensor([[5, 9, 2, 7, 7, 1, 30, 4]])
    pos = torch.arange(8)[None]
    logits = {}
    for kind in ("fixed", "exact"):
        model.setup_cache(16, attention=kind)
        dtype = model.model.layers[0].self_attn.cache.k.dtype
        assert dtype == (torch.float32 if kind == "fixed" else torch.float64)
        with torch.no_grad():
            logits[kind] = model(ids, pos, 0, 8, causal_mask(0, 8, 8, model.device)).logits
    torch.testing.assert_close(logits["fixed"], logits["exact"], rtol=1e-5, atol=1e-5)


def fixed_engine(model) -> Engine:  # type: ignore[no-untyped-def]
    return Engine(model, EngineConfig(attention="fixed", linear="onednn"))


@pytest.mark.parametrize(
    "arch,spec",
    [("llama", SPECS[0]), ("llama", SPECS[1]), ("llama", SPECS[2]), ("qwen3", SPECS[2])],
    ids=["llama-chain", "llama-static", "llama-dynamic", "qwen3-dynamic"],
)
def test_speculative_equals_plain_with_fixed_attention(arch: str, spec) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model(arch, seed=1, dim=64, n_heads=4, n_kv_heads=2)  # head_dim 16: AVX2 rows
    eng = fixed_engine(model)
    assert eng.attention == "fixed"
    prompt = [5, 9, 2, 7, 7, 1]
    gen = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    ref = eng.generate(prompt, gen).tokens
    for hit in (0.6, 1.0):
        res = eng.generate(prompt, gen, drafter=OracleDrafter(ref, 64, hit, 0), spec=spec)
        assert res.tokens == ref
        if hit == 1.0:
            assert res.tau > 1.5  # trees were really verified


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_batched_speculative_equals_alone_with_fixed_attention(packed: bool) -> None:
    model = tiny_model("qwen3", seed=4, dim=64, n_heads=4, n_kv_heads=2)
    eng = fixed_engine(model)
    prompts = [[3, 4, 5], [10, 20, 30, 40, 50, 60, 1], [7], [9, 9, 9, 9]]
    gen = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    refs = [eng.generate(p, gen).tokens for p in prompts]
    cfg = EngineConfig(attention="fixed", linear="onednn")
    beng = BatchEngine(model, cfg, BatchConfig(max_batch=3, max_len=96, packed=packed))
    reqs = [
        BatchRequest(p, gen, OracleDrafter(r, 64, hit, i), SPECS[2])
        for i, (p, r, hit) in enumerate(zip(prompts, refs, [0.0, 0.7, 1.0, 0.9], strict=True))
    ]
    outs = run_batch(beng, reqs)
    assert [o.result.tokens for o in outs] == refs


def test_gemma_sliding_window_speculative_equals_plain_with_fixed_attention() -> None:
    """Gemma-style: sliding layers (window 8) and a query_pre_attn_scalar scale, past the
    window; chain and tree drafts."""
    model = tiny_model(
        "gemma3", seed=3, std=0.1, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=3,
        query_pre_attn_scalar=24.0, sliding_window=8, tie_embeddings=True, qk_norm=True,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    )  # fmt: skip
    assert model.model.layers[0].self_attn.scale == 24.0**-0.5
    eng = fixed_engine(model)
    prompt = torch.randint(3, 64, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    gen = GenerationConfig(max_new_tokens=32, stop_on_eos=False)
    ref = eng.generate(prompt, gen).tokens
    for spec in SPECS[:3]:
        res = eng.generate(prompt, gen, drafter=OracleDrafter(ref, 64, 1.0, 1), spec=spec)
        assert res.tokens == ref and res.tau > 1.5


def test_without_kernels_auto_keeps_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "_state", {"reason": "native GGUF kernels unavailable: no c++"})
    assert not kernels.available()
    assert EngineConfig().resolved_attention == "exact"
    assert EngineConfig(device="cpu", attention="sdpa").resolved_attention == "sdpa"
    with pytest.raises(ConfigError, match="no c\\+\\+; use exact"):
        EngineConfig(attention="fixed")
    model = tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match="needs the native kernels"):
        model.setup_cache(8, attention="fixed")
    eng = Engine(model, EngineConfig())
    assert eng.attention == "exact"
    out = eng.generate([1, 2, 3], GenerationConfig(max_new_tokens=4, stop_on_eos=False))
    assert len(out.tokens) == 4 and model.model.layers[0].self_attn.cache.k.dtype == torch.float64


def test_fixed_needs_cpu_float32() -> None:
    with pytest.raises(ConfigError, match="CPU float32"):
        EngineConfig(attention="fixed", device="cuda", dtype="bfloat16")
