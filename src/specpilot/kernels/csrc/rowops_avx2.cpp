// AVX2 + FMA row-wise ops, bit-identical to the portable path (rowops_scalar.cpp).
//
// One __m256 accumulator holds the 8 lanes of a row's sum of squares (lane i: elements 8t + i,
// fused in increasing t), reduced in the contract's fixed pairwise order; the tail of a row
// whose length is not a multiple of 8 goes to its lanes k % 8 by scalar std::fma. The vector exp
// is fixed_exp.h's exp8 (its exp1 lane by lane), so every path gives the same bits. Compiled with
// -mavx2 -mfma; called only after a run-time CPU check.
#include <immintrin.h>

#include <cstdint>

#include "rowops.h"

namespace {

float sumsq(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float a[8];
  _mm256_store_ps(a, acc);
  for (; k < n; ++k) a[k % 8] = std::fma(x[k], x[k], a[k % 8]);
  return sp_row::reduce8_c(a);
}

void norm_row(const float* x, const float* w, float* y, int64_t n, float eps, int offset) {
  const float r = sp_row::inv_rms_c(sumsq(x, n), n, eps);
  const __m256 rv = _mm256_set1_ps(r);
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m256 wk = _mm256_loadu_ps(w + k);
    if (offset) wk = _mm256_add_ps(one, wk);
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), rv), wk));
  }
  for (; k < n; ++k) {
    const float wk = offset ? 1.0f + w[k] : w[k];
    y[k] = (x[k] * r) * wk;
  }
}

void rope_head(const float* s, const float* c, const float* sn, float* y, int64_t hd) {
  const int64_t h = hd / 2;
  int64_t j = 0;
  for (; j + 8 <= h; j += 8) {
    const __m256 a = _mm256_loadu_ps(s + j), b = _mm256_loadu_ps(s + j + h);
    const __m256 lo = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + j)),
                                    _mm256_mul_ps(b, _mm256_loadu_ps(sn + j)));
    const __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + j + h)),
                                    _mm256_mul_ps(a, _mm256_loadu_ps(sn + j + h)));
    _mm256_storeu_ps(y + j, lo);
    _mm256_storeu_ps(y + j + h, hi);
  }
  for (; j < h; ++j) {
    const float a = s[j], b = s[j + h];
    y[j] = a * c[j] - b * sn[j];
    y[j + h] = b * c[j + h] + a * sn[j + h];
  }
}

using sp_exp::exp8;  // fixed_exp.h

__m256 glu8(__m256 g, __m256 u, int kind) {
  __m256 z = g;
  if (kind == sp_row::kGeluTanh) {
    __m256 t = _mm256_mul_ps(g, g);
    t = _mm256_mul_ps(t, _mm256_set1_ps(sp_row::kGeluB));
    t = _mm256_add_ps(t, _mm256_set1_ps(sp_row::kGeluA));
    z = _mm256_mul_ps(g, t);
  }
  const __m256 mz = _mm256_xor_ps(z, _mm256_set1_ps(-0.0f));  // -z, as the scalar negation
  const __m256 a = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(mz)));
  return _mm256_mul_ps(a, u);
}

}  // namespace

extern "C" void sp_norm_avx2(const SpNormArgs* a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = a->x + r * a->x_stride;
    float* y = a->y + r * a->n;
    if (a->res != nullptr) {
      const float* res = a->res + r * a->res_stride;
      float* h = a->h + r * a->n;
      int64_t k = 0;
      for (; k + 8 <= a->n; k += 8) {
        _mm256_storeu_ps(h + k, _mm256_add_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(res + k)));
      }
      for (; k < a->n; ++k) h[k] = x[k] + res[k];
      x = h;
    }
    norm_row(x, a->w, y, a->n, a->eps, a->offset);
  }
}

extern "C" void sp_rope_avx2(const SpRopeArgs* a, int64_t r0, int64_t r1) {
  alignas(32) float tmp[1024];
  const int64_t hd = a->hd, heads = a->n_q + a->n_k;
  for (int64_t r = r0; r < r1; ++r) {
    const float* c = a->cos + r * hd;
    const float* sn = a->sin + r * hd;
    for (int64_t i = 0; i < heads; ++i) {
      const bool isq = i < a->n_q;
      const float* s = isq ? a->q + r * a->q_stride + i * hd
                           : a->k + r * a->k_stride + (i - a->n_q) * hd;
      const float* w = isq ? a->q_w : a->k_w;
      if (w != nullptr) {
        norm_row(s, w, tmp, hd, a->eps, a->offset);
        s = tmp;
      }
      rope_head(s, c, sn, a->y + (r * heads + i) * hd, hd);
    }
  }
}

extern "C" void sp_glu_avx2(const SpGluArgs* a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = a->g + r * a->g_stride;
    const float* u = a->u + r * a->u_stride;
    float* y = a->y + r * a->n;
    int64_t k = 0;
    for (; k + 8 <= a->n; k += 8) {
      _mm256_storeu_ps(y + k, glu8(_mm256_loadu_ps(g + k), _mm256_loadu_ps(u + k), a->kind));
    }
    for (; k < a->n; ++k) y[k] = sp_row::glu_c(g[k], u[k], a->kind);
  }
}
