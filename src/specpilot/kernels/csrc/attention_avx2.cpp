// AVX2 + FMA batch-invariant attention, bit-identical to the portable path (attention_scalar.cpp).
//
// The R = 4, 3, 2 or 1 query heads of one kv group at one (b, t) run as a tile: they share the key
// list, each K and V load, and nothing else. Scores: blocks of 8 / R keys, one __m256
// accumulator per (row, key) (lane i gets the elements d = 8t + i, increasing t,
// _mm256_fmadd_ps), then reduce8x8 does the contract's pairwise reduction for all eight at once
// (lanes i and i+4, then i and i+2, then 0 and 1: the same additions as attention.h reduce8,
// only transposed). exp8 (fixed_exp.h) is fixed_exp lane by lane. The sum of p_i keeps lane i % 8 in a
// vector; the weighted sum of V is vectorized over the head dimension (every element still
// accumulates in increasing key rank). How rows are tiled changes no row's arithmetic. A head
// dimension that is not a multiple of 8 runs the portable rows. Compiled with -mavx2 -mfma.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "attention.h"

namespace {

using sp_exp::exp8;  // fixed_exp.h

inline float reduce8(__m256 v) {
  alignas(32) float l[8];
  _mm256_store_ps(l, v);
  return sp::reduce8(l);
}

// reduce8 of eight accumulators at once, results in key order.
inline __m256 reduce8x8(const __m256* v) {
  __m256 x[4];
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  }
  // x[0] = [s(k0) | s(k1)], s_i = a_i + a_(i+4); then t_i = s_i + s_(i+2)
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // u = [t0 t1 (k0), t0 t1 (k2) | t0 t1 (k1), t0 t1 (k3)]; then t_0 + t_1
  const __m256 sum = _mm256_add_ps(_mm256_shuffle_ps(u, w, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(u, w, _MM_SHUFFLE(3, 1, 3, 1)));
  // sum = [k0 k2 k4 k6 | k1 k3 k5 k7]
  return _mm256_permutevar8x32_ps(sum, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Scores of R rows (same kv head and mask row) against their visible keys, KB = 8 / R keys per
// block: the R * KB accumulators (6 of the 8 when R = 3) share each key load and are reduced
// together by reduce8x8.
template <int R>
void scores(const sp::AttnArgs& a, const float* const* q, const float* k, const int32_t* idx,
            int64_t n, float* const* s) {
  constexpr int KB = 8 / R;
  const int64_t hd = a.hd;
  const __m256 scale = _mm256_set1_ps(a.scale);
  int64_t i = 0;
  for (; i + KB <= n; i += KB) {
    const float* kr[KB];
    __m256 acc[8];
    for (int j = 0; j < KB; ++j) kr[j] = k + idx[i + j] * a.k_sn;
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      __m256 qv[R];
      for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(q[r] + d);
      for (int j = 0; j < KB; ++j) {
        const __m256 kv = _mm256_loadu_ps(kr[j] + d);
        for (int r = 0; r < R; ++r) acc[r * KB + j] = _mm256_fmadd_ps(qv[r], kv, acc[r * KB + j]);
      }
    }
    alignas(32) float res[8];
    _mm256_store_ps(res, _mm256_mul_ps(reduce8x8(acc), scale));
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < KB; ++j) s[r][i + j] = res[r * KB + j];
    }
  }
  for (; i < n; ++i) {
    const float* kr = k + idx[i] * a.k_sn;
    for (int r = 0; r < R; ++r) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), _mm256_loadu_ps(kr + d), acc);
      }
      s[r][i] = reduce8(acc) * a.scale;
    }
  }
}

// p_i = exp(s_i - max) in place (s is padded to a multiple of 8); returns the 8-lane sum.
float softmax_weights(float* s, int64_t n) {
  __m256 mv = _mm256_set1_ps(s[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
  alignas(32) float ml[8];
  _mm256_store_ps(ml, mv);
  float m = ml[0];
  for (int j = 1; j < 8; ++j) m = ml[j] > m ? ml[j] : m;
  for (; i < n; ++i) m = s[i] > m ? s[i] : m;
  for (int64_t j = n; j < ((n + 7) & ~int64_t{7}); ++j) s[j] = -INFINITY;  // exp gives +0
  const __m256 mb = _mm256_set1_ps(m);
  __m256 lanes = _mm256_setzero_ps();
  for (i = 0; i < n; i += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mb));
    _mm256_storeu_ps(s + i, p);
    lanes = _mm256_add_ps(lanes, p);
  }
  return reduce8(lanes);
}

