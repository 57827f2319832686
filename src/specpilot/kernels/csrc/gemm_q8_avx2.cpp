// AVX2 int8-activation GEMM over GGUF blocks, bit-identical to gemm_q8_scalar.cpp.
//
// A weight block's 32 integers sit in one __m256i; its exact dot product with a Q8 activation
// block is _mm256_maddubs_epi16 (unsigned weights directly; signed ones as |w| with the sign
// moved onto x) then _mm256_madd_epi16 (by ones, or by Q6_K's two sub-scales), eight int32
// partial sums. Eight blocks' partial sums are reduced to their eight exact isums (hadd tree:
// integer, so order-free), lane j = block 8g + j, and then the profile's float steps run on
// the 8 lanes at once: acc = fma(a_w * d_x, isum, acc) (+ fma(b_w, s_x, acc) for Q4_1 / Q4_K),
// the same per-lane order as the portable path. A trailing group of fewer than 8 blocks
// updates only its lanes (blend). The tile shape (RB rows x CN columns) is only a schedule.
// Compiled with -mavx2 -mfma -mf16c; called only after a run-time CPU check.
#include <immintrin.h>

#include <cstdint>

#include "gemm_q8.h"

namespace {

inline float h2f(const uint8_t* p) { return _cvtsh_ss(sp::rd16(p)); }

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 32 nibbles of 16 bytes in element order: low nibbles (0..15), then high nibbles (16..31).
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// Byte e is 0xff where bit e of the 32-bit word at p is set (llama.cpp's bytes_from_bits_32).
inline __m256i bits32(const uint8_t* p) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                         0x0101010101010101, 0x0000000000000000);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(sp::rd32(p))), shuf);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

// Weight decoders: q = the block's 32 integers, a / b its scale and min, sc its madd factors.
struct WQ4_0 {
  static constexpr bool kSigned = true, kMin = false, kScaled = false;
  static __m256i load(const uint8_t* row, int64_t s, float* a, float*, __m256i*) {
    const uint8_t* p = row + s * 18;
    *a = h2f(p);
    return _mm256_sub_epi8(nibbles32(p + 2), _mm256_set1_epi8(8));
  }
};

struct WQ4_1 {
  static constexpr bool kSigned = false, kMin = true, kScaled = false;
  static __m256i load(const uint8_t* row, int64_t s, float* a, float* b, __m256i*) {
    const uint8_t* p = row + s * 20;
    *a = h2f(p);
    *b = h2f(p + 2);
    return nibbles32(p + 4);
  }
};

struct WQ5_0 {
  static constexpr bool kSigned = true, kMin = false, kScaled = false;
  static __m256i load(const uint8_t* row, int64_t s, float* a, float*, __m256i*) {
    const uint8_t* p = row + s * 22;
    *a = h2f(p);
    // nibble | 0xf0 where the fifth bit is clear: nibble + 16 * bit - 16 as int8
    const __m256i hi = _mm256_andnot_si256(bits32(p + 2), _mm256_set1_epi8(static_cast<char>(0xf0)));
    return _mm256_or_si256(nibbles32(p + 6), hi);
  }
};

struct WQ8_0 {
  static constexpr bool kSigned = true, kMin = false, kScaled = false;
  static __m256i load(const uint8_t* row, int64_t s, float* a, float*, __m256i*) {
    const uint8_t* p = row + s * 34;
    *a = h2f(p);
    return load32(p + 2);
  }
};

struct WQ4_K {
  static constexpr bool kSigned = false, kMin = true, kScaled = false;
  static __m256i load(const uint8_t* row, int64_t s, float* a, float* b, __m256i*) {
    const uint8_t* p = row + (s / 8) * 144;
    const int j = static_cast<int>(s % 8);
    int sc, mn;
    sp::q4k_scale_min(p + 4, j, &sc, &mn);
    *a = h2f(p) * static_cast<float>(sc);
    *b = -(h2f(p + 2) * static_cast<float>(mn));
    const __m256i q = load32(p + 16 + 32 * (j / 2));
    const __m256i sh = _mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (j % 2)));
    return _mm256_and_si256(sh, _mm256_set1_epi8(0x0f));
  }
};

struct WQ6_K {
  static constexpr bool kSigned = true, kMin = false, kScaled = true;
  static __m256i load(const uint8_t* row, int64_t s, float* a, float*, __m256i* sc) {
    const uint8_t* p = row + (s / 8) * 210;
    const int j = static_cast<int>(s % 8), h = j / 4, jj = j % 4;
    *a = h2f(p + 208);
    const __m128i s0 = _mm_set1_epi16(static_cast<int8_t>(p[192 + 2 * j]));
    const __m128i s1 = _mm_set1_epi16(static_cast<int8_t>(p[192 + 2 * j + 1]));
    *sc = _mm256_set_m128i(s1, s0);
    const __m256i ql = _mm256_srl_epi16(load32(p + 64 * h + 32 * (jj % 2)),
                                        _mm_cvtsi32_si128(4 * (jj / 2)));
    const __m256i qh = _mm256_srl_epi16(load32(p + 128 + 32 * h), _mm_cvtsi32_si128(2 * jj));
    const __m256i lo = _mm256_and_si256(ql, _mm256_set1_epi8(0x0f));
    const __m256i hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(3)), 4),
                                        _mm256_set1_epi8(0x30));
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
  }
};

