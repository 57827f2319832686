"""Native GGUF kernels under a numerics contract: linears that read the weights in their blocks.

Numerics contract (fp32-activation profile). For ``y = x W^T + b`` with x of shape (m, k) in
fp32 and W of shape (n, k) in a GGUF block type, every output element is computed as follows,
from row r of x and row n of W only:

1. Weights. ``w[n, k]`` is exactly the fp32 value ``gguf.quants.dequantize`` gives for that
   element (fp16 scales widened exactly; then the reference's products and sums, each rounded to
   fp32 once; e.g. Q4_1 ``d*q + m``, Q4_K ``(d*sc)*q - dmin*mn``, Q6_K ``(d*scale)*q``).
2. Products. Eight fp32 accumulator lanes, all starting at +0. Element k goes to lane ``k % 8``
   and is accumulated in increasing k by a fused multiply-add, ``lane = fma(x[r, k], w[n, k],
   lane)`` (one rounding; ``std::fma`` in the portable path, ``_mm256_fmadd_ps`` in AVX2).
3. Reduction. With lanes a0..a7: ``s_i = a_i + a_(i+4)`` (i < 4), ``t_i = s_i + s_(i+2)``
   (i < 2), ``sum = t_0 + t_1``.
4. Bias last: ``y[r, n] = sum + b[n]`` (no bias: ``y = sum``).

The order is defined at a fixed lane width, so it does not depend on the number of rows in the
call, a row's position among them, the thread count (threads split the n columns, never k), the
tiling of rows and columns, or the ISA: the portable and AVX2 paths give the same bits, and a
reference output is portable across x86 machines. Dense F32/F16/BF16 weights follow the same
order; running a block type natively equals running the dense F32 kernel on its dequantized
weights, bit for bit. Tests: tests/test_kernels.py.

Block types run in place: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, F32, F16, BF16
(:func:`supports`); others are to be dequantized by the caller. The C++ sources (``csrc/``)
build on first use (:mod:`specpilot.kernels.build`); without a compiler :func:`available` is
False and :func:`unavailable_reason` says why in one line.
"""

from specpilot.kernels.linear import (
    QTYPES,
    GGUFEmbedding,
    GGUFLinear,
    available,
    check_blocks,
    dequantize_rows,
    gguf_matmul,
    gguf_matmul_reference,
    reader_blocks,
    supports,
    unavailable_reason,
)

__all__ = [
    "QTYPES",
    "GGUFEmbedding",
    "GGUFLinear",
    "available",
    "check_blocks",
    "dequantize_rows",
    "gguf_matmul",
    "gguf_matmul_reference",
    "reader_blocks",
    "supports",
    "unavailable_reason",
]
