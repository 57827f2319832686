// AVX-512 batch-invariant attention, bit-identical to the portable path (attention_scalar.cpp)
// and the AVX2 path (attention_avx2.cpp): the same arithmetic on every element, twice as wide.
//
// As in AVX2, the R = 4, 3 or 2 query heads of one kv group at one (b, t) run as a tile: they
// share the key list, each K and V load, and nothing else. A lone row runs the AVX2 path's tile.
// Scores: one __m512 accumulator holds the 8-lane accumulators of two rows for one key, row a in
// the low 256 bits and row b in the high: the q pair [q_a[d, d+8) | q_b[d, d+8)] (packed once
// per tile) times the key's 8 elements broadcast to both halves, so lane i of each half still
// gets the elements d = 8t + i in increasing t by fma. P = (R + 1) / 2 pairs (3 rows pad the
// second pair with a copy of row 2, whose scores are dropped), blocks of 16 / P keys;
// reduce16 does the contract's pairwise reduction of 16 accumulators at once (lanes i and i+4,
// then i and i+2, then 0 and 1: attention.h reduce8's additions, transposed).
// Softmax: the max over 16 lanes (exact in any order); exp16 (fixed_exp.h) is fixed_exp lane by
// lane, 16 keys at a time; the sum keeps the contract's 8 lanes (lane i % 8, increasing i): the
// keys i..i+7 (the low half) are added before the keys i+8..i+15 (the high half).
// Weighted V: 16 head-dim elements per register, every element still accumulates
// fma(p_i, v_i[d], o[d]) in increasing key rank, then one division by l; a head dimension that
// is an odd multiple of 8 ends with a masked half register. How rows are tiled changes no row's
// arithmetic. A head dimension that is not a multiple of 8 runs the portable rows. Compiled with
// AVX512_FLAGS (kernels/build.py).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention.h"

