// AVX2 schedule of the int8-activation GEMM with blocks across lanes, for Q4_0 and Q4_1
// (included by gemm_q8_avx2.cpp in its AVX2 build only; uses its decoders, group_base and
// reduce8). The AVX-512 twin is gemm_q8_vnni.h.
//
// The contract puts block 8g + j of a column in fp32 lane j. Here the integer sums land there
// directly: the 16 nibble bytes of a group's 8 blocks are transposed once per column (4 x 4
// 32-bit words per 128-bit half: blocks 0-3 in the low half, 4-7 in the high), so step t's
// vector holds, in lane j, elements 4t..4t+3 of block 8g + j (t < 4: low nibbles of word t; t >=
// 4: high nibbles of word t - 4); the activation rows come interleaved the same way
// (sp_q8_interleave). Per row, eight maddubs of the unsigned nibbles (<= 15) by the int8
// activations (|q| <= 127) summed as int16 (8 steps x 2 x 15 x 127 = 30480 < 2^15: exact, never
// saturated) and one madd by ones give each lane its block's exact int32 dot product: no
// horizontal sums per block, and the transposition is paid once for up to kLaneRows rows. The
// float steps are gemm_q8_avx2.cpp's, lane by lane, so the bits are the same. A trailing group
// of fewer than 8 blocks runs gemm_q8_avx2.cpp's per-block schedule (its lanes and bits).
#pragma once

namespace {

template <class W>
constexpr bool kLanes = std::is_same_v<W, WQ4_0> || std::is_same_v<W, WQ4_1>;

// Rows that share one transposed group (the int16 sums of 8 rows, the 4 transposed words, the
// nibble mask and a step's weights and activations fit the 16 registers).
constexpr int kLaneRows = 8;

// r[w] lane j = 32-bit word w of the nibble bytes of block j of the group at base.
template <class W>
inline void lane_words(const uint8_t* base, __m256i* r) {
  constexpr int S = W::kBytes, O = std::is_same_v<W, WQ4_0> ? 2 : 4;
  const auto ld = [](const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  };
  __m256i y[4];
  for (int j = 0; j < 4; ++j) {
    y[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(base + j * S + O)),
                                   ld(base + (j + 4) * S + O), 1);
  }
  const __m256i a0 = _mm256_unpacklo_epi32(y[0], y[1]), a1 = _mm256_unpackhi_epi32(y[0], y[1]);
  const __m256i a2 = _mm256_unpacklo_epi32(y[2], y[3]), a3 = _mm256_unpackhi_epi32(y[2], y[3]);
  r[0] = _mm256_unpacklo_epi64(a0, a2);
  r[1] = _mm256_unpackhi_epi64(a0, a2);
  r[2] = _mm256_unpacklo_epi64(a1, a3);
  r[3] = _mm256_unpackhi_epi64(a1, a3);
}

// One group (blocks g..g + 7) of one column for RB rows: acc[r] lane j += the contract's terms
// of block g + j.
template <class W, int RB>
inline void lgroup(const sp::Q8GemmArgs& a, const uint8_t* base, int64_t r0, int64_t g,
                   __m256* acc) {
  const int64_t nb = a.x.k / 32, xs = (nb + 7) / 8 * 256;
  __m256i r[4];
  lane_words<W>(base, r);
  const __m256i low = _mm256_set1_epi8(0x0f);
  const int8_t* xr[RB];
  __m256i s16[RB];
  for (int q = 0; q < RB; ++q) {
    xr[q] = a.x.qt + (r0 + q) * xs + g / 8 * 256;
    s16[q] = zi();
  }
  for (int t = 0; t < 8; ++t) {
    const __m256i z = t < 4 ? _mm256_and_si256(r[t], low)
                            : _mm256_and_si256(_mm256_srli_epi32(r[t - 4], 4), low);
    for (int q = 0; q < RB; ++q) {
      s16[q] = _mm256_add_epi16(s16[q], _mm256_maddubs_epi16(z, load32(xr[q] + 32 * t)));
    }
  }
  const Scales sc = W::template scales<8>(base);
  constexpr int L = W::kOffsetLog2;
  for (int q = 0; q < RB; ++q) {
    const int64_t off = (r0 + q) * nb + g;
    const __m256 dx = _mm256_loadu_ps(a.x.d + off);
    __m256i isum = _mm256_madd_epi16(s16[q], _mm256_set1_epi16(1));
    if constexpr (L > 0) {
      const int* qs = a.x.qsum + off;
      const __m256i sq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
      isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(sq, L));
    }
    __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(sc.a, dx), _mm256_cvtepi32_ps(isum), acc[q]);
    if constexpr (W::kMin) {
      const __m256 sx = _mm256_loadu_ps(a.x.s + off);
      v = _mm256_fmadd_ps(sc.b, sx, v);
    }
    acc[q] = v;
  }
}

