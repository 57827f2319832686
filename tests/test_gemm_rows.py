"""The native GEMM's row paths (issue 16): every row count 1..17 under every tile and thread
count gives the portable path's bits, for every block type. Four rows of a 32-element block
type run the direct 4 x CN register tile; K-quant and dense rows (and 5+ rows of any type) run
the decoded-panel path; both must equal the contract's reference order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from specpilot import kernels
from specpilot.kernels.linear import COL_TILES, ROW_TILES

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=kernels.unavailable_reason() or "kernels unavailable"
)

AVX2 = torch.ops.specpilot.isa_available(2) == 1 if kernels.available() else False
QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
DENSE = ["F32", "F16", "BF16"]
BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}
SIZES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}
"""Byte offsets of the fp16 scale fields inside one block."""
TILES = [(0, 0), *((rt, ct) for rt in ROW_TILES for ct in COL_TILES)]


def random_blocks(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Raw GGUF bytes of a random valid (n, k) tensor with finite scales (subnormals included)."""
    rng = np.random.default_rng(seed)
    if name in DENSE:
        w = rng.standard_normal((n, k)).astype(np.float32)
        if name == "F16":
            raw = w.astype(np.float16).view(np.uint8)
        elif name == "BF16":
            raw = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            raw = w.view(np.uint8)
    else:
        nb = n * k // BLOCK[name]
        raw = rng.integers(0, 256, size=(nb, SIZES[name]), dtype=np.uint8)
        for off in SCALES[name]:
            mag = 10.0 ** rng.uniform(-7, -1, size=nb)
            d = (rng.choice([-1.0, 1.0], size=nb) * mag).astype(np.float16)
            raw[:, off : off + 2] = d.view(np.uint8).reshape(nb, 2)
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).copy())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def small_k(name: str) -> int:
    return 512 if name in ("Q4_K", "Q6_K") else 8 * 37 + 5 if name in DENSE else 32 * 9


@pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2+FMA+F16C")
@pytest.mark.parametrize("name", QUANT + DENSE)
def test_every_row_count_tile_and_thread_count_equals_portable(name: str) -> None:
    """m = 1..17 (direct tiles to 3 or 4 rows, panels beyond), every (row, column) tile the
    kernel tiling mechanism can choose, one and two threads; n = 41 is no multiple of a column
    tile or of the 12-column thread unit."""
    n, k = 41, small_k(name)
    raw = random_blocks(name, n, k, 7)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(8)) * 2
    b = torch.randn(n, generator=torch.Generator().manual_seed(9))
    prev = torch.get_num_threads()
    try:
        for m in range(1, 18):
            ref = kernels.gguf_matmul(x[:m], raw, int(getattr(T, name)), n, k, b, "portable")
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for tile in TILES:
                    got = kernels.gguf_matmul(x[:m], raw, int(getattr(T, name)), n, k, b,
                                              "avx2", *tile)
                    assert same_bits(got, ref), (m, threads, tile)
    finally:
        torch.set_num_threads(prev)


GEMMA_SHAPES = [("Q5_0", 300, 640), ("Q8_0", 300, 640), ("Q4_K", 150, 1024), ("Q6_K", 150, 2048)]
"""Gemma 3 270M's block types at its k (q/k/gate/up Q5_0, v and the head Q8_0, o_proj Q4_K,
down Q6_K); n cut down and odd so the test stays fast and splits unevenly over threads."""


@pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2+FMA+F16C")
@pytest.mark.parametrize(("name", "n", "k"), GEMMA_SHAPES)
def test_gemma_shapes_rows_equal_one_row_calls(name: str, n: int, k: int) -> None:
    """Each row of a 2..9-row call at the default tiles equals the same row computed alone
    (plain decoding) and the portable path, on one and two threads."""
    qt = int(getattr(T, name))
    raw = random_blocks(name, n, k, 21)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(22))
    prev = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            single = [kernels.gguf_matmul(x[r : r + 1], raw, qt, n, k, None, "avx2")
                      for r in range(9)]
            for m in range(2, 10):
                got = kernels.gguf_matmul(x[:m], raw, qt, n, k, None, "avx2")
                ref = kernels.gguf_matmul(x[:m], raw, qt, n, k, None, "portable")
                assert same_bits(got, ref), (m, threads)
                for r in range(m):
                    assert same_bits(got[r], single[r][0]), (m, r, threads)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2+FMA+F16C")
@pytest.mark.parametrize("name", ["Q8_0", "Q5_0", "Q4_K"])
def test_four_row_tile_keeps_rows_apart(name: str) -> None:
    """A change in one x row of a 4-row call (the direct 4 x CN tile for Q8_0 / Q5_0, panels
    for Q4_K) changes that row's outputs only: the tile does not mix rows."""
    qt, n, k = int(getattr(T, name)), 37, 512
    raw = random_blocks(name, n, k, 31)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(32))
    base = kernels.gguf_matmul(x, raw, qt, n, k, None, "avx2")
    for r in range(4):
        x2 = x.clone()
        x2[r, 100] += 1.0
        other = kernels.gguf_matmul(x2, raw, qt, n, k, None, "avx2")
        changed = (other.view(torch.int32) != base.view(torch.int32)).any(dim=1)
        assert changed.tolist() == [i == r for i in range(4)]