namespace {

using sp_exp::exp16;  // fixed_exp.h

// reduce8 of the 16 accumulators in v[0..8): accumulator 2m is the low half of v[m], 2m + 1 the
// high half. Accumulator c + 4e's sum lands in lane 4c + e (c, e < 4).
inline __m512 reduce16(const __m512* v) {
  __m512 x[4];
  for (int i = 0; i < 4; ++i) {
    // 128-bit lanes 0, 1 of a half are its lanes 0-3 and 4-7: s_i = a_i + a_(i+4)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // 128-bit lane c of x[i]: s_0..s_3 of accumulator 4i + c; then t_i = s_i + s_(i+2)
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane c of u: t_0 t_1 of accumulators c and 4 + c; of w: 8 + c and 12 + c; then t_0 + t_1
  return _mm512_add_ps(_mm512_shuffle_ps(u, w, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(u, w, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of R rows (one kv head, one key list) against their visible keys: qp holds the P row
// pairs, pair p's elements [d, d+8) of both rows at qp + 2 (p hd + d). Blocks of KB = 16 / P
// keys fill 16 accumulators (enough independent fma chains to keep both fma ports busy), reduced
// 8 registers at a time by reduce16: the 8 keys of one pair go to registers 2 (j % 4) + j / 4, so
// the sums come out as [a: keys 0-3 | b: 0-3 | a: 4-7 | b: 4-7] and one permutation gives row
// a's 8 scores and row b's. idx is padded to a multiple of KB with the last key (those scores
// land past n, where the softmax pads anyway).
template <int R>
void scores(const sp::AttnArgs& a, const float* qp, const float* k, const int32_t* idx,
            int64_t n, float* const* s) {
  constexpr int P = (R + 1) / 2, KB = 16 / P;
  const int64_t hd = a.hd;
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512i rows = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  for (int64_t i = 0; i < n; i += KB) {
    const float* kr[KB];
    __m512 acc[16];
    for (int j = 0; j < KB; ++j) kr[j] = k + idx[i + j] * a.k_sn;
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      __m512 qv[P];
      for (int p = 0; p < P; ++p) qv[p] = _mm512_loadu_ps(qp + 2 * (p * hd + d));
      for (int j = 0; j < KB; ++j) {
        const __m512 kv = _mm512_broadcast_f32x8(_mm256_loadu_ps(kr[j] + d));
        for (int p = 0; p < P; ++p) {
          const int g = p * KB + j, m = 8 * (g / 8) + 2 * (g % 4) + g % 8 / 4;
          acc[m] = _mm512_fmadd_ps(qv[p], kv, acc[m]);
        }
      }
    }
    // registers [8z, 8z + 8): pair p = 8z / KB, keys j0 = 8z % KB .. j0 + 7
    for (int z = 0; z < 2; ++z) {
      const int p = 8 * z / KB, j0 = 8 * z % KB;
      const __m512 x = _mm512_permutexvar_ps(rows, _mm512_mul_ps(reduce16(acc + 8 * z), scale));
      _mm256_storeu_ps(s[2 * p] + i + j0, _mm512_castps512_ps256(x));
      if (2 * p + 1 < R) _mm256_storeu_ps(s[2 * p + 1] + i + j0, _mm512_extractf32x8_ps(x, 1));
    }
  }
}

// p_i = exp(s_i - max) in place; returns the 8-lane sum. s is padded with -inf to a multiple of
// 16 (exp gives +0, and adding +0 leaves the lanes' bits).
float softmax_weights(float* s, int64_t n) {
  const int64_t n16 = (n + 15) & ~int64_t{15};
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  if (n % 16) _mm512_storeu_ps(s + n16 - 16, _mm512_mask_loadu_ps(ninf, tail, s + n16 - 16));
  __m512 mv = ninf;
  for (int64_t i = 0; i < n16; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
  const __m512 mb = _mm512_set1_ps(_mm512_reduce_max_ps(mv));  // the max: exact in any order
  __m256 lanes = _mm256_setzero_ps();
  for (int64_t i = 0; i < n16; i += 16) {
    const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mb));
    _mm512_storeu_ps(s + i, p);
    lanes = _mm256_add_ps(lanes, _mm512_castps512_ps256(p));    // keys i .. i+7
    lanes = _mm256_add_ps(lanes, _mm512_extractf32x8_ps(p, 1));  // then keys i+8 .. i+15
  }
  alignas(32) float l[8];
  _mm256_store_ps(l, lanes);
  return sp::reduce8(l);
}

// Elements [d0, d0 + 16 NV) of the R rows' weighted sums of V (one V load serves R rows); HALF:
// the last register holds 8 elements (masked load and store).
template <int R, int NV, bool HALF>
void weighted_v(const sp::AttnArgs& a, const float* v, const int32_t* idx, const float* const* p,
                int64_t n, const float* l, float* const* out, int64_t d0) {
  constexpr __mmask16 kLast = HALF ? 0x00FF : 0xFFFF;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < n; ++i) {
    __m512 pi[R];
    for (int r = 0; r < R; ++r) pi[r] = _mm512_set1_ps(p[r][i]);
    const float* vr = v + idx[i] * a.v_sn + d0;
    for (int c = 0; c < NV; ++c) {
      __m512 x = HALF && c == NV - 1 ? _mm512_maskz_loadu_ps(kLast, vr + 16 * c)
                                     : _mm512_loadu_ps(vr + 16 * c);
      asm("" : "+v"(x));  // one load per register (else GCC reloads x as an operand of each fma)
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(pi[r], x, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 lv = _mm512_set1_ps(l[r]);
    for (int c = 0; c < NV; ++c) {
      const __m512 y = _mm512_div_ps(acc[r][c], lv);
      if (HALF && c == NV - 1) {
        _mm512_mask_storeu_ps(out[r] + d0 + 16 * c, kLast, y);
      } else {
        _mm512_storeu_ps(out[r] + d0 + 16 * c, y);
      }
    }
  }
}

template <int R, int NV>
void weighted_chunk(const sp::AttnArgs& a, const float* v, const int32_t* idx,
                    const float* const* p, int64_t n, const float* l, float* const* out,
                    int64_t d0, int64_t nv, bool half) {
  if constexpr (NV > 1) {
    if (nv < NV) return weighted_chunk<R, NV - 1>(a, v, idx, p, n, l, out, d0, nv, half);
  }
  if (half) return weighted_v<R, NV, true>(a, v, idx, p, n, l, out, d0);
  weighted_v<R, NV, false>(a, v, idx, p, n, l, out, d0);
}

// Up to 16 accumulators per pass over the keys: 8 registers of two rows, 4 of three or four.
template <int R>
void weighted(const sp::AttnArgs& a, const float* v, const int32_t* idx, const float* const* p,
              int64_t n, const float* l, float* const* out) {
  constexpr int NV = R == 2 ? 8 : 4;
  for (int64_t d0 = 0; d0 < a.hd; d0 += 16 * NV) {
    const int64_t left = a.hd - d0, nv = std::min<int64_t>(NV, (left + 15) / 16);
    weighted_chunk<R, NV>(a, v, idx, p, n, l, out, d0, nv, left < 16 * nv);
  }
}

// The visible slots of row (b, t) in increasing order; the mask is read 64 bytes at a time.
int64_t visible(const sp::AttnArgs& a, int64_t b, int64_t t, int32_t* idx) {
  if (a.mask == nullptr) {
    for (int64_t j = 0; j < a.kv_len; ++j) idx[j] = static_cast<int32_t>(j);
    return a.kv_len;
  }
  const uint8_t* m = a.mask + b * a.m_sb + t * a.m_st;
  int64_t n = 0;
  for (int64_t j = 0; j < a.kv_len; j += 64) {
    const int64_t left = a.kv_len - j;
    const __mmask64 in = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
    const __m512i x = _mm512_maskz_loadu_epi8(in, m + j);
    for (uint64_t set = _mm512_test_epi8_mask(x, x); set != 0; set &= set - 1) {
      idx[n++] = static_cast<int32_t>(j + __builtin_ctzll(set));
    }
  }
  return n;
}

// Rows h0 .. h0 + R - 1 of (b, t): one kv head, one mask row, one key list.
template <int R>
void tile(const sp::AttnArgs& a, int64_t b, int64_t t, int64_t h0, float* work, int32_t* idx) {
  constexpr int P = (R + 1) / 2, KB = 16 / P;
  const int64_t kh = h0 / (a.H / a.Hk), hd = a.hd;
  const float* q[R];
  float* out[R];
  float* s[R];
  float l[R];
  for (int r = 0; r < R; ++r) {
    q[r] = a.q + b * a.q_sb + (h0 + r) * a.q_sh + t * a.q_st;
    out[r] = a.o + b * a.o_sb + (h0 + r) * a.o_sh + t * a.o_st;
    s[r] = work + r * (a.kv_len + 16);
  }
  const int64_t n = visible(a, b, t, idx);
  if (n == 0) {
    for (int r = 0; r < R; ++r) std::memset(out[r], 0, static_cast<size_t>(hd) * sizeof(float));
    return;
  }
  for (int j = 0; j < KB - 1; ++j) idx[n + j] = idx[n - 1];  // the last block (idx: kv_len + 16)
  float* qp = work + 4 * (a.kv_len + 16);                    // P pairs of 2 hd (work: + 4 hd)
  for (int p = 0; p < P; ++p) {
    const float* qa = q[2 * p];
    const float* qb = q[std::min(2 * p + 1, R - 1)];  // 3 rows: row 2 twice
    for (int64_t d = 0; d < hd; d += 8) {
      std::memcpy(qp + 2 * (p * hd + d), qa + d, 8 * sizeof(float));
      std::memcpy(qp + 2 * (p * hd + d) + 8, qb + d, 8 * sizeof(float));
    }
  }
  scores<R>(a, qp, a.k + b * a.k_sb + kh * a.k_sh, idx, n, s);
  for (int r = 0; r < R; ++r) l[r] = softmax_weights(s[r], n);
  weighted<R>(a, a.v + b * a.v_sb + kh * a.v_sh, idx, s, n, l, out);
}

}  // namespace

extern "C" void sp_attention_avx512(const sp::AttnArgs* a, int64_t r0, int64_t r1, float* work,
                                    int32_t* idx) {
  // rows in (b, t, h) order; the heads of one kv group run together in tiles of 4, 3 or 2. A lone
  // row (kv groups of one head, a thread's first or last rows) runs the AVX2 path's tile: it would
  // fill half of each score register here, and its weighted sum waits on the fma latency at
  // either width.
  if (a->hd % 8 != 0) return sp_attention_scalar(a, r0, r1, work, idx);
  if (a->H == a->Hk) return sp_attention_avx2(a, r0, r1, work, idx);
  sp::for_each_head_run(*a, r0, r1, [&](int R, int64_t b, int64_t t, int64_t h) {
    if (R == 4) return tile<4>(*a, b, t, h, work, idx);
    if (R == 3) return tile<3>(*a, b, t, h, work, idx);
    if (R == 2) return tile<2>(*a, b, t, h, work, idx);
    const int64_t r = (b * a->T + t) * a->H + h;  // the row's index in (b, t, h) order
    sp_attention_avx2(a, r, r + 1, work, idx);
  });
}

extern "C" void sp_exp_avx512(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp16(_mm512_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = sp::fixed_exp(x[i]);
}