// Dimensions [d0, d0 + 8 NV) of the R rows' weighted sums of V (one V load serves R rows).
template <int R, int NV>
void weighted_v(const sp::AttnArgs& a, const float* v, const int32_t* idx, const float* const* p,
                int64_t n, const float* l, float* const* out, int64_t d0) {
  __m256 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < n; ++i) {
    __m256 pi[R];
    for (int r = 0; r < R; ++r) pi[r] = _mm256_set1_ps(p[r][i]);
    const float* vr = v + idx[i] * a.v_sn + d0;
    for (int c = 0; c < NV; ++c) {
      const __m256 x = _mm256_loadu_ps(vr + 8 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(pi[r], x, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 lv = _mm256_set1_ps(l[r]);
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(out[r] + d0 + 8 * c, _mm256_div_ps(acc[r][c], lv));
  }
}

template <int R, int NV>
void weighted_chunk(const sp::AttnArgs& a, const float* v, const int32_t* idx,
                    const float* const* p, int64_t n, const float* l, float* const* out,
                    int64_t d0, int64_t nv) {
  if constexpr (NV > 1) {
    if (nv < NV) return weighted_chunk<R, NV - 1>(a, v, idx, p, n, l, out, d0, nv);
  }
  weighted_v<R, NV>(a, v, idx, p, n, l, out, d0);
}

template <int R>
void weighted(const sp::AttnArgs& a, const float* v, const int32_t* idx, const float* const* p,
              int64_t n, const float* l, float* const* out) {
  constexpr int NV = 8 / R;
  for (int64_t d0 = 0; d0 < a.hd; d0 += 8 * NV) {
    const int64_t nv = (a.hd - d0) / 8;
    weighted_chunk<R, NV>(a, v, idx, p, n, l, out, d0, nv < NV ? nv : NV);
  }
}

int64_t visible(const sp::AttnArgs& a, int64_t b, int64_t t, int32_t* idx) {
  if (a.mask == nullptr) {
    for (int64_t j = 0; j < a.kv_len; ++j) idx[j] = static_cast<int32_t>(j);
    return a.kv_len;
  }
  const uint8_t* m = a.mask + b * a.m_sb + t * a.m_st;
  int64_t n = 0;
  for (int64_t j = 0; j < a.kv_len; ++j) {
    idx[n] = static_cast<int32_t>(j);
    n += m[j] != 0;
  }
  return n;
}

// Rows h0 .. h0 + R - 1 of (b, t): one kv head, one mask row, one key list.
template <int R>
void tile(const sp::AttnArgs& a, int64_t b, int64_t t, int64_t h0, float* work, int32_t* idx) {
  const int64_t kh = h0 / (a.H / a.Hk);
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
    for (int r = 0; r < R; ++r) {
      for (int64_t d = 0; d < a.hd; ++d) out[r][d] = 0.0f;
    }
    return;
  }
  scores<R>(a, q, a.k + b * a.k_sb + kh * a.k_sh, idx, n, s);
  for (int r = 0; r < R; ++r) l[r] = softmax_weights(s[r], n);
  weighted<R>(a, a.v + b * a.v_sb + kh * a.v_sh, idx, s, n, l, out);
}

}  // namespace

extern "C" void sp_attention_avx2(const sp::AttnArgs* a, int64_t r0, int64_t r1, float* work,
                                  int32_t* idx) {
  if (a->hd % 8 != 0) {
    sp_attention_scalar(a, r0, r1, work, idx);
    return;
  }
  // the heads of one kv group run together in tiles of 4, 3, 2 or 1
  sp::for_each_head_run(*a, r0, r1, [&](int R, int64_t b, int64_t t, int64_t h) {
    if (R == 4) return tile<4>(*a, b, t, h, work, idx);
    if (R == 3) return tile<3>(*a, b, t, h, work, idx);
    if (R == 2) return tile<2>(*a, b, t, h, work, idx);
    tile<1>(*a, b, t, h, work, idx);
  });
}

extern "C" void sp_exp_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = sp::fixed_exp(x[i]);
}
