// AVX2 int8-activation GEMM and Q8 row quantization, bit-identical to gemm_q8_scalar.cpp.
//
// A weight block's 32 integers sit in one __m256i, decoded once per column and group of 8
// blocks and used for every row of the row tile (up to 4 rows; from sp::kQ8InterleaveRows rows,
// Q4_0 and Q4_1 run the blocks-across-lanes schedule of gemm_q8_lanes.h instead). Its exact dot product with a Q8
// activation block is _mm256_maddubs_epi16 (unsigned weights directly: u <= 31, a pair is at
// most 2 * 31 * 127; Q4_0 and Q5_0 as u = w + 8 or w + 16, with 8 or 16 * sum(q) taken off the
// block's sum; signed ones as |w| <= 128 with the sign moved onto x: a pair is at most
// 2 * 128 * 127 < 2^15, so the int16 sums never saturate), then _mm256_madd_epi16 by ones:
// eight int32 partial sums, lanes 0-3 over elements 0-15 and lanes 4-7 over elements 16-31.
// Eight blocks are reduced by a pairwise tree (pair(): integer, so order-free) to their sums
// over the first and the last 16 elements, lane j = block 8g + j; isum = lo + hi (Q6_K:
// sc0 * lo + sc1 * hi, exact int32). The group's scales are gathered into 8 lanes at once
// (fp16 -> fp32, exact; Q4_K's 6-bit scales and mins unpacked as in llama.cpp). Then the
// profile's float steps run on the 8 lanes: acc = fma(a_w * d_x, isum, acc) (a_w * d_x rounded
// first; + fma(b_w, s_x, acc) for Q4_1 / Q4_K), the portable path's per-lane order. A trailing
// group of fewer than 8 blocks (a compile-time count) updates only its lanes. Row and column
// tiles are only a schedule. Compiled with -mavx2 -mfma -mf16c; called only after a run-time
// CPU check.
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "gemm_q8.h"

#if defined(SP_AVX512)
#define SP_Q8_ENTRY sp_gemm_q8_avx512
#else
#define SP_Q8_ENTRY sp_gemm_q8_avx2
#endif

namespace {

constexpr int64_t kPrefetch = 8;  // columns (a.ahead overrides it)

inline float h2f(const uint8_t* p) { return _cvtsh_ss(sp::rd16(p)); }

inline __m256i zi() { return _mm256_setzero_si256(); }

// Lanes 0..cnt-1 all ones, the others 0.
inline __m256i lanes_below(int cnt) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 32 nibbles of 16 bytes in element order: low nibbles (0..15), then high nibbles (16..31).
// (The 16 bytes in both halves, the upper half shifted right by 4 per 32-bit word: its bytes'
// high nibbles land in their low nibbles, and the mask drops the bits shifted in.)
inline __m256i nibbles32(const uint8_t* p) {
  const __m256i both =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sh = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_and_si256(sh, _mm256_set1_epi8(0x0f));
}

// Byte e is 0xff where bit e of the 32-bit word at p is set (llama.cpp's bytes_from_bits_32).
inline __m256i bits32(const uint8_t* p) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                         0x0101010101010101, 0x0000000000000000);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(sp::rd32(p))), shuf);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

// Per 128 bits: the low fp16 halves of the four 32-bit words, then their high halves.
const __m256i kHalves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0,
                                         1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);

// The 32-bit words at p, p + S, ..., p + (CNT - 1) * S (0 past CNT: not read), their low
// halves (fp16) packed in the low 128 bits, in order, and their high halves in the high 128.
template <int S, int CNT>
inline __m256i halves16(const uint8_t* p) {
  __m256i w;
  if constexpr (CNT == 8) {
    const __m256i idx = _mm256_setr_epi32(0, S, 2 * S, 3 * S, 4 * S, 5 * S, 6 * S, 7 * S);
    w = _mm256_i32gather_epi32(reinterpret_cast<const int*>(p), idx, 1);
  } else {
    int v[8];
    for (int b = 0; b < 8; ++b) v[b] = b < CNT ? static_cast<int>(sp::rd32(p + b * S)) : 0;
    w = _mm256_setr_epi32(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
  }
  return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, kHalves), 0xd8);
}

