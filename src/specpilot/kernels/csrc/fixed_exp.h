// The one exp of the kernels (the attention's softmax and the gated activations' sigmoid):
// scalar, in AVX2 + FMA units 8-lane and in AVX-512 units 16-lane, the same operations in the
// same order.
//
// exp on fp32 with explicit fma only (no libm), so every path that follows these steps gives
// the same bits: round x*log2(e) to n (nearest even, the 1.5*2^23 trick), reduce
// r = x - n*ln2 in two fma steps (Cephes' C1 + C2), a degree-5 Cephes polynomial by fma Horner,
// y = fma(p, r*r, r) + 1, times 2^n. x is clamped to <= 88; x < -87.33654 (2^n would leave the
// normal range) gives +0; NaN stays NaN. Relative error ~2 ulp.
//
// Every function here has internal linkage (static inline): the portable, AVX2 and AVX-512 units
// each get their own copy, compiled with their own flags.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sp_exp {

constexpr float kLo = -87.33654f;
constexpr float kHi = 88.0f;
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

static inline uint32_t f32_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
static inline float from_bits(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

static inline float exp1(float x) {
  if (x < kLo) return 0.0f;
  if (x > kHi) x = kHi;
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

#if defined(__AVX2__) && defined(__FMA__)
// exp1 lane by lane.
static inline __m256 exp8(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kLo), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(kHi), x);  // NaN stays NaN (min returns x)
  const __m256 magic = _mm256_set1_ps(kMagic);
  const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), magic);
  const __m256 n = _mm256_sub_ps(t, magic);
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kC1), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kC2), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  const __m256 z = _mm256_mul_ps(r, r);
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, z, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
#endif

#if defined(__AVX512F__)
// exp1 lane by lane, 16 lanes: exp8's steps; an underflowing lane is zeroed by its mask bit.
static inline __m512 exp16(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kLo), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_set1_ps(kHi), x);  // NaN stays NaN (min returns x)
  const __m512 magic = _mm512_set1_ps(kMagic);
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), magic);
  const __m512 n = _mm512_sub_ps(t, magic);
  const __m512i ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(magic));
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kC1), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kC2), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  const __m512 z = _mm512_mul_ps(r, r);
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, z, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under),
                             _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}
#endif

}  // namespace sp_exp
