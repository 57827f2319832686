// Row-wise ops of a decoder step (RMSNorm, residual add + RMSNorm, RoPE with optional q/k norms,
// SiLU / GELU-tanh gated products): the contract's scalar definitions, shared by every ISA path.
//
// Every helper here has internal linkage (static inline): the portable and the AVX2 translation
// units each get their own copy, compiled with their own flags, so the linker can never hand the
// portable path an AVX2-compiled helper. Units are compiled with -ffp-contract=off: only the
// std::fma calls below fuse a multiply and an add.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fixed_exp.h"

namespace sp_row {

// GELU-tanh gate as a sigmoid: 0.5 * (1 + tanh(y)) = 1 / (1 + exp(-2y)),
// 2y = g * (kGeluA + kGeluB * g * g) with kGeluA = 2 sqrt(2 / pi), kGeluB = kGeluA * 0.044715.
constexpr float kGeluA = 1.5957691216057308f;
constexpr float kGeluB = 0.0713548162726f;

enum GluKind : int { kSilu = 0, kGeluTanh = 1 };

// act(g) * u with act(g) = g / (1 + exp(-z)), z = g (SiLU) or the GELU-tanh argument; exp is
// the kernels' one exp (fixed_exp.h).
static inline float glu_c(float g, float u, int kind) {
  float z = g;
  if (kind == kGeluTanh) {
    float t = g * g;
    t = t * kGeluB;
    t = t + kGeluA;
    z = g * t;
  }
  const float a = g / (1.0f + sp_exp::exp1(-z));
  return a * u;
}

// The contract's fixed pairwise reduction of 8 lanes.
static inline float reduce8_c(const float* a) {
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  const float t0 = s0 + s2, t1 = s1 + s3;
  return t0 + t1;
}

// 1 / sqrt(mean + eps) from a row's sum of squares.
static inline float inv_rms_c(float sumsq, int64_t n, float eps) {
  const float ms = sumsq / static_cast<float>(n);
  return 1.0f / std::sqrt(ms + eps);
}

}  // namespace sp_row

// Arguments of one RMSNorm call over `rows` rows of `n` elements (row strides in elements).
struct SpNormArgs {
  const float* x;
  int64_t x_stride;
  const float* res;  // nullptr: no residual; else h = x + res is normed and written to h
  int64_t res_stride;
  float* h;          // (rows, n) contiguous, only with res
  const float* w;    // (n,)
  float* y;          // (rows, n) contiguous
  int64_t n;
  float eps;
  int offset;        // 1: the scale is 1 + w (Gemma)
};

// RoPE on the q and k heads of each row (rotate-half layout), optional per-head RMSNorm first.
struct SpRopeArgs {
  const float* q;     // head i of row r at q + r * q_stride + i * hd
  int64_t q_stride;
  const float* k;     // head i of row r at k + r * k_stride + i * hd
  int64_t k_stride;
  const float* cos;   // (rows, hd)
  const float* sin;
  const float* q_w;   // (hd,) or nullptr: no q norm
  const float* k_w;   // (hd,) or nullptr: no k norm
  float eps;
  int offset;
  int64_t n_q, n_k, hd;
  float* y;           // (rows, n_q + n_k, hd)
};

// act(g) * u over rows of n elements.
struct SpGluArgs {
  const float* g;
  int64_t g_stride;
  const float* u;
  int64_t u_stride;
  float* y;  // (rows, n) contiguous
  int64_t n;
  int kind;
};

extern "C" {
void sp_norm_scalar(const SpNormArgs* a, int64_t r0, int64_t r1);
void sp_rope_scalar(const SpRopeArgs* a, int64_t r0, int64_t r1);
void sp_glu_scalar(const SpGluArgs* a, int64_t r0, int64_t r1);
void sp_norm_avx2(const SpNormArgs* a, int64_t r0, int64_t r1);
void sp_rope_avx2(const SpRopeArgs* a, int64_t r0, int64_t r1);
void sp_glu_avx2(const SpGluArgs* a, int64_t r0, int64_t r1);
}
