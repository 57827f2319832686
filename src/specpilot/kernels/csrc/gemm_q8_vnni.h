// AVX-512 VNNI schedule of the int8-activation GEMM with blocks across lanes (included by
// gemm_q8_avx2.cpp in its AVX-512 build only; uses its weight decoders and reduce8).
//
// The contract puts block 8g + j of a column in fp32 lane j. Here the integer sums land there
// directly: a group's 8 decoded weight blocks are transposed once per column (8 x 8 32-bit
// words), so step t's vector holds, in lane j, elements 4t..4t+3 of block 8g + j; the
// activation rows come interleaved the same way (sp_q8_interleave: 8 steps of 32 bytes per group
// of 8 blocks, zero past the last block). Eight dpbusd per row and group then give each lane its
// block's exact int32 dot product: no horizontal sums, and the transposition is paid once for up
// to 8 rows. A 512-bit vector carries two columns (one per 256-bit half, each exactly the
// contract's 8 lanes); the float steps are the AVX2 path's, lane by lane, so the bits are the
// same. Unsigned weights multiply the signed activations as they are (Q4_0 / Q5_0 as w + 8 /
// w + 16, Q8_0 as w + 128: isum = dot - o * sum(q)); Q6_K keeps |w| with the sign moved onto x
// and sums its two 16-element halves (steps 0-3, 4-7) apart for the two sub-scales. A trailing
// group of fewer than 8 blocks updates only its lanes: it is read in place where the weight
// tensor goes on past its 8 blocks (the blocks past the row meet zero activations), else from a
// zero-padded copy.
#pragma once

#include <algorithm>
#include <cstring>

#include "transpose512.h"

namespace {

inline __m512i pair512(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

inline __m128i load16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

inline __m512 pair512(__m256 lo, __m256 hi) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// Block j of the group at base as dpbusd's unsigned operand before the transposition (signed
// types: w itself, made unsigned after it).
template <class W>
inline __m256i tblock(const uint8_t* base, int j) {
  __m256i u, s = zi();
  W::block(base, j, &u, &s);
  if constexpr (W::kSigned) return s;
  else return u;
}

// Q4_0 and Q4_1 decode after the transposition instead: their 16 bytes of nibbles (offset O in
// the block) as 4 32-bit words per block, transposed 4 x 4 per 128-bit lane (blocks 0-3 and 4-7
// of a column side by side), give step t < 4 as the low nibbles of word t and step t + 4 as its
// high nibbles, for both columns at once (a and b, the group bases).
template <class W>
constexpr bool kNibbles = std::is_same_v<W, WQ4_0> || std::is_same_v<W, WQ4_1>;

template <class W>
inline void nibble_steps(const uint8_t* a, const uint8_t* b, __m512i* z) {
  constexpr int S = W::kBytes, O = std::is_same_v<W, WQ4_0> ? 2 : 4;
  __m512i y[4];
  for (int j = 0; j < 4; ++j) {
    __m512i v = _mm512_castsi128_si512(load16(a + j * S + O));
    v = _mm512_inserti32x4(v, load16(a + (j + 4) * S + O), 1);
    v = _mm512_inserti32x4(v, load16(b + j * S + O), 2);
    y[j] = _mm512_inserti32x4(v, load16(b + (j + 4) * S + O), 3);
  }
  const __m512i a0 = _mm512_unpacklo_epi32(y[0], y[1]), a1 = _mm512_unpackhi_epi32(y[0], y[1]);
  const __m512i a2 = _mm512_unpacklo_epi32(y[2], y[3]), a3 = _mm512_unpackhi_epi32(y[2], y[3]);
  const __m512i r[4] = {_mm512_unpacklo_epi64(a0, a2), _mm512_unpackhi_epi64(a0, a2),
                        _mm512_unpacklo_epi64(a1, a3), _mm512_unpackhi_epi64(a1, a3)};
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int w = 0; w < 4; ++w) {
    z[w] = _mm512_and_si512(r[w], low);
    z[w + 4] = _mm512_and_si512(_mm512_srli_epi32(r[w], 4), low);
  }
}

template <class W>
constexpr int toffset_log2() {
  if constexpr (std::is_same_v<W, WQ8_0>) return 7;  // w + 128
  else return W::kOffsetLog2;
}

// Lane j and 8 + j (j < cnt) of a trailing group's vector <- its packed words j and cnt + j
// (the two columns' compact words; a permute of a masked load: an expanding load is microcoded on
// some cores, and the tail then cost ~2 full groups).
inline __m512i tail_spread(int cnt) {
  return _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7),
                          _mm512_maskz_set1_epi32(static_cast<__mmask16>(0xff00), cnt));
}