// The fp16 values at p, p + S, ..., p + (CNT - 1) * S widened to fp32 (exact), 0 past CNT;
// with hi, the fp16 values 2 bytes after each of them the same way into *hi.
template <int S, int CNT>
inline __m256 halves8(const uint8_t* p, __m256* hi = nullptr) {
  const __m256i h = halves16<S, CNT>(p);
  if (hi != nullptr) *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
}

// Scales of one group of up to 8 blocks: a (and b, for types with a min) per lane, and Q6_K's
// sub-scales of the first (se) and last (so) 16 elements as int32.
struct Scales {
  __m256 a, b;
  __m256i se, so;
};


// Weight types: block(base, j) gives the integers of block j of the group at base (signed
// types: |w| in u and w in s); scales<CNT>(base) the scales of its first CNT blocks.
// Q4_0 and Q5_0 run as unsigned w + 8 (<= 15) and w + 16 (<= 31): isum = dot(u, q) - o * sum(q).
struct WQ4_0 {
  static constexpr bool kSigned = false, kMin = false, kQ6 = false, kNarrow = true;
  static constexpr int kOffsetLog2 = 3;
  static constexpr int kBytes = 18;
  static inline void block(const uint8_t* base, int j, __m256i* u, __m256i*) {
    *u = nibbles32(base + j * kBytes + 2);
  }
  template <int CNT>
  static inline Scales scales(const uint8_t* base) {
    return {halves8<kBytes, CNT>(base), _mm256_setzero_ps(), zi(), zi()};
  }
};

struct WQ4_1 {
  static constexpr bool kSigned = false, kMin = true, kQ6 = false, kNarrow = true;
  static constexpr int kOffsetLog2 = 0;
  static constexpr int kBytes = 20;
  static inline void block(const uint8_t* base, int j, __m256i* u, __m256i*) {
    *u = nibbles32(base + j * kBytes + 4);
  }
  template <int CNT>
  static inline Scales scales(const uint8_t* base) {
    Scales sc{_mm256_setzero_ps(), _mm256_setzero_ps(), zi(), zi()};
    if constexpr (CNT == 8) {
      // the (d, m) words of the 8 blocks (32-bit words 0, 5, ..., 35 of the group) by five
      // loads and blends instead of a gather: [b0 b2 b4 b7 | b6 b1 b3 b5], then in order
      const __m256i v0 = load32(base), v1 = load32(base + 36), v2 = load32(base + 72);
      const __m256i v3 = load32(base + 104), v4 = load32(base + 128);
      __m256i w = _mm256_blend_epi32(v0, v1, 0x42);
      w = _mm256_blend_epi32(w, v2, 0x84);
      w = _mm256_blend_epi32(w, v3, 0x10);
      w = _mm256_blend_epi32(w, v4, 0x08);
      w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 5, 1, 6, 2, 7, 4, 3));
      const __m256i lh = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, kHalves), 0xd8);
      sc.a = _mm256_cvtph_ps(_mm256_castsi256_si128(lh));
      sc.b = _mm256_cvtph_ps(_mm256_extracti128_si256(lh, 1));
    } else {
      sc.a = halves8<kBytes, CNT>(base, &sc.b);
    }
    return sc;
  }
};

struct WQ5_0 {
  static constexpr bool kSigned = false, kMin = false, kQ6 = false, kNarrow = true;
  static constexpr int kOffsetLog2 = 4;
  static constexpr int kBytes = 22;
  static inline void block(const uint8_t* base, int j, __m256i* u, __m256i*) {
    const uint8_t* p = base + j * kBytes;
    // nibble | 16 where the fifth bit is set: w + 16
    const __m256i hi = _mm256_and_si256(bits32(p + 2), _mm256_set1_epi8(0x10));
    *u = _mm256_or_si256(nibbles32(p + 6), hi);
  }
  template <int CNT>
  static inline Scales scales(const uint8_t* base) {
    return {halves8<kBytes, CNT>(base), _mm256_setzero_ps(), zi(), zi()};
  }
};

struct WQ8_0 {
  static constexpr bool kSigned = true, kMin = false, kQ6 = false, kNarrow = false;
  static constexpr int kOffsetLog2 = 0;
  static constexpr int kBytes = 34;
  static inline void block(const uint8_t* base, int j, __m256i* u, __m256i* s) {
    *s = load32(base + j * kBytes + 2);
    *u = _mm256_sign_epi8(*s, *s);  // |-128| = 128 as an unsigned byte
  }
  template <int CNT>
  static inline Scales scales(const uint8_t* base) {
    return {halves8<kBytes, CNT>(base), _mm256_setzero_ps(), zi(), zi()};
  }
};

