// Batch-invariant fp32 attention: the argument block and the one exp (fixed_exp.h) the ISA
// paths (portable, AVX2, AVX-512) share.
//
// Row r = (b, h, t) of the output is computed from q[b, h, t], the keys/values its mask row
// lets it see, and nothing else (see the kernels package docstring for the order). Strides are
// in elements; the last dimension of q, k, v, mask and o is contiguous.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fixed_exp.h"

namespace sp {

struct AttnArgs {
  const float* q;
  int64_t q_sb, q_sh, q_st;
  const float* k;
  int64_t k_sb, k_sh, k_sn;
  const float* v;
  int64_t v_sb, v_sh, v_sn;
  const uint8_t* mask;  // nullptr: every row sees keys [0, kv_len)
  int64_t m_sb, m_st;
  float* o;
  int64_t o_sb, o_sh, o_st;
  int64_t B, H, T, Hk, hd, kv_len;
  float scale;
};

// The kernels' one exp (fixed_exp.h): the softmax weights p_i = exp(s_i - max).
static inline float fixed_exp(float x) { return sp_exp::exp1(x); }

// The GEMM contract's 8-lane reduction: s_i = a_i + a_(i+4), t_i = s_i + s_(i+2), t_0 + t_1.
inline float reduce8(const float* a) {
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  const float t0 = s0 + s2, t1 = s1 + s3;
  return t0 + t1;
}

// Rows [r0, r1) in (b, t, h) order, the heads of one kv group in runs of up to 4:
// run(R, b, t, h0) computes rows h0 .. h0 + R - 1 of (b, t) (R = 1..4; the vector paths' tiles).
template <class Run>
inline void for_each_head_run(const AttnArgs& a, int64_t r0, int64_t r1, Run&& run) {
  const int64_t group = a.H / a.Hk;
  int64_t r = r0;
  while (r < r1) {
    const int64_t h = r % a.H, t = (r / a.H) % a.T, b = r / (a.H * a.T);
    const int64_t left = (r1 - r) < ((h / group + 1) * group - h) ? (r1 - r)
                                                                   : ((h / group + 1) * group - h);
    const int R = left >= 4 ? 4 : static_cast<int>(left);
    run(R, b, t, h);
    r += R;
  }
}

}  // namespace sp

extern "C" void sp_attention_scalar(const sp::AttnArgs* a, int64_t r0, int64_t r1, float* work,
                                    int32_t* idx);
extern "C" void sp_attention_avx2(const sp::AttnArgs* a, int64_t r0, int64_t r1, float* work,
                                  int32_t* idx);
extern "C" void sp_attention_avx512(const sp::AttnArgs* a, int64_t r0, int64_t r1, float* work,
                                    int32_t* idx);
extern "C" void sp_exp_scalar(const float* x, float* y, int64_t n);
extern "C" void sp_exp_avx2(const float* x, float* y, int64_t n);
extern "C" void sp_exp_avx512(const float* x, float* y, int64_t n);
