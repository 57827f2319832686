"""The AVX-512 path's packed Q4_0 / Q4_1 / Q8_0 layout: the same bytes reordered, the same bits."""

from __future__ import annotations

import pytest
import torch

from specpilot import kernels
from specpilot.kernels import int8
from specpilot.kernels.linear import isa_code

from .test_kernels import ISAS, as_tensor, qt, random_weight

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=kernels.unavailable_reason() or "kernels unavailable"
)
AVX512 = "avx512" in ISAS
needs_avx512 = pytest.mark.skipif(not AVX512, reason="no AVX-512 VNNI here")
PACKABLE = ("Q4_0", "Q4_1", "Q8_0")
# k = 32 (a tail only), 256 (one group, no tail), 576 (SmolLM2: 2 groups + 2), 1536, 800 (3 + 1),
# 640 (Gemma 3 270M: 2 + 4), 224 (7 trailing blocks only), 352 (1 + 3)
SHAPES = [(2, 32), (6, 256), (10, 576), (4, 1536), (34, 800), (6, 640), (4, 224), (2, 352)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def op(x, blocks, code, n, k, bias=None, isa="auto", rt=0, ct=0):  # type: ignore[no-untyped-def]
    return torch.ops.specpilot.gguf_matmul_q8(x, blocks, code, n, k, bias, isa_code(isa), rt, ct)


@pytest.mark.parametrize("name", PACKABLE)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_pack_moves_every_byte_and_unpack_restores_them(name: str, n: int, k: int) -> None:
    raw = as_tensor(random_weight(name, n, k, seed=n + k))
    packed = int8.pack(raw, qt(name), n, k)
    assert packed.shape == raw.shape
    assert not torch.equal(packed, raw)
    assert torch.equal(torch.sort(packed).values, torch.sort(raw).values)  # a permutation
    assert torch.equal(int8.pack(packed, qt(name), n, k, unpack=True), raw)


def test_pack_layout_of_one_group_by_hand() -> None:
    """Byte 64 w + 16 L + 4 i + b of a pair's group is nibble byte 4 w + b of block i + 4 (L & 1)
    of column L >> 1; then the 16 scales d, then (Q4_1) the 16 mins."""
    n, k = 2, 256
    raw = as_tensor(random_weight("Q4_1", n, k, seed=3)).view(n, 8, 20)
    packed = int8.pack(raw.reshape(-1), qt("Q4_1"), n, k)
    for w, L, i, b in [(0, 0, 0, 0), (3, 1, 2, 3), (2, 2, 1, 0), (1, 3, 3, 2)]:
        col, blk = L >> 1, i + 4 * (L & 1)
        assert packed[64 * w + 16 * L + 4 * i + b] == raw[col, blk, 4 + 4 * w + b]
    for col in range(2):
        for j in range(8):
            at = 2 * (8 * col + j)
            assert torch.equal(packed[256 + at : 258 + at], raw[col, j, 0:2])  # d
            assert torch.equal(packed[288 + at : 290 + at], raw[col, j, 2:4])  # m


@pytest.mark.parametrize("name", PACKABLE)
def test_pack_layout_of_the_trailing_blocks_by_hand(name: str) -> None:
    """After a pair's full groups, its T trailing blocks: byte 8 T w + 4 (T c + j) + b is byte
    4 w + b of the integers of trailing block j of column c (V words: 4 nibble words, Q8_0 8);
    then the 2 T scales d, then (Q4_1) the mins."""
    n, k, tail = 2, 256 + 3 * 32, 3
    bb, off = {"Q4_0": (18, 2), "Q4_1": (20, 4), "Q8_0": (34, 2)}[name]
    words = (bb - off) // 4
    raw = as_tensor(random_weight(name, n, k, seed=5)).view(n, 11, bb)
    packed = int8.pack(raw.reshape(-1), qt(name), n, k)
    base = 16 * bb  # one full group of the pair
    for c in range(2):
        for j in range(tail):
            ci = tail * c + j
            for w in range(words):
                got = packed[base + 8 * tail * w + 4 * ci : base + 8 * tail * w + 4 * ci + 4]
                assert torch.equal(got, raw[c, 8 + j, off + 4 * w : off + 4 * w + 4])
            for h in range(off // 2):  # d, then (Q4_1) m
                at = base + 8 * tail * words + 4 * tail * h + 2 * ci
                assert torch.equal(packed[at : at + 2], raw[c, 8 + j, 2 * h : 2 * h + 2])


def test_pack_layout_of_a_q8_0_group_by_hand() -> None:
    """Q8_0: 8 vectors, byte 64 w + 4 (8 c + j) + b is byte 4 w + b of block j's integers of
    column c, then the 16 scales."""
    n, k = 2, 256
    raw = as_tensor(random_weight("Q8_0", n, k, seed=7)).view(n, 8, 34)
    packed = int8.pack(raw.reshape(-1), qt("Q8_0"), n, k)
    for w, c, j, b in [(0, 0, 0, 0), (7, 1, 7, 3), (5, 0, 3, 1), (2, 1, 6, 2)]:
        assert packed[64 * w + 4 * (8 * c + j) + b] == raw[c, j, 2 + 4 * w + b]
    for c in range(2):
        for j in range(8):
            at = 512 + 2 * (8 * c + j)
            assert torch.equal(packed[at : at + 2], raw[c, j, 0:2])


@needs_avx512
@pytest.mark.parametrize("name", PACKABLE)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_packed_gemm_gives_the_same_bits_for_every_count_thread_and_tile(
    name: str, n: int, k: int
) -> None:
    raw = as_tensor(random_weight(name, n, k, seed=n * k))
    packed = int8.pack(raw, qt(name), n, k)
    code = qt(name) | int8.PACKED
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        for m in (*range(1, 18), 33):  # every row-tile instance (1-16), a 16 + 1 and 2 x 16 + 1
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
            want = op(x, raw, qt(name), n, k, bias, isa="portable")
            for t in (1, 2):
                torch.set_num_threads(t)
                for rt, ct in [(0, 0), (1, 1), (2, 3), (3, 2), (16, 8)]:
                    got = op(x, packed, code, n, k, bias, "avx512", rt, ct)
                    assert torch.equal(bits(got), bits(want)), (m, t, rt, ct)
            assert torch.equal(bits(op(x, packed, code, n, k)), bits(op(x, raw, qt(name), n, k)))
    finally:
        torch.set_num_threads(threads)


@needs_avx512
@pytest.mark.parametrize("name", PACKABLE)
@pytest.mark.parametrize("k", [32, 576, 640, 352])
def test_packed_gemm_split_between_threads_at_an_odd_column(name: str, k: int) -> None:
    """Two threads split 502 columns at column 251 (an odd one, inside a column pair and inside
    the 4-16 columns whose trailing blocks are summed together): the same bits as the portable
    reference and as one thread."""
    n = 502
    raw = as_tensor(random_weight(name, n, k, seed=k))
    packed = int8.pack(raw, qt(name), n, k)
    code = qt(name) | int8.PACKED
    threads = torch.get_num_threads()
    try:
        for m in (1, 3, 17):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
            want = op(x, raw, qt(name), n, k, isa="portable")
            for t in (1, 2):
                torch.set_num_threads(t)
                got = op(x, packed, code, n, k, None, "avx512")
                assert torch.equal(bits(got), bits(want)), (m, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", PACKABLE)
@pytest.mark.parametrize("k", [576, 352])
def test_every_prefetch_distance_gives_the_same_bits(name: str, k: int) -> None:
    """The int8 GEMMs' prefetch distance (the kernel_prefetch mechanism) is a schedule choice:
    packed (AVX-512) and GGUF-ordered weights (every ISA here), one and several rows, one and
    two threads, one linear and a fused call: the bits of the portable reference."""
    n = 70  # the distances reach past the last column, stop inside a thread's columns, and both
    raw = as_tensor(random_weight(name, n, k, seed=k + 1))
    weights = [(raw, qt(name), isa) for isa in ISAS]
    if AVX512:
        weights.append((int8.pack(raw, qt(name), n, k), qt(name) | int8.PACKED, "avx512"))
    fused = torch.ops.specpilot.gguf_matmul_q8_multi
    threads, before = torch.get_num_threads(), int8.prefetch()
    try:
        for m in (1, 2, 5, 17):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
            want = op(x, raw, qt(name), n, k, isa="portable")
            for columns in (*int8.PREFETCH_COLUMNS[1:], 2, 1000, 0):
                assert int8.set_prefetch(columns) >= 0 and int8.prefetch() == columns
                for t in (1, 2):
                    torch.set_num_threads(t)
                    for blocks, code, isa in weights:
                        got = op(x, blocks, code, n, k, None, isa)
                        assert torch.equal(bits(got), bits(want)), (m, columns, t, isa)
                        two = fused(x, [blocks, blocks], [code, code], [n, n], k, None,
                                    isa_code(isa), 0, 0)  # fmt: skip
                        assert torch.equal(bits(two), bits(torch.cat([want, want], 1)))
    finally:
        torch.set_num_threads(threads)
        int8.set_prefetch(before)
    for bad in (-1, 1.5, True, 1 << 21):
        with pytest.raises(ValueError, match="prefetch distance"):
            int8.set_prefetch(bad)  # type: ignore[arg-type]


@needs_avx512
def test_fused_call_runs_packed_and_plain_parts_together() -> None:
    k = 576
    parts = [(qt("Q4_1"), 8), (qt("Q8_0"), 6), (qt("Q4_0"), 4)]
    raws = [as_tensor(random_weight(n_, n, k, seed=n)) for n_, n in [("Q4_1", 8), ("Q8_0", 6),
                                                                     ("Q4_0", 4)]]  # fmt: skip
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    fused = torch.ops.specpilot.gguf_matmul_q8_multi
    want = fused(x, raws, [t for t, _ in parts], [n for _, n in parts], k, None, 0, 0, 0)
    blocks = [int8.pack(raws[0], parts[0][0], 8, k), raws[1], int8.pack(raws[2], parts[2][0], 4, k)]
    codes = [parts[0][0] | int8.PACKED, parts[1][0], parts[2][0] | int8.PACKED]
    got = fused(x, blocks, codes, [n for _, n in parts], k, None, 0, 0, 0)
    assert torch.equal(bits(got), bits(want))


@needs_avx512
def test_linear_packs_in_the_int8_profile_and_unpacks_for_any_other_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n, k = 8, 576
    raw = as_tensor(random_weight("Q4_1", n, k, seed=11))
    lin = kernels.GGUFLinear(raw.clone(), qt("Q4_1"), n, k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2))
    w32 = lin.weight.clone()
    lin._dense = None  # the fp32 copy is made again below, from the packed blocks
    lin.profile = "int8"
    assert lin.packed and lin.qcode == qt("Q4_1") | int8.PACKED and lin.int8
    assert not torch.equal(lin.blocks, raw) and torch.equal(lin.gguf_blocks(), raw)
    assert torch.equal(bits(lin(x)), bits(op(x, raw, qt("Q4_1"), n, k)))
    assert torch.equal(lin.weight, w32)
    lin.isa = isa_code("avx2")  # another path reads the blocks as GGUF has them
    assert not lin.packed and torch.equal(lin.blocks, raw)
    lin.isa = isa_code("auto")
    assert lin.packed
    lin.profile = "fp32"
    assert not lin.packed and torch.equal(lin.blocks, raw)
    monkeypatch.setenv(int8.PACK_ENV, "0")
    lin.profile = "int8"
    assert not lin.packed
    monkeypatch.delenv(int8.PACK_ENV)
    odd = kernels.GGUFLinear(as_tensor(random_weight("Q4_1", 7, k, seed=1)), qt("Q4_1"), 7, k)
    odd.profile = "int8"
    q5 = kernels.GGUFLinear(as_tensor(random_weight("Q5_0", n, k, seed=1)), qt("Q5_0"), n, k)
    q5.profile = "int8"
    assert not odd.packed and not q5.packed  # an odd n, a type without the layout


@needs_avx512
@pytest.mark.parametrize(("n", "k"), [(8, 64), (10, 576)])
def test_a_tied_head_packs_and_the_embedding_reads_the_packed_blocks(n: int, k: int) -> None:
    from specpilot.loading.native import TiedHead

    raw = as_tensor(random_weight("Q8_0", n, k, seed=4))
    emb = kernels.GGUFEmbedding(raw.clone(), qt("Q8_0"), n, k)
    head = TiedHead(emb.blocks, qt("Q8_0"), n, k)
    head.tie(emb)
    tokens = torch.tensor([[3, 0, n - 1, 4, 5, 3, 2]])  # 4, 5 and 3, 2: one pair each
    want_rows = emb(tokens)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(8))
    want = op(x, raw, qt("Q8_0"), n, k)
    head.profile = "int8"
    assert head.packed and emb.qcode == head.qcode == qt("Q8_0") | int8.PACKED
    assert emb.blocks.data_ptr() == head.blocks.data_ptr() and not torch.equal(emb.blocks, raw)
    assert torch.equal(bits(emb(tokens)), bits(want_rows))  # rows read from their packed pairs
    assert torch.equal(bits(head(x)), bits(want))
    head.profile = "fp32"
    assert not head.packed and emb.qcode == qt("Q8_0") and torch.equal(emb.blocks, raw)
    assert torch.equal(bits(emb(tokens)), bits(want_rows))


def test_packed_weights_off_the_avx512_path_are_a_clear_error() -> None:
    n, k = 4, 64
    raw = as_tensor(random_weight("Q4_1", n, k, seed=6))
    packed = int8.pack(raw, qt("Q4_1"), n, k)
    with pytest.raises(RuntimeError, match="AVX-512 path only"):
        op(torch.randn(1, k), packed, qt("Q4_1") | int8.PACKED, n, k, isa="portable")
    with pytest.raises(RuntimeError, match="only Q4_0, Q4_1 and Q8_0 weights pack"):
        int8.pack(as_tensor(random_weight("Q5_0", n, k, seed=6)), qt("Q5_0"), n, k)
    with pytest.raises(RuntimeError, match="even n"):
        int8.pack(raw[: raw.numel() * 3 // 4], qt("Q4_1"), 3, k)