// Eight int32 partial sums of one block's dot product (exact); wa = |w| (signed types).
template <class W>
inline __m256i block_dot(__m256i w, __m256i wa, __m256i x, __m256i sc) {
  __m256i p16;
  if constexpr (W::kSigned) {
    p16 = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(x, w));
  } else {
    p16 = _mm256_maddubs_epi16(w, x);
  }
  return _mm256_madd_epi16(p16, W::kScaled ? sc : _mm256_set1_epi16(1));
}

// Lane j = sum of the 8 int32 of v[j] (exact integer sums).
inline __m256i hsum8(const __m256i* v) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

inline float reduce8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

template <class W, int RB, int CN>
void tile(const sp::Q8GemmArgs& a, int64_t r0, int64_t c0) {
  const int64_t nb = a.x.k / 32;
  __m256 acc[RB][CN];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CN; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t g = 0; g < nb; g += 8) {
    const int cnt = static_cast<int>(nb - g < 8 ? nb - g : 8);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), lane_ids);
    __m256 dx[RB], sx[RB];
    for (int r = 0; r < RB; ++r) {
      const int64_t o = (r0 + r) * nb + g;
      dx[r] = _mm256_maskload_ps(a.x.d + o, mask);
      if constexpr (W::kMin) sx[r] = _mm256_maskload_ps(a.x.s + o, mask);
    }
    for (int c = 0; c < CN; ++c) {
      const uint8_t* row = a.w + (c0 + c) * a.row_bytes;
      float aw[8] = {}, bw[8] = {};
      __m256i wq[8], wa[8], sc[8];
      for (int b = 0; b < 8; ++b) {
        sc[b] = _mm256_setzero_si256();
        wq[b] = b < cnt ? W::load(row, g + b, &aw[b], &bw[b], &sc[b]) : _mm256_setzero_si256();
        wa[b] = W::kSigned ? _mm256_sign_epi8(wq[b], wq[b]) : wq[b];  // |w|, once per column
      }
      const __m256 awv = _mm256_setr_ps(aw[0], aw[1], aw[2], aw[3], aw[4], aw[5], aw[6], aw[7]);
      const __m256 bwv = _mm256_setr_ps(bw[0], bw[1], bw[2], bw[3], bw[4], bw[5], bw[6], bw[7]);
      for (int r = 0; r < RB; ++r) {
        const int8_t* qx = a.x.q + (r0 + r) * a.x.k + 32 * g;
        __m256i v[8];
        for (int b = 0; b < 8; ++b) {
          v[b] = b < cnt ? block_dot<W>(wq[b], wa[b], load32(qx + 32 * b), sc[b])
                         : _mm256_setzero_si256();
        }
        const __m256 isum = _mm256_cvtepi32_ps(hsum8(v));
        __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(awv, dx[r]), isum, acc[r][c]);
        if constexpr (W::kMin) t = _mm256_fmadd_ps(bwv, sx[r], t);
        acc[r][c] = cnt == 8 ? t : _mm256_blendv_ps(acc[r][c], t, _mm256_castsi256_ps(mask));
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CN; ++c) {
      float y = reduce8(acc[r][c]);
      if (a.bias != nullptr) y = y + a.bias[c0 + c];
      a.y[(r0 + r) * a.n + c0 + c] = y;
    }
  }
}

// Rows in groups of the largest RB <= row_tile that fits (RB * CN <= 8), per column tile of CN.
template <class W, int CN>
void column_tile(const sp::Q8GemmArgs& a, int64_t c0, int row_tile) {
  int64_t r0 = 0;
  while (r0 < a.x.m) {
    const int64_t left = a.x.m - r0;
    if constexpr (CN == 1) {
      if (row_tile >= 8 && left >= 8) {
        tile<W, 8, 1>(a, r0, c0);
        r0 += 8;
        continue;
      }
    }
    if constexpr (CN <= 2) {
      if (row_tile >= 4 && left >= 4) {
        tile<W, 4, CN>(a, r0, c0);
        r0 += 4;
        continue;
      }
    }
    if (row_tile >= 2 && left >= 2) {
      tile<W, 2, CN>(a, r0, c0);
      r0 += 2;
      continue;
    }
    tile<W, 1, CN>(a, r0, c0);
    r0 += 1;
  }
}

template <class W>
void run(const sp::Q8GemmArgs& a, int64_t n0, int64_t n1, int row_tile, int col_tile) {
  int64_t c = n0;
  if (col_tile >= 4) {
    for (; c + 4 <= n1; c += 4) column_tile<W, 4>(a, c, row_tile);
  } else if (col_tile >= 2) {
    for (; c + 2 <= n1; c += 2) column_tile<W, 2>(a, c, row_tile);
  }
  for (; c < n1; ++c) column_tile<W, 1>(a, c, row_tile);
}

}  // namespace

extern "C" void sp_gemm_q8_avx2(const sp::Q8GemmArgs* a, int64_t n0, int64_t n1, int row_tile,
                                int col_tile) {
  switch (a->qtype) {
    case sp::Q4_0: return run<WQ4_0>(*a, n0, n1, row_tile, col_tile);
    case sp::Q4_1: return run<WQ4_1>(*a, n0, n1, row_tile, col_tile);
    case sp::Q5_0: return run<WQ5_0>(*a, n0, n1, row_tile, col_tile);
    case sp::Q8_0: return run<WQ8_0>(*a, n0, n1, row_tile, col_tile);
    case sp::Q4_K: return run<WQ4_K>(*a, n0, n1, row_tile, col_tile);
    case sp::Q6_K: return run<WQ6_K>(*a, n0, n1, row_tile, col_tile);
    default: return;
  }
}