inline __m512 load_halves(const uint8_t* q, __mmask16 k) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, q));
}

// A pair's trailing cnt scales (and mins) at b (after its V compact vectors), in lanes j and
// 8 + j, j < cnt (live); zero elsewhere.
template <class W, int V>
inline void tail_scales(const uint8_t* b, int cnt, __mmask16 live, __m512i spread, __m512* sa,
                        __m512* sb) {
  const __mmask16 words = static_cast<__mmask16>((1u << (2 * cnt)) - 1);
  *sa = _mm512_maskz_permutexvar_ps(live, spread, load_halves(b + 8 * cnt * V, words));
  if constexpr (W::kMin) {
    *sb = _mm512_maskz_permutexvar_ps(live, spread, load_halves(b + 8 * cnt * V + 4 * cnt, words));
  }
}

// A row's activation terms of blocks g..g + 7 (off: its first), as the float steps read them
// in lanes j and 8 + j: scales d, block sums s (types with a min), integer block sums << L
// (offset types); lanes past live8 zero unless kFull.
struct RowTerms {
  __m512 dx, sx = _mm512_setzero_ps();
  __m512i sq = _mm512_setzero_si512();
};

template <class W, bool kFull>
inline RowTerms row_terms(const sp::Q8GemmArgs& a, int64_t off, __mmask8 live8) {
  constexpr int L = toffset_log2<W>();
  const auto bx = [&](const float* v) {
    return _mm512_broadcast_f32x8(kFull ? _mm256_loadu_ps(v + off)
                                        : _mm256_maskz_loadu_ps(live8, v + off));
  };
  RowTerms t{bx(a.x.d)};
  if constexpr (W::kMin) t.sx = bx(a.x.s);
  if constexpr (L > 0) {
    t.sq = _mm512_slli_epi32(
        _mm512_broadcast_i32x8(_mm256_maskz_loadu_epi32(live8, a.x.qsum + off)), L);
  }
  return t;
}

// The contract's float step of one column pair and row: acc += a * d * isum (+ b * s), lane by
// lane (lanes outside live unchanged unless kFull), from the exact integer sums isum.
template <class W, bool kFull>
inline void float_step(__m512& ac, __m512 sa, __m512 sb, const RowTerms& t, __m512i isum,
                       __mmask16 live) {
  if constexpr (toffset_log2<W>() > 0) isum = _mm512_sub_epi32(isum, t.sq);
  __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(sa, t.dx), _mm512_cvtepi32_ps(isum), ac);
  if constexpr (W::kMin) v = _mm512_fmadd_ps(sb, t.sx, v);
  ac = kFull ? v : _mm512_mask_mov_ps(ac, live, v);
}