// K types: a group of 8 blocks is one super-block of 256 (k is a multiple of 256).
struct WQ4_K {
  static constexpr bool kSigned = false, kMin = true, kQ6 = false, kNarrow = true;
  static constexpr int kOffsetLog2 = 0;
  static inline void block(const uint8_t* base, int j, __m256i* u, __m256i*) {
    __m256i q = load32(base + 16 + 32 * (j / 2));
    if (j % 2) q = _mm256_srli_epi16(q, 4);
    *u = _mm256_and_si256(q, _mm256_set1_epi8(0x0f));
  }
  template <int>
  static inline Scales scales(const uint8_t* base) {
    // the 6-bit scales and mins of the 8 sub-blocks (llama.cpp's kmask unpacking), exactly
    // q4k_scale_min's values
    uint32_t t[3];
    __builtin_memcpy(t, base + 4, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    const uint32_t sc_lo = t[0] & m1, mn_lo = t[1] & m1;
    const uint32_t sc_hi = (t[2] & m2) | (((t[0] >> 6) & m3) << 4);
    const uint32_t mn_hi = ((t[2] >> 4) & m2) | (((t[1] >> 6) & m3) << 4);
    const __m128i v = _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi),
                                     static_cast<int>(mn_lo), static_cast<int>(mn_hi));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    const __m256 a = _mm256_mul_ps(_mm256_set1_ps(h2f(base)), sc);      // exact in fp32
    const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(h2f(base + 2)), mn);  // exact in fp32
    return {a, _mm256_xor_ps(dm, _mm256_set1_ps(-0.0f)), zi(), zi()};
  }
};

struct WQ6_K {
  static constexpr bool kSigned = true, kMin = false, kQ6 = true, kNarrow = true;
  static constexpr int kOffsetLog2 = 0;
  static inline void block(const uint8_t* base, int j, __m256i* u, __m256i* s) {
    const int h = j / 4, jj = j % 4;
    __m256i ql = load32(base + 64 * h + 32 * (jj % 2));
    if (jj / 2) ql = _mm256_srli_epi16(ql, 4);
    const __m256i qh = _mm256_srl_epi16(load32(base + 128 + 32 * h), _mm_cvtsi32_si128(2 * jj));
    const __m256i lo = _mm256_and_si256(ql, _mm256_set1_epi8(0x0f));
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(3)), 4);
    *s = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
    *u = _mm256_sign_epi8(*s, *s);
  }
  template <int>
  static inline Scales scales(const uint8_t* base) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 192));
    const __m128i even = _mm_shuffle_epi8(
        sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    return {_mm256_set1_ps(h2f(base + 208)), _mm256_setzero_ps(), _mm256_cvtepi8_epi32(even),
            _mm256_cvtepi8_epi32(_mm_srli_si128(even, 8))};
  }
};

template <class W>
inline const uint8_t* group_base(const uint8_t* row, int64_t g) {
  if constexpr (W::kQ6) return row + (g / 8) * 210;
  else if constexpr (std::is_same_v<W, WQ4_K>) return row + (g / 8) * 144;
  else return row + g * W::kBytes;
}

// Eight int32 partial sums of block j's dot product with the activation block at x (exact).
template <class W>
inline __m256i block_dot(__m256i u, __m256i s, const int8_t* x) {
  const __m256i xv = load32(x);
#if defined(SP_AVX512)
  // VNNI: the same four-product int32 sums in one instruction (exact: no int16 step at all)
  return _mm256_dpbusd_epi32(zi(), u, W::kSigned ? _mm256_sign_epi8(xv, s) : xv);
#else
  const __m256i p16 = W::kSigned ? _mm256_maddubs_epi16(u, _mm256_sign_epi8(xv, s))
                                 : _mm256_maddubs_epi16(u, xv);
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
#endif
}