// The trailing group of cnt < 8 blocks by gemm_q8_avx2.cpp's per-block schedule, up to 4 rows
// at a time (the same lanes and bits; here a lanes group would pay 8 blocks' work for cnt).
template <class W, int R>
inline void tail_rows(const sp::Q8GemmArgs& a, const uint8_t* row, int64_t r0, int64_t g,
                      int cnt, __m256* acc) {
  if constexpr (R > 4) {
    tail<W, 4, 1>(a, &row, r0, g, cnt, acc);
    tail_rows<W, R - 4>(a, row, r0 + 4, g, cnt, acc + 4);
  } else if constexpr (R > 0) {
    tail<W, R, 1>(a, &row, r0, g, cnt, acc);
  }
}

// Columns [c0, c1) for rows [r0, r0 + RB), one column at a time.
template <class W, int RB>
void lcolumns(const sp::Q8GemmArgs& a, int64_t c0, int64_t c1, int64_t r0) {
  const int64_t nb = a.x.k / 32;
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* row = a.w + c * a.row_bytes;
    prefetch_ahead(a, row, c);
    __m256 acc[RB];
    for (int q = 0; q < RB; ++q) acc[q] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= nb; g += 8) lgroup<W, RB>(a, group_base<W>(row, g), r0, g, acc);
    if (g < nb) tail_rows<W, RB>(a, row, r0, g, static_cast<int>(nb - g), acc);
    for (int q = 0; q < RB; ++q) {
      float y = reduce8(acc[q]);
      if (a.bias != nullptr) y = y + a.bias[c];
      a.y[(r0 + q) * a.n + c] = y;
    }
  }
}

template <class W, int RB = 1>
void lcolumns_rows(const sp::Q8GemmArgs& a, int64_t c0, int64_t c1, int64_t r0, int rb) {
  if constexpr (RB < kLaneRows) {
    if (rb > RB) return lcolumns_rows<W, RB + 1>(a, c0, c1, r0, rb);
  }
  lcolumns<W, RB>(a, c0, c1, r0);
}

// Column tiles of col_tile columns, row tiles of up to row_tile (<= kLaneRows) rows in each.
template <class W>
void run_lanes(const sp::Q8GemmArgs& a, int64_t n0, int64_t n1, int row_tile, int col_tile) {
  const int64_t ct = col_tile > 0 ? col_tile : 1;
  const int most = row_tile < 1 ? 1 : row_tile > kLaneRows ? kLaneRows : row_tile;
  for (int64_t c = n0; c < n1; c += ct) {
    const int64_t c1 = c + ct < n1 ? c + ct : n1;
    for (int64_t r0 = 0; r0 < a.x.m;) {
      const int rb = a.x.m - r0 < most ? static_cast<int>(a.x.m - r0) : most;
      lcolumns_rows<W>(a, c, c1, r0, rb);
      r0 += rb;
    }
  }
}

}  // namespace