// One group (blocks g..g + cnt - 1, cnt <= 8) of NP column pairs (group bases base[2p], base[2p
// + 1]) for RB rows: acc[p * RB + r] half h lane j += the contract's terms of block g + j of
// column 2p + h (lanes past cnt unchanged).
template <class W, int RB, int NP>
inline void tgroup(const sp::Q8GemmArgs& a, const uint8_t* const* base, int64_t r0, int64_t g,
                   int cnt, __m512* acc) {
  const int64_t nb = a.x.k / 32, xs = (nb + 7) / 8 * 256;
  const __mmask8 live8 = static_cast<__mmask8>((1u << cnt) - 1);
  const __mmask16 live = static_cast<__mmask16>(live8 | (live8 << 8));
  RowTerms terms[RB];
  const int8_t* xr[RB];
  for (int r = 0; r < RB; ++r) {
    xr[r] = a.x.qt + (r0 + r) * xs + g / 8 * 256;
    terms[r] = row_terms<W, false>(a, (r0 + r) * nb + g, live8);
  }
  for (int p = 0; p < NP; ++p) {
    __m512i z[8];
    if constexpr (kNibbles<W>) {
      nibble_steps<W>(base[2 * p], base[2 * p + 1], z);
    } else {
      for (int j = 0; j < 8; ++j) {
        z[j] = pair512(tblock<W>(base[2 * p], j), tblock<W>(base[2 * p + 1], j));
      }
      sp::transpose8x8(z);
    }
    __mmask64 neg[8];
    for (int t = 0; t < 8; ++t) {
      if constexpr (W::kQ6) {
        neg[t] = _mm512_movepi8_mask(z[t]);
        z[t] = _mm512_abs_epi8(z[t]);
      } else if constexpr (W::kSigned) {
        z[t] = _mm512_xor_si512(z[t], _mm512_set1_epi8(static_cast<char>(0x80)));
      }
    }
    __m512i lo[RB], hi[RB];
    for (int r = 0; r < RB; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
    for (int t = 0; t < 8; ++t) {
      for (int r = 0; r < RB; ++r) {
        __m512i xv = _mm512_broadcast_i64x4(load32(xr[r] + 32 * t));
        if constexpr (W::kQ6) xv = _mm512_mask_sub_epi8(xv, neg[t], _mm512_setzero_si512(), xv);
        if (W::kQ6 && t >= 4) hi[r] = _mm512_dpbusd_epi32(hi[r], z[t], xv);
        else lo[r] = _mm512_dpbusd_epi32(lo[r], z[t], xv);
      }
    }
    __m512 sa, sb = _mm512_setzero_ps();
    __m512i se = _mm512_setzero_si512(), so = se;
    const Scales s0 = W::template scales<8>(base[2 * p]);
    const Scales s1 = W::template scales<8>(base[2 * p + 1]);
    sa = pair512(s0.a, s1.a);
    if constexpr (W::kMin) sb = pair512(s0.b, s1.b);
    if constexpr (W::kQ6) {
      se = pair512(s0.se, s1.se);
      so = pair512(s0.so, s1.so);
    }
    for (int r = 0; r < RB; ++r) {
      __m512i isum = lo[r];
      if constexpr (W::kQ6) {
        isum = _mm512_add_epi32(_mm512_mullo_epi32(lo[r], se), _mm512_mullo_epi32(hi[r], so));
      }
      float_step<W, false>(acc[p * RB + r], sa, sb, terms[r], isum, live);
    }
  }
}

// Rows that share one decoded, transposed group: their integer sums stay in registers (24 of
// the 32 with the 8 weight steps); the float accumulators of the rows past those that fit are
// kept on the stack by the compiler, touched once per group.
constexpr int kTileRows = 16;

// Bytes of a zero-padded group of 8 blocks (1 for types without a trailing group).
template <class W, bool kTail>
constexpr int tail_pad() {
  if constexpr (kTail) return 8 * W::kBytes;
  else return 1;
}

// Columns [c0, c1) for rows [r0, r0 + RB), NP column pairs at a time (the last pair's second
// column repeats the first where c1 is odd; it is computed and not stored).
template <class W, int RB>
void tcolumns(const sp::Q8GemmArgs& a, int64_t c0, int64_t c1, int64_t r0) {
  constexpr int NP = RB <= 2 ? 2 : 1;
  constexpr int NC = 2 * NP;
  constexpr bool kTail = !W::kQ6 && !std::is_same_v<W, WQ4_K>;  // K types: whole groups
  constexpr int kPad = tail_pad<W, kTail>();
  const int64_t nb = a.x.k / 32;
  alignas(64) uint8_t pad[NC][kPad];
  for (int64_t c = c0; c < c1; c += NC) {
    const uint8_t* row[NC];
    for (int i = 0; i < NC; ++i) row[i] = a.w + (c + i < c1 ? c + i : c1 - 1) * a.row_bytes;
    for (int i = 0; i < NC; ++i) prefetch_ahead(a, row[i], c + i);
    __m512 acc[NP * RB];
    for (int t = 0; t < NP * RB; ++t) acc[t] = _mm512_setzero_ps();
    const uint8_t* base[NC];
    int64_t g = 0;
    for (; g + 8 <= nb; g += 8) {
      for (int i = 0; i < NC; ++i) base[i] = group_base<W>(row[i], g);
      tgroup<W, RB, NP>(a, base, r0, g, 8, acc);
    }
    if constexpr (kTail) {
      if (g < nb) {
        const int cnt = static_cast<int>(nb - g);
        for (int i = 0; i < NC; ++i) {
          base[i] = group_base<W>(row[i], g);
          if (a.w_end != nullptr && base[i] + 8 * W::kBytes <= a.w_end) continue;
          std::memset(pad[i], 0, kPad);  // the tensor's last rows: a zero-padded copy
          std::memcpy(pad[i], base[i], static_cast<size_t>(cnt) * W::kBytes);
          base[i] = pad[i];
        }
        tgroup<W, RB, NP>(a, base, r0, g, cnt, acc);
      }
    }
    for (int p = 0; p < NP; ++p) {
      for (int h = 0; h < 2; ++h) {
        const int64_t col = c + 2 * p + h;
        if (col >= c1) continue;
        for (int r = 0; r < RB; ++r) {
          const __m512 v = acc[p * RB + r];
          float y = reduce8(h == 0 ? _mm512_castps512_ps256(v) : _mm512_extractf32x8_ps(v, 1));
          if (a.bias != nullptr) y = y + a.bias[col];
          a.y[(r0 + r) * a.n + col] = y;
        }
      }
    }
  }
}

// Rows whose integer sums pgroup interleaves step by step (independent dpbusd chains side by
// side: 2 RS of the 32 registers beside the 16 decoded steps): all of up to 3 rows, else runs
// of 4 for the nibble types and of 2 for Q8_0, whose offset terms take registers of their own
// (at 4 rows its LM head-sized calls ran 8% faster in runs of 2 than as one run of 4;
// bench/q8_kernel_ab.py, BENCHMARKS.md, sixth session of 2026-12-07).
template <class W, int RB>
constexpr int kRowsInterleaved = RB <= 3 ? RB : kNibbles<W> ? 4 : 2;

// Calls of at most this many rows decode a nibble type's high nibbles as v & 0xf0 (16 times
// their value: one op instead of a shift and a mask) into integer sums of their own, exact
// multiples of 16 (u8 x s8 products, summed in int32): isum = lo + (hi >> 4), the same integers.
// It costs an add and a shift per row and group, which at 2 rows already outweighed the shifts
// saved in single-thread timings (bench/q8_kernel_ab.py; BENCHMARKS.md, sixth session of
// 2026-12-07).
constexpr int kHi16Rows = 1;

// RS rows (r0 + rb ..) of pgroup's group: their exact integer sums from the decoded steps z of
// the NP pairs (kHi16: z[p][t + 4] holds 16 x step t + 4), then the contract's float steps.
template <class W, int NP, bool kFull, int RS, bool kHi16>
inline void prows(const sp::Q8GemmArgs& a, const __m512i (*z)[8], const __m512* sa,
                  const __m512* sb, int64_t r0, int64_t g, int rb, int RB, __mmask8 live8,
                  __mmask16 live, __m512* acc) {
  const int64_t nb = a.x.k / 32, xs = (nb + 7) / 8 * 256;
  const int8_t* xr[RS];
  __m512i lo[RS][NP], hi[RS][NP];
  for (int i = 0; i < RS; ++i) {
    xr[i] = a.x.qt + (r0 + rb + i) * xs + g / 8 * 256;
    for (int p = 0; p < NP; ++p) lo[i][p] = hi[i][p] = _mm512_setzero_si512();
  }
  for (int t = 0; t < 8; ++t) {
    for (int i = 0; i < RS; ++i) {
      const __m512i xv = _mm512_broadcast_i64x4(load32(xr[i] + 32 * t));
      for (int p = 0; p < NP; ++p) {
        if (kHi16 && t >= 4) hi[i][p] = _mm512_dpbusd_epi32(hi[i][p], z[p][t], xv);
        else lo[i][p] = _mm512_dpbusd_epi32(lo[i][p], z[p][t], xv);
      }
    }
  }
  for (int i = 0; i < RS; ++i) {
    const RowTerms terms = row_terms<W, kFull>(a, (r0 + rb + i) * nb + g, live8);
    for (int p = 0; p < NP; ++p) {
      __m512i isum = lo[i][p];
      if constexpr (kHi16) isum = _mm512_add_epi32(isum, _mm512_srai_epi32(hi[i][p], 4));
      float_step<W, kFull>(acc[p * RB + rb + i], sa[p], sb[p], terms, isum, live);
    }
  }
}

// Packed weights (sp_q8_pack; Q4_0, Q4_1, Q8_0): one group of 8 blocks (full) or the trailing
// cnt < 8 blocks of NP column pairs (p at pk[p] + at: a full group's 4 vectors (Q8_0: 8) and 16
// scales (and mins), or the trailing blocks' compact vectors and 2 cnt scales, expanded into
// lanes j and 8 + j, j < cnt) for RB rows: acc[p * RB + r] half h lane j += the contract's terms
// of block g + j of column 2p + h. The decoded steps of the NP pairs stay in registers (8 NP of
// the 32) and each broadcast activation step feeds NP dpbusd; a row's integer sums are exact in
// any order, so only the float steps below follow the contract (lane by lane, as tgroup).
template <class W, int RB, int NP, bool kFull>
inline void pgroup(const sp::Q8GemmArgs& a, const uint8_t* const* pk, int64_t at, int64_t r0,
                   int64_t g, int cnt, __m512* acc) {
  const __mmask8 live8 = static_cast<__mmask8>((1u << cnt) - 1);
  const __mmask16 live = static_cast<__mmask16>(live8 | (live8 << 8));
  constexpr int V = kNibbles<W> ? 4 : 8;  // vectors of a full group (Q8_0: 8, no nibbles)
  constexpr bool kHi16 = kNibbles<W> && RB <= kHi16Rows;
  const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __mmask16 words = static_cast<__mmask16>((1u << (2 * cnt)) - 1);
  const __m512i spread = tail_spread(cnt);
  __m512i z[NP][8];
  __m512 sa[NP], sb[NP];
  for (int p = 0; p < NP; ++p) {
    const uint8_t* b = pk[p] + at;
    for (int w = 0; w < V; ++w) {
      const __m512i v =
          kFull ? _mm512_loadu_si512(b + 64 * w)
                : _mm512_maskz_permutexvar_epi32(
                      live, spread, _mm512_maskz_loadu_epi32(words, b + 8 * cnt * w));
      if constexpr (V == 4) {
        z[p][w] = _mm512_and_si512(v, low);
        z[p][w + 4] = kHi16 ? _mm512_andnot_si512(low, v)  // 16 x the high nibbles
                            : _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
      } else {
        z[p][w] = _mm512_xor_si512(v, flip);  // Q8_0 as w + 128
      }
    }
    sb[p] = _mm512_setzero_ps();
    if constexpr (kFull) {
      sa[p] = load_halves(b + 64 * V, 0xffff);
      if constexpr (W::kMin) sb[p] = load_halves(b + 64 * V + 32, 0xffff);
    } else {
      tail_scales<W, V>(b, cnt, live, spread, &sa[p], &sb[p]);
    }
  }
  constexpr int RS = kRowsInterleaved<W, RB>, kRest = RB % RS;
  for (int r = 0; r + RS <= RB; r += RS) {
    prows<W, NP, kFull, RS, kHi16>(a, z, sa, sb, r0, g, r, RB, live8, live, acc);
  }
  if constexpr (kRest > 0) {
    prows<W, NP, kFull, kRest, kHi16>(a, z, sa, sb, r0, g, RB - kRest, RB, live8, live, acc);
  }
}

// reduce8 of both 256-bit halves of v at once (the same sums, in the same order: lane i + lane i
// + 4, then + lane i + 2, then + lane i + 1): the half 0 total in float 0, the half 1 total in
// float 1.
inline __m128 reduce8x2(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));  // 128-bit lanes swapped in halves
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1));
  return _mm_unpacklo_ps(_mm512_castps512_ps128(v), _mm512_extractf32x4_ps(v, 2));
}