// hadd(u, v) of two blocks' int32 partial sums (lane-wise: u0+u1, u2+u3, v0+v1, v2+v3 per
// 128-bit half). The first level takes sums of 4 products |w| * |x| <= W * 127: where
// 4 * W * 127 < 2^15 (all types but Q8_0: W = max|w| <= 32) they are packed to int16 without
// saturation and summed by madd (two single-uop instructions instead of hadd's three; the second
// level, L2, keeps hadd: it balances the multiply and shuffle ports).
template <class W, bool L2 = false>
inline __m256i pair(__m256i u, __m256i v) {
  if constexpr (W::kNarrow && !L2) {
    return _mm256_madd_epi16(_mm256_packs_epi32(u, v), _mm256_set1_epi16(1));
  } else {
    return _mm256_hadd_epi32(u, v);
  }
}

inline float reduce8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// The int32 sums of blocks j0..j0+3 (lane-wise: lo halves in the low 128 bits, hi in the high)
// for the tile's NC columns (group bases base[c]) and RB rows: q[c * RB + r]. Each weight block
// is decoded once for the RB rows; each pair's sums are reduced at once (few live registers).
template <class W, int RB, int NC, int CNT>
inline void quad(const uint8_t* const* base, int j0, const int8_t* const* x, __m256i* q) {
  if (j0 >= CNT) {
    for (int t = 0; t < RB * NC; ++t) q[t] = zi();
    return;
  }
  for (int h = 0; h < 2; ++h) {
    const int j = j0 + 2 * h;
    for (int c = 0; c < NC; ++c) {
      __m256i u0, s0 = zi(), u1 = zi(), s1 = zi();
      W::block(base[c], j, &u0, &s0);
      if (j + 1 < CNT) W::block(base[c], j + 1, &u1, &s1);
      for (int r = 0; r < RB; ++r) {
        const __m256i e = j < CNT ? block_dot<W>(u0, s0, x[r] + 32 * j) : zi();
        const __m256i o = j + 1 < CNT ? block_dot<W>(u1, s1, x[r] + 32 * (j + 1)) : zi();
        __m256i& qt = q[c * RB + r];
        qt = h == 0 ? pair<W>(e, o) : pair<W, true>(qt, pair<W>(e, o));
      }
    }
  }
}

// One group of CNT <= 8 blocks (from block g) of NC columns (weight rows row[c]) for RB rows:
// acc[c * RB + r] lane j += the contract's terms of block g + j (lanes past CNT unchanged).
template <class W, int RB, int NC, int CNT>
inline void group(const sp::Q8GemmArgs& a, const uint8_t* const* row, int64_t r0, int64_t g,
                  __m256* acc) {
  const int64_t nb = a.x.k / 32;
  const uint8_t* base[NC];
  for (int c = 0; c < NC; ++c) base[c] = group_base<W>(row[c], g);
  const int8_t* x[RB];
  for (int r = 0; r < RB; ++r) x[r] = a.x.q + (r0 + r) * a.x.k + 32 * g;
  __m256i q0[RB * NC], q1[RB * NC];
  quad<W, RB, NC, CNT>(base, 0, x, q0);
  quad<W, RB, NC, CNT>(base, 4, x, q1);
  const __m256i mask = lanes_below(CNT);
  const bool full = CNT == 8;
  __m256 dx[RB], sx[RB];
  __m256i sq[RB];
  for (int r = 0; r < RB; ++r) {
    const int64_t off = (r0 + r) * nb + g;
    dx[r] = full ? _mm256_loadu_ps(a.x.d + off) : _mm256_maskload_ps(a.x.d + off, mask);
    if constexpr (W::kMin) {
      sx[r] = full ? _mm256_loadu_ps(a.x.s + off) : _mm256_maskload_ps(a.x.s + off, mask);
    }
    if constexpr (W::kOffsetLog2 > 0) {
      const int* qs = a.x.qsum + off;
      sq[r] = _mm256_slli_epi32(full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs))
                                     : _mm256_maskload_epi32(qs, mask),
                                W::kOffsetLog2);
    }
  }
  for (int c = 0; c < NC; ++c) {
    const Scales sc = W::template scales<CNT>(base[c]);
    for (int r = 0; r < RB; ++r) {
      const int t = c * RB + r;
      const __m256i lo = _mm256_permute2x128_si256(q0[t], q1[t], 0x20);
      const __m256i hi = _mm256_permute2x128_si256(q0[t], q1[t], 0x31);
      __m256i isum = W::kQ6 ? _mm256_add_epi32(_mm256_mullo_epi32(lo, sc.se),
                                               _mm256_mullo_epi32(hi, sc.so))
                            : _mm256_add_epi32(lo, hi);
      if constexpr (W::kOffsetLog2 > 0) isum = _mm256_sub_epi32(isum, sq[r]);
      __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(sc.a, dx[r]), _mm256_cvtepi32_ps(isum), acc[t]);
      if constexpr (W::kMin) v = _mm256_fmadd_ps(sc.b, sx[r], v);
      acc[t] = full ? v : _mm256_blendv_ps(acc[t], v, _mm256_castsi256_ps(mask));
    }
  }
}

