// Portable GEMM over GGUF blocks: the reference order of the numerics contract, plain C++.
//
// For every output element: `lanes` fp32 accumulators (the contract uses 8), element k goes to
// lane k % lanes, accumulated in increasing k with std::fma (one rounding), then the halving
// pairwise reduction a[i] += a[i + w] for w = lanes/2, ..., 1, then + bias. lanes = 4 exists
// only so tests can show that a different order gives different bits.
#include <cmath>
#include <cstdint>

#include "formats.h"

namespace {

constexpr int kRows = 4;  // rows sharing one decoded chunk; does not change any row's order
constexpr int kMaxLanes = 8;

float reduce_lanes(float* acc, int lanes) {
  for (int w = lanes / 2; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) acc[i] = acc[i] + acc[i + w];
  }
  return acc[0];
}

void column_rows(const sp::GemmArgs& a, int64_t col, int64_t r0, int rows, int lanes) {
  float acc[kRows][kMaxLanes] = {};
  float wbuf[32];
  const uint8_t* row = a.w + col * a.row_bytes;
  const bool dense = sp::is_dense(a.qtype);
  for (int64_t k0 = 0; k0 < a.k; k0 += 32) {
    const int len = static_cast<int>(a.k - k0 < 32 ? a.k - k0 : 32);
    if (dense) {
      sp::decode_dense(a.qtype, row, k0, len, wbuf);
    } else {
      sp::decode32(a.qtype, row, k0 / 32, wbuf);
    }
    for (int r = 0; r < rows; ++r) {
      const float* x = a.x + (r0 + r) * a.k + k0;
      for (int i = 0; i < len; ++i) {
        float& lane = acc[r][(k0 + i) % lanes];
        lane = std::fma(x[i], wbuf[i], lane);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    float v = reduce_lanes(acc[r], lanes);
    if (a.bias != nullptr) v = v + a.bias[col];
    a.y[(r0 + r) * a.n + col] = v;
  }
}

}  // namespace

extern "C" void sp_gemm_scalar(const sp::GemmArgs* a, int64_t n0, int64_t n1, int lanes) {
  for (int64_t col = n0; col < n1; ++col) {
    for (int64_t r0 = 0; r0 < a->m; r0 += kRows) {
      const int rows = static_cast<int>(a->m - r0 < kRows ? a->m - r0 : kRows);
      column_rows(*a, col, r0, rows, lanes);
    }
  }
}