// reduce8 of the four 256-bit halves of u and v (columns u0, u1, v0, v1) at once, the same
// sums in the same order as reduce8x2: lane i + lane i + 4, then + lane i + 2, then + lane i + 1.
inline __m128 reduce8x4(__m512 u, __m512 v) {
  // 128-bit quarters (u0 lo, u1 lo, v0 lo, v1 lo) + (u0 hi, u1 hi, v0 hi, v1 hi)
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x88), _mm512_shuffle_f32x4(u, v, 0xdd));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4e));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xb1));
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s));
}

// Prefetch distance of packed weights, in column pairs, into L2 (_MM_HINT_T1). Into L1 (T0) at
// 4 pairs, one forward of SmolLM2 at 1 / 2 / 4 / 8 rows took 5.2-5.5 / 5.5-6.5 / 6.4-7.8 /
// 10.1-12.4 ms on a 2-core EPYC Zen 4; into L2 at 4 pairs 4.8-5.2 / 4.9-5.9 / 5.9-7.6 /
// 8.7-10.8, at 8 pairs 3.9-4.2 / 4.2-4.4 / 5.5-5.8 / 8.4-8.8, at 16 no better (BENCHMARKS.md,
// fourth session of 2026-12-07). Streams into L1 crowded out the activations and the L1's miss
// buffers; at 4 pairs and T0 a Q8_0 LM head streamed at half the GGUF-ordered path's rate.
// a.ahead (columns, set by q8_prefetch) overrides it with a.ahead / 2 pairs (at least 1).
constexpr int64_t kPairsAhead = 8;