// The trailing group of cnt < 8 blocks (types with 32-element blocks only).
template <class W, int RB, int NC>
inline void tail(const sp::Q8GemmArgs& a, const uint8_t* const* row, int64_t r0, int64_t g,
                 int cnt, __m256* acc) {
  switch (cnt) {
    case 1: return group<W, RB, NC, 1>(a, row, r0, g, acc);
    case 2: return group<W, RB, NC, 2>(a, row, r0, g, acc);
    case 3: return group<W, RB, NC, 3>(a, row, r0, g, acc);
    case 4: return group<W, RB, NC, 4>(a, row, r0, g, acc);
    case 5: return group<W, RB, NC, 5>(a, row, r0, g, acc);
    case 6: return group<W, RB, NC, 6>(a, row, r0, g, acc);
    case 7: return group<W, RB, NC, 7>(a, row, r0, g, acc);
    default: return;
  }
}

// The weights of column col + kPrefetch (a.ahead where set; row: column col's), streamed from
// memory once per call at m = 1.
inline void prefetch_ahead(const sp::Q8GemmArgs& a, const uint8_t* row, int64_t col) {
  const int64_t cols = a.ahead > 0 ? a.ahead : kPrefetch;
  if (col + cols < a.n) {
    const char* ahead = reinterpret_cast<const char*>(row + cols * a.row_bytes);
    for (int64_t o = 0; o < a.row_bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
  }
}

// Columns [col, col + NC) for rows [r0, r0 + RB): each weight block is decoded once for the RB
// rows, each activation block loaded once for the NC columns; the RB * NC independent chains
// keep the core busy where one column's chain would wait on its latencies.
template <class W, int RB, int NC>
void column_rows(const sp::Q8GemmArgs& a, int64_t r0, int64_t col) {
  const int64_t nb = a.x.k / 32;
  const uint8_t* row[NC];
  for (int c = 0; c < NC; ++c) row[c] = a.w + (col + c) * a.row_bytes;
  for (int c = 0; c < NC; ++c) prefetch_ahead(a, row[c], col + c);
  __m256 acc[RB * NC];
  for (int t = 0; t < RB * NC; ++t) acc[t] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= nb; g += 8) group<W, RB, NC, 8>(a, row, r0, g, acc);
  if constexpr (!W::kQ6 && !std::is_same_v<W, WQ4_K>) {
    if (g < nb) tail<W, RB, NC>(a, row, r0, g, static_cast<int>(nb - g), acc);
  }
  for (int c = 0; c < NC; ++c) {
    for (int r = 0; r < RB; ++r) {
      float y = reduce8(acc[c * RB + r]);
      if (a.bias != nullptr) y = y + a.bias[col + c];
      a.y[(r0 + r) * a.n + col + c] = y;
    }
  }
}

// Columns [c0, c1) for rows [r0, r0 + rows) in row tiles of up to row_tile (<= 4) rows; one-
// and two-row tiles of the 4-bit types run 2 columns at once (informal timings: it helps them,
// and it slows Q8_0, whose wider blocks then spill registers), the rest one column at a time.
template <class W>
void columns(const sp::Q8GemmArgs& a, int64_t c0, int64_t c1, int row_tile) {
  constexpr int kCols = W::kNarrow ? 2 : 1;
  for (int64_t r0 = 0; r0 < a.x.m;) {
    const int64_t left = a.x.m - r0;
    const int rb = left >= 4 && row_tile >= 4 ? 4 : left >= 2 && row_tile >= 2 ? 2 : 1;
    int64_t c = c0;
    if (rb == 4) {
      for (; c < c1; ++c) column_rows<W, 4, 1>(a, r0, c);
    } else if (rb == 2) {
      for (; c + kCols <= c1; c += kCols) column_rows<W, 2, kCols>(a, r0, c);
      for (; c < c1; ++c) column_rows<W, 2, 1>(a, r0, c);
    } else {
      for (; c + kCols <= c1; c += kCols) column_rows<W, 1, kCols>(a, r0, c);
      for (; c < c1; ++c) column_rows<W, 1, 1>(a, r0, c);
    }
    r0 += rb;
  }
}

}  // namespace

