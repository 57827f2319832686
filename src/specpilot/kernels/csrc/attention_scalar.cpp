// Portable batch-invariant attention: the reference order of the attention contract, plain C++.
//
// Per row: the visible keys in increasing slot order (rank i = 0, 1, ...); score_i by the
// 8-lane fma dot product (lane d % 8, increasing d, attention.h reduce8) times the scale;
// m = max score; p_i = fixed_exp(score_i - m); l = 8-lane sum of p_i (lane i % 8, increasing i,
// reduce8); o[d] = fma(p_i, v_i[d], o[d]) in increasing i from +0; out[d] = o[d] / l. A row that
// sees no key is zeros.
#include <cstdint>

#include "attention.h"

namespace {

int64_t visible(const sp::AttnArgs& a, int64_t b, int64_t t, int32_t* idx) {
  if (a.mask == nullptr) {
    for (int64_t j = 0; j < a.kv_len; ++j) idx[j] = static_cast<int32_t>(j);
    return a.kv_len;
  }
  const uint8_t* m = a.mask + b * a.m_sb + t * a.m_st;
  int64_t n = 0;
  for (int64_t j = 0; j < a.kv_len; ++j) {
    if (m[j]) idx[n++] = static_cast<int32_t>(j);
  }
  return n;
}

float dot8(const float* x, const float* y, int64_t hd) {
  float lanes[8] = {};
  for (int64_t d = 0; d < hd; ++d) lanes[d % 8] = std::fma(x[d], y[d], lanes[d % 8]);
  return sp::reduce8(lanes);
}

void row(const sp::AttnArgs& a, int64_t r, float* work, int32_t* idx) {
  const int64_t h = r % a.H, t = (r / a.H) % a.T, b = r / (a.H * a.T);  // (b, t, h) order
  const int64_t kh = h / (a.H / a.Hk);
  const float* q = a.q + b * a.q_sb + h * a.q_sh + t * a.q_st;
  const float* k = a.k + b * a.k_sb + kh * a.k_sh;
  const float* v = a.v + b * a.v_sb + kh * a.v_sh;
  float* out = a.o + b * a.o_sb + h * a.o_sh + t * a.o_st;
  const int64_t n = visible(a, b, t, idx);
  if (n == 0) {
    for (int64_t d = 0; d < a.hd; ++d) out[d] = 0.0f;
    return;
  }
  float* s = work;
  for (int64_t i = 0; i < n; ++i) s[i] = dot8(q, k + idx[i] * a.k_sn, a.hd) * a.scale;
  float m = s[0];
  for (int64_t i = 1; i < n; ++i) m = s[i] > m ? s[i] : m;
  float lanes[8] = {};
  for (int64_t i = 0; i < n; ++i) {
    s[i] = sp::fixed_exp(s[i] - m);
    lanes[i % 8] = lanes[i % 8] + s[i];
  }
  const float l = sp::reduce8(lanes);
  float* acc = work + a.kv_len + 8;
  for (int64_t d = 0; d < a.hd; ++d) acc[d] = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float* vr = v + idx[i] * a.v_sn;
    for (int64_t d = 0; d < a.hd; ++d) acc[d] = std::fma(s[i], vr[d], acc[d]);
  }
  for (int64_t d = 0; d < a.hd; ++d) out[d] = acc[d] / l;
}

}  // namespace

extern "C" void sp_attention_scalar(const sp::AttnArgs* a, int64_t r0, int64_t r1, float* work,
                                    int32_t* idx) {
  for (int64_t r = r0; r < r1; ++r) row(*a, r, work, idx);
}

extern "C" void sp_exp_scalar(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = sp::fixed_exp(x[i]);
}