inline int64_t pairs_ahead(const sp::Q8GemmArgs& a) {
  return a.ahead > 0 ? std::max<int64_t>(1, a.ahead / 2) : kPairsAhead;
}

// The first pairs_ahead(a) column pairs of a thread's columns [n0, n1), prefetched up front:
// pcolumns streams each pair after them from the pair that many before it, and these would
// otherwise arrive one demand miss at a time (a 2-core EPYC Zen 4's hardware prefetchers barely
// help; BENCHMARKS.md, fifth session of 2026-12-07, says what was and was not resolved).
inline void prefetch_first_pairs(const sp::Q8GemmArgs& a, int64_t n0, int64_t n1) {
  const int64_t pair = 2 * a.row_bytes, p0 = n0 / 2;
  const int64_t p1 = std::min((n1 + 1) / 2, p0 + pairs_ahead(a));
  const char* w = reinterpret_cast<const char*>(a.w);
  for (int64_t o = p0 * pair; o < p1 * pair; o += 64) _mm_prefetch(w + o, _MM_HINT_T1);
}

// Vector w of the dense trailing group of Q = 8 / T pairs (src[q] + o: pair q's 2T words of it,
// 8T bytes, for lanes 2T q ..): 64-bit quarters of 128-bit lanes (T = 1), 128-bit lanes (T = 2)
// or 256-bit halves (T = 4).
inline __m512i tail_vector(const uint8_t* const* src, int64_t o, int T) {
  if (T == 4) return pair512(load32(src[0] + o), load32(src[1] + o));
  const auto ld8 = [](const uint8_t* p) {
    return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  };
  __m128i l[4];
  for (int i = 0; i < 4; ++i) {
    l[i] = T == 2 ? load16(src[i] + o)
                  : _mm_unpacklo_epi64(ld8(src[2 * i] + o), ld8(src[2 * i + 1] + o));
  }
  return pair512(_mm256_inserti128_si256(_mm256_castsi128_si256(l[0]), l[1], 1),
                 _mm256_inserti128_si256(_mm256_castsi128_si256(l[2]), l[3], 1));
}