#if defined(SP_AVX512)
#include "gemm_q8_vnni.h"
#else
#include "gemm_q8_lanes.h"
#endif

namespace {

// Column tiles of col_tile columns (the weights of a tile stay in cache across the row tiles;
// the activation rows of a row tile across its columns). Given the interleaved activations, the
// AVX-512 build runs the blocks-across-lanes schedule (gemm_q8_vnni.h), the AVX2 build its own
// for Q4_0 and Q4_1 (gemm_q8_lanes.h).
template <class W>
void run(const sp::Q8GemmArgs& a, int64_t n0, int64_t n1, int row_tile, int col_tile) {
#if defined(SP_AVX512)
  if (a.x.qt != nullptr) return run_transposed<W>(a, n0, n1, row_tile, col_tile);
#else
  if constexpr (kLanes<W>) {
    if (a.x.qt != nullptr) return run_lanes<W>(a, n0, n1, row_tile, col_tile);
  }
#endif
  const int64_t ct = col_tile > 0 ? col_tile : 1;
  for (int64_t c = n0; c < n1; c += ct) columns<W>(a, c, c + ct < n1 ? c + ct : n1, row_tile);
}

}  // namespace

extern "C" void SP_Q8_ENTRY(const sp::Q8GemmArgs* a, int64_t n0, int64_t n1, int row_tile,
                            int col_tile) {
  switch (a->qtype) {
    case sp::Q4_0: return run<WQ4_0>(*a, n0, n1, row_tile, col_tile);
    case sp::Q4_1: return run<WQ4_1>(*a, n0, n1, row_tile, col_tile);
    case sp::Q5_0: return run<WQ5_0>(*a, n0, n1, row_tile, col_tile);
    case sp::Q8_0: return run<WQ8_0>(*a, n0, n1, row_tile, col_tile);
    case sp::Q4_K: return run<WQ4_K>(*a, n0, n1, row_tile, col_tile);
    case sp::Q6_K: return run<WQ6_K>(*a, n0, n1, row_tile, col_tile);
#if defined(SP_AVX512)
    case sp::Q4_0 | sp::kQ8Packed:
      return run_transposed<WQ4_0, true>(*a, n0, n1, row_tile, col_tile);
    case sp::Q4_1 | sp::kQ8Packed:
      return run_transposed<WQ4_1, true>(*a, n0, n1, row_tile, col_tile);
    case sp::Q8_0 | sp::kQ8Packed:
      return run_transposed<WQ8_0, true>(*a, n0, n1, row_tile, col_tile);
#endif
    default: return;
  }
}

#if !defined(SP_AVX512)  // the quantization has one (AVX2) build
extern "C" void sp_q8_quantize_avx2(const float* x, int64_t m, int64_t k, int8_t* q, float* d,
                                    float* s, int32_t* qsum) {
  const int64_t nb = k / 32;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < m * nb; ++i) {
    const float* xb = x + 32 * i;
    __m256 v[4], av[4];
    for (int l = 0; l < 4; ++l) {
      v[l] = _mm256_loadu_ps(xb + 8 * l);
      av[l] = _mm256_andnot_ps(sign, v[l]);  // |x|
    }
    const __m256 mx = _mm256_max_ps(_mm256_max_ps(av[0], av[1]), _mm256_max_ps(av[2], av[3]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float dj = _mm_cvtss_f32(m4) / 127.0f;
    const float id = dj != 0.0f ? 1.0f / dj : 0.0f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i iv[4];
    for (int l = 0; l < 4; ++l) {
      // round half to even, as nearbyint in the default mode (and the portable 1.5 * 2^23 trick)
      const __m256 t = _mm256_round_ps(_mm256_mul_ps(v[l], idv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      iv[l] = _mm256_cvttps_epi32(t);
    }
    const __m256i sum =
        _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                           _mm256_packs_epi32(iv[2], iv[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * i),
                        _mm256_permutevar8x32_epi32(p16, order));
    d[i] = dj;
    s[i] = dj * static_cast<float>(_mm_cvtsi128_si32(s4));
    if (qsum != nullptr) qsum[i] = _mm_cvtsi128_si32(s4);
  }
}
#endif
