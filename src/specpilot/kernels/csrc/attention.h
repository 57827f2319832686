// Batch-invariant fp32 attention: the argument block and the one exp both ISA paths share.
//
// Row r = (b, h, t) of the output is computed from q[b, h, t], the keys/values its mask row
// lets it see, and nothing else (see the kernels package docstring for the order). Strides are
// in elements; the last dimension of q, k, v, mask and o is contiguous.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

// exp on fp32 with explicit fma only (no libm), so every path that follows these steps gives
// the same bits: round x*log2(e) to n (nearest even, the 1.5*2^23 trick), reduce
// r = x - n*ln2 in two fma steps (Cephes' C1 + C2), a degree-5 Cephes polynomial by fma Horner,
// y = fma(p, r*r, r) + 1, times 2^n. x is clamped to <= 88; x < -87.33654 (2^n would leave the
// normal range) gives +0. Relative error ~2 ulp on the domain the attention uses (x <= 0).
constexpr float kExpLo = -87.33654f;
constexpr float kExpHi = 88.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
constexpr float kC1 = 0.693359375f;
constexpr float kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f;
constexpr float kP1 = 1.3981999507e-3f;
constexpr float kP2 = 8.3334519073e-3f;
constexpr float kP3 = 4.1665795894e-2f;
constexpr float kP4 = 1.6666665459e-1f;
constexpr float kP5 = 5.0000001201e-1f;

inline uint32_t f32_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
inline float from_bits(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

inline float fixed_exp(float x) {
  if (x < kExpLo) return 0.0f;
  if (x > kExpHi) x = kExpHi;
  const float t = std::fma(x, kLog2e, kMagic);
  const float n = t - kMagic;
  const uint32_t ni = f32_bits(t) - f32_bits(kMagic);  // n as a two's complement int
  float r = std::fma(n, -kC1, x);
  r = std::fma(n, -kC2, r);
  float p = kP0;
  p = std::fma(p, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  const float z = r * r;
  const float y = std::fma(p, z, r) + 1.0f;
  return y * from_bits((ni + 127u) << 23);
}

// The GEMM contract's 8-lane reduction: s_i = a_i + a_(i+4), t_i = s_i + s_(i+2), t_0 + t_1.
inline float reduce8(const float* a) {
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  const float t0 = s0 + s2, t1 = s1 + s3;
  return t0 + t1;
}

}  // namespace sp

extern "C" void sp_attention_scalar(const sp::AttnArgs* a, int64_t r0, int64_t r1, float* work,
                                    int32_t* idx);
extern "C" void sp_attention_avx2(const sp::AttnArgs* a, int64_t r0, int64_t r1, float* work,
                                  int32_t* idx);
extern "C" void sp_exp_scalar(const float* x, float* y, int64_t n);
extern "C" void sp_exp_avx2(const float* x, float* y, int64_t n);