// The first T words at x (one activation step of the trailing group), repeated every T lanes.
inline __m512i tail_x(const int8_t* x, int T) {
  if (T == 2) {
    int64_t v;
    std::memcpy(&v, x, 8);
    return _mm512_set1_epi64(v);
  }
  if (T == 4) return _mm512_broadcast_i32x4(load16(x));
  int v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// The trailing group of T = 1, 2 or 4 blocks (k / 32 % 8) of Q = 8 / T column pairs at once:
// their packed tails hold 2T words per pair and vector (column c, block j at word T c + j), so
// the Q pairs' words fill one 512-bit vector (pair q at lanes 2T q ..), and step t's activation
// words (the tail group's first T words of step t, sp_q8_interleave) repeat every T lanes. Eight
// dpbusd per row then give every lane its block's exact int32 sum (instead of eight per pair,
// in T of its 8 lanes); sums[r] holds row r0 + r's, dense, for ptail_apply. Pairs past the
// last (index last) repeat it.
template <class W, int RB>
inline void ptail_sums(const sp::Q8GemmArgs& a, int64_t pair0, int64_t last, int64_t at,
                       int64_t r0, int T, __m512i* sums) {
  const int64_t nb = a.x.k / 32, xs = (nb + 7) / 8 * 256, pair = 2 * a.row_bytes;
  constexpr int V = kNibbles<W> ? 4 : 8;
  const int Q = 8 / T, bytes = 8 * T;  // a pair's words of one vector: 2T, 8T bytes
  const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* src[8];  // pair q's tail
  for (int q = 0; q < Q; ++q) src[q] = a.w + (pair0 + q <= last ? pair0 + q : last) * pair + at;
  __m512i z[8];
  for (int w = 0; w < V; ++w) {
    const __m512i v = tail_vector(src, static_cast<int64_t>(bytes) * w, T);
    if constexpr (V == 4) {
      z[w] = _mm512_and_si512(v, low);
      z[w + 4] = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
    } else {
      z[w] = _mm512_xor_si512(v, flip);  // Q8_0 as w + 128
    }
  }
  for (int r = 0; r < RB; ++r) {
    const int8_t* xr = a.x.qt + (r0 + r) * xs + nb / 8 * 256;
    __m512i lo = _mm512_setzero_si512();
    for (int t = 0; t < 8; ++t) lo = _mm512_dpbusd_epi32(lo, z[t], tail_x(xr + 32 * t, T));
    sums[r] = lo;
  }
}

// The trailing group's float steps for NP pairs (pk[p] + at: their tails) from ptail_sums' sums
// (pair p at dense index q[p]): pgroup's tail terms, lane by lane, from the same integer sums.
template <class W, int RB, int NP>
inline void ptail_apply(const sp::Q8GemmArgs& a, const uint8_t* const* pk, int64_t at, int64_t r0,
                        int T, const int* q, const __m512i* sums, __m512* acc) {
  const int64_t nb = a.x.k / 32, g = nb / 8 * 8;
  const __mmask8 live8 = static_cast<__mmask8>((1u << T) - 1);
  const __mmask16 live = static_cast<__mmask16>(live8 | (live8 << 8));
  constexpr int V = kNibbles<W> ? 4 : 8;
  const __m512i spread = tail_spread(T);
  __m512 sa[NP], sb[NP];
  __m512i idx[NP];  // lane 8 c + j (j < T) of pair p's accumulator <- its dense word T c + j
  for (int p = 0; p < NP; ++p) {
    sb[p] = _mm512_setzero_ps();
    tail_scales<W, V>(pk[p] + at, T, live, spread, &sa[p], &sb[p]);
    idx[p] = _mm512_add_epi32(spread, _mm512_set1_epi32(2 * T * q[p]));
  }
  for (int r = 0; r < RB; ++r) {
    const RowTerms terms = row_terms<W, false>(a, (r0 + r) * nb + g, live8);
    for (int p = 0; p < NP; ++p) {
      const __m512i isum = _mm512_maskz_permutexvar_epi32(live, idx[p], sums[r]);
      float_step<W, false>(acc[p * RB + r], sa[p], sb[p], terms, isum, live);
    }
  }
}

// Packed weights: columns [c0, c1) for rows [r0, r0 + RB), two column pairs at a time (pairs
// start at even columns; a column outside [c0, c1) is computed and not stored). A trailing
// group of 1, 2 or 4 blocks is summed for 8 / T pairs at once first (ptail_sums), others per
// two pairs (pgroup). Where all 4 columns of the two pairs are stored, one reduce8x4 per row
// sums them (instead of a reduce8x2 per pair) and one 128-bit store writes them.
template <class W, int RB>
void pcolumns(const sp::Q8GemmArgs& a, int64_t c0, int64_t c1, int64_t r0) {
  constexpr int NP = 2;
  const int64_t nb = a.x.k / 32, ng = nb / 8, cnt = nb % 8;
  const int64_t group = 16 * static_cast<int64_t>(W::kBytes), pair = 2 * a.row_bytes;
  const int64_t last = (c1 - 1) / 2;
  const int T = static_cast<int>(cnt);
  const bool dense = T == 1 || T == 2 || T == 4;
  const int64_t ahead = pairs_ahead(a);
  const int64_t span = 2 * (dense ? 8 / T : NP);  // columns per dense tail (a multiple of 2 NP)
  __m512i sums[RB];
  for (int64_t cb = c0 & ~int64_t{1}; cb < c1; cb += span) {
    if (dense) ptail_sums<W, RB>(a, cb / 2, last, ng * group, r0, T, sums);
    for (int64_t c = cb; c < cb + span && c < c1; c += 2 * NP) {
      const uint8_t* pk[NP];
      int64_t pi[NP];
      int qi[NP];
      for (int p = 0; p < NP; ++p) {
        pi[p] = c / 2 + p <= last ? c / 2 + p : last;
        qi[p] = static_cast<int>(pi[p] - cb / 2);
        pk[p] = a.w + pi[p] * pair;
        if (2 * (pi[p] + ahead) < a.n) {  // the pair `ahead` pairs on, streamed once
          const char* next = reinterpret_cast<const char*>(pk[p] + ahead * pair);
          for (int64_t o = 0; o < pair; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
        }
      }
      __m512 acc[NP * RB];
      for (int t = 0; t < NP * RB; ++t) acc[t] = _mm512_setzero_ps();
      for (int64_t g = 0; g < ng; ++g) {
        pgroup<W, RB, NP, true>(a, pk, g * group, r0, 8 * g, 8, acc);
      }
      if (dense) {
        ptail_apply<W, RB, NP>(a, pk, ng * group, r0, T, qi, sums, acc);
      } else if (cnt > 0) {
        pgroup<W, RB, NP, false>(a, pk, ng * group, r0, 8 * ng, T, acc);
      }
      static_assert(NP == 2);
      if (pi[1] == pi[0] + 1 && 2 * pi[0] >= c0 && 2 * pi[1] + 1 < c1) {  // 4 columns stored
        const int64_t col = 2 * pi[0];
        for (int r = 0; r < RB; ++r) {
          __m128 y = reduce8x4(acc[r], acc[RB + r]);
          if (a.bias != nullptr) y = _mm_add_ps(y, _mm_loadu_ps(a.bias + col));
          _mm_storeu_ps(a.y + (r0 + r) * a.n + col, y);
        }
        continue;
      }
      for (int p = 0; p < NP; ++p) {
        if (p > 0 && pi[p] == pi[p - 1]) continue;
        const int64_t col = 2 * pi[p];
        const bool st0 = col >= c0 && col < c1, st1 = col + 1 >= c0 && col + 1 < c1;
        for (int r = 0; r < RB; ++r) {
          const __m128 y = reduce8x2(acc[p * RB + r]);
          float* out = a.y + (r0 + r) * a.n + col;
          if (st0) out[0] = a.bias != nullptr ? _mm_cvtss_f32(y) + a.bias[col] : _mm_cvtss_f32(y);
          if (st1) {
            const float y1 = _mm_cvtss_f32(_mm_movehdup_ps(y));
            out[1] = a.bias != nullptr ? y1 + a.bias[col + 1] : y1;
          }
        }
      }
    }
  }
}

// Row tiles of rb (<= kTileRows) rows: the schedule's instance for rb.
template <class W, bool kPk, int RB = 1>
void tile_rows(const sp::Q8GemmArgs& a, int64_t c0, int64_t c1, int64_t r0, int rb) {
  if constexpr (RB < kTileRows) {
    if (rb > RB) return tile_rows<W, kPk, RB + 1>(a, c0, c1, r0, rb);
  }
  if constexpr (kPk) pcolumns<W, RB>(a, c0, c1, r0);
  else tcolumns<W, RB>(a, c0, c1, r0);
}

// Column tiles of col_tile columns, row tiles of up to row_tile (<= kTileRows) rows within each
// (kPk, packed weights: tiles of an even number of columns from an even column).
template <class W, bool kPk = false>
void run_transposed(const sp::Q8GemmArgs& a, int64_t n0, int64_t n1, int row_tile,
                    int col_tile) {
  int64_t ct = col_tile > 0 ? col_tile : 1;
  if constexpr (kPk) {
    ct = (ct + 1) / 2 * 2;
    prefetch_first_pairs(a, n0, n1);
  }
  const int most = row_tile < 1 ? 1 : row_tile > kTileRows ? kTileRows : row_tile;
  for (int64_t c = kPk ? n0 & ~int64_t{1} : n0; c < n1; c += ct) {
    const int64_t lo = c > n0 ? c : n0, hi = c + ct < n1 ? c + ct : n1;
    for (int64_t r0 = 0; r0 < a.x.m;) {
      const int rb = a.x.m - r0 < most ? static_cast<int>(a.x.m - r0) : most;
      tile_rows<W, kPk>(a, lo, hi, r0, rb);
      r0 += rb;
    }
  }
}

}  // namespace
