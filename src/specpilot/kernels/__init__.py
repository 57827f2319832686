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
tiling of rows and columns, or the ISA: the portable, AVX2 and AVX-512 paths give the same bits,
and a reference output is portable across x86 machines. (The AVX-512 GEMM holds two outputs'
8 lanes side by side in one 512-bit accumulator, two columns of one row: each half is still the
8-lane chain above.) The path is the widest the CPU runs unless ``$SPECPILOT_KERNELS_ISA`` says
``portable``, ``avx2``, ``avx512`` or ``amx`` (:func:`runnable_isas`; ``amx`` differs from
``avx512`` in the int8 profile only). Dense F32/F16/BF16 weights
follow the same order; running a block type natively equals running the dense F32 kernel on
its dequantized weights, bit for bit. Tests: tests/test_kernels.py. A fused call over several
linears of one x (``gguf_matmul_multi``, :class:`GGUFMultiLinear`: q/k/v of mixed block types)
computes each column by the same kernel as the separate call: tests/test_fused_linear.py.

Int8-activation contract (numerics profile ``int8``, :mod:`specpilot.kernels.int8`; ``fp32``
above is the default). For weight types Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, from row r of x and
row n of W only:

1. Activations. Each row of x is cut into blocks of 32 along k; per block ``d = max|x| / 127``
   (fp32 division), ``id = d != 0 ? 1 / d : 0``, ``q = nearbyint(x * id)`` (round half to even;
   |q| <= 127), ``s = d * float(sum q)`` (llama.cpp's Q8_0 rule, Q8_1's block sum, fp32 scales).
2. Weights. Weight block j (the 32 elements matching activation block j) as integers w with a
   scale a and a min b: Q4_0 ``nibble - 8``, Q5_0 ``q5 - 16``, Q8_0 ``int8``, a = d, b = 0;
   Q4_1 ``nibble``, a = d, b = m; Q4_K ``nibble``, a = d*sc, b = -(dmin*mn) (both exact in fp32);
   Q6_K ``q6 - 32``, a = d, b = 0, its two int8 sub-scales folded into the integer sum.
3. Block dot product, exact in int32: ``isum = sum w*q`` (Q6_K: ``sc0 * sum over the first 16
   + sc1 * sum over the last 16``); the order inside a block does not matter.
4. Accumulation. Eight fp32 lanes from +0; block j goes to lane ``j % 8`` in increasing j:
   ``lane = fma(a * d_x, float(isum), lane)`` (``a * d_x`` rounded to fp32 first), then for
   Q4_1 / Q4_K ``lane = fma(b, s_x, lane)``.
5. The fp32 contract's pairwise lane reduction, then the bias last.

The same independence holds (rows, positions, threads, tiles, portable, AVX2, AVX-512 VNNI and
AMX give the same bits). On the AMX path (Intel CPUs with AMX-INT8, Linux granting the tile
state) calls of Q4_0 / Q4_1 / Q5_0 / Q8_0 weights from 4 rows (6 where k > 1024) take step 3
from one ``tdpbssd`` tile product per weight block and 16 columns, exact int32 like every other
path, and steps 4-5 vectorized over the 16 columns, lane by lane (csrc/gemm_q8_amx.cpp).
On the AVX-512 path Q4_0 / Q4_1 / Q8_0 linears with an even n (a tied LM head included) run
their blocks packed (:attr:`GGUFLinear.packed`, :func:`int8.pack`: the same bytes reordered per
pair of columns so the blocks-across-lanes schedule loads its transposed vectors and its 16
scales as they are, at every row count); the layout changes the schedule only, never a bit
(tests/test_kernels_packed.py). The int8 result differs from the fp32 profile's (activation
rounding): each profile is its own reference, and plain decoding and speculation must run the
same one.
Dense F32/F16/BF16 weights have no int8 kernel and keep the fp32-activation kernel in this profile.
Tests: tests/test_kernels_int8.py.

Attention contract (``attention="fixed"``, :func:`fixed_attention`, fp32 q and KV cache). Output
row (b, h, t) is computed from q[b, h, t], the keys/values of kv head ``h // (H / Hk)`` its mask
row lets it see (None: all ``kv_len``), and nothing else:

1. The visible keys in increasing slot order, ranked i = 0, 1, ... (the rank, not the slot,
   picks a lane below, so a tree row and the plain-decoding row that sees the same keys in the
   same order agree wherever the keys sit in the cache).
2. ``score_i = dot(q, k_i) * scale``: the dot product in the GEMM contract's order above (8
   lanes, element d to lane d % 8 by fma in increasing d, the same pairwise reduction), then
   one fp32 multiply by the scale (rounded to fp32; default 1/sqrt(hd)).
