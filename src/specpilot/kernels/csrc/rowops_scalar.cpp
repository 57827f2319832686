// Portable row-wise ops: the reference order of the row-op contract (rowops.h), plain C++.
//
// RMSNorm: lane k % 8 accumulates fma(x[k], x[k], lane) in increasing k, the fixed pairwise
// reduction, r = 1 / sqrt(sum / n + eps), y[k] = (x[k] * r) * w[k] (w[k] = 1 + w[k] with offset).
// RoPE: y[j] = s[j] * cos[j] - s[j + h] * sin[j], y[j + h] = s[j + h] * cos[j + h] + s[j] * sin[j]
// (h = hd / 2; each product rounded, then the sum). GLU: glu_c.
#include <cstdint>

#include "rowops.h"

namespace {

void norm_row(const float* x, const float* w, float* y, int64_t n, float eps, int offset) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t k = 0; k < n; ++k) acc[k % 8] = std::fma(x[k], x[k], acc[k % 8]);
  const float r = sp_row::inv_rms_c(sp_row::reduce8_c(acc), n, eps);
  for (int64_t k = 0; k < n; ++k) {
    const float wk = offset ? 1.0f + w[k] : w[k];
    y[k] = (x[k] * r) * wk;
  }
}

void rope_head(const float* s, const float* c, const float* sn, float* y, int64_t hd) {
  const int64_t h = hd / 2;
  for (int64_t j = 0; j < h; ++j) {
    const float a = s[j], b = s[j + h];
    y[j] = a * c[j] - b * sn[j];
    y[j + h] = b * c[j + h] + a * sn[j + h];
  }
}

}  // namespace

extern "C" void sp_norm_scalar(const SpNormArgs* a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = a->x + r * a->x_stride;
    float* y = a->y + r * a->n;
    if (a->res != nullptr) {
      const float* res = a->res + r * a->res_stride;
      float* h = a->h + r * a->n;
      for (int64_t k = 0; k < a->n; ++k) h[k] = x[k] + res[k];
      x = h;
    }
    norm_row(x, a->w, y, a->n, a->eps, a->offset);
  }
}

extern "C" void sp_rope_scalar(const SpRopeArgs* a, int64_t r0, int64_t r1) {
  float tmp[1024];
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

extern "C" void sp_glu_scalar(const SpGluArgs* a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = a->g + r * a->g_stride;
    const float* u = a->u + r * a->u_stride;
    float* y = a->y + r * a->n;
    for (int64_t k = 0; k < a->n; ++k) y[k] = sp_row::glu_c(g[k], u[k], a->kind);
  }
}