3. ``m = max_i score_i`` (exact in any order); ``p_i = fixed_exp(score_i - m)``: one exp written
   with explicit fma only (1.5*2^23 rounding, Cephes' two-step ln 2 reduction, a degree-5
   polynomial; below -87.33654 it gives +0), the same steps in the portable, AVX2 and AVX-512
   code.
4. ``l``: the p_i summed in 8 lanes (lane i % 8, increasing i, from +0), the same reduction.
5. ``o[d] = fma(p_i, v_i[d], o[d])`` from +0 in increasing i; divide last: ``out = o / l``.
6. A row that sees no key is zeros (no NaN); in the model every row sees at least itself.

Threads split the rows (b, h, t), never the keys of a row, so the bits do not depend on the
number of query rows, a row's position among them, the batch, the thread count or the ISA:
portable, AVX2 and AVX-512 give the same bits. (The AVX-512 path holds two query heads' 8 score
lanes for one key side by side in one 512-bit accumulator and 16 head-dim elements of the
weighted sum per register; each half is still the 8-lane chain above, each element the chain of
step 5: csrc/attention_avx512.cpp.) Tests: tests/test_attention_kernel.py.

Row-op contract (:mod:`specpilot.kernels.rowops`: ``rms_norm``, ``add_rms_norm``, ``rope_qk``,
``glu``; fp32). Each output row is computed from its own input row (and the op's weights, its
row of the cos/sin tables) only, in this order:

1. RMSNorm of a row x of n elements: the sum of squares in the GEMM contract's order (8 lanes,
   element k to lane ``k % 8`` by ``fma(x[k], x[k], lane)`` in increasing k, the same pairwise
   reduction), ``r = 1 / sqrt(sum / n + eps)`` (fp32 division, IEEE sqrt, division), then
   ``y[k] = (x[k] * r) * w[k]``, with ``w[k]`` replaced by ``1 + w[k]`` (Gemma's offset).
   ``add_rms_norm`` first forms ``h = x + residual`` (one fp32 add), returns h and RMSNorm(h).
2. RoPE (rotate-half layout, h = hd / 2), per q or k head s, after the head's RMSNorm when q/k
   norms are given: ``y[j] = s[j]*cos[j] - s[j+h]*sin[j]``, ``y[j+h] = s[j+h]*cos[j+h] +
   s[j]*sin[j]`` (two rounded products, then one add): bit-identical to the torch formula
   ``qk*cos + rotate_half(qk)*sin``.
3. Gated products: ``y = (g / (1 + exp(-z))) * u`` with ``z = g`` (SiLU) or ``z = g * ((g *
   g) * B + A)`` (GELU-tanh as a sigmoid, A = 2 sqrt(2/pi), B = 0.044715 A); exp is the
   attention's ``fixed_exp`` (one exp for the kernels: csrc/fixed_exp.h, scalar and 8-lane).

Threads split the rows, never a row, so the bits do not depend on the number of rows, a row's
position, the thread count or the ISA. The model runs these ops with native weights
(``Transformer.set_rowops``); the fp32 weights keep the torch formulas (their Hugging Face
parity). Tests: tests/test_rowops.py.

Block types run in place: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, F32, F16, BF16
(:func:`supports`); others are to be dequantized by the caller. The C++ sources (``csrc/``)
build on first use (:mod:`specpilot.kernels.build`); without a compiler :func:`available` is
False and :func:`unavailable_reason` says why in one line.
"""

from specpilot.kernels.attention import fixed_attention, fixed_exp
from specpilot.kernels.int8 import PROFILES, gguf_matmul_int8, int8_supports, quantize_rows
from specpilot.kernels.linear import (
    QTYPES,
    GGUFEmbedding,
    GGUFLinear,
    GGUFMultiLinear,
    available,
    check_blocks,
    dequantize_rows,
    gguf_matmul,
    gguf_matmul_multi,
    gguf_matmul_reference,
    reader_blocks,
    runnable_isas,
    supports,
    unavailable_reason,
)

__all__ = [
    "PROFILES",
    "QTYPES",
    "GGUFEmbedding",
    "GGUFLinear",
    "GGUFMultiLinear",
    "available",
    "check_blocks",
    "dequantize_rows",
    "fixed_attention",
    "fixed_exp",
    "gguf_matmul",
    "gguf_matmul_int8",
    "gguf_matmul_multi",
    "gguf_matmul_reference",
    "int8_supports",
    "quantize_rows",
    "reader_blocks",
    "runnable_isas",
    "supports",
    "unavailable_reason",
]
