// Portable int8-activation GEMM over GGUF blocks: the reference order of the int8 profile.
//
// Row quantization (sp_q8_quantize) and, per output element, 8 fp32 lanes starting at +0:
// weight block j (32 elements along k) goes to lane j % 8, in increasing j:
//   lane = fma(a_w * d_x, (float)isum, lane); then, for types with a min (Q4_1, Q4_K),
//   lane = fma(b_w, s_x, lane);
// then the fp32 contract's pairwise reduction (a_i + a_(i+4), then + a_(i+2), then + a_1) and
// the bias last. The AVX2 path (gemm_q8_avx2.cpp) gives the same bits.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gemm_q8.h"

namespace {

constexpr int kRows = 4;  // rows sharing one decoded weight block; changes no row's order
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23

float reduce8(float* acc) {
  for (int w = 4; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) acc[i] = acc[i] + acc[i + w];
  }
  return acc[0];
}

void column_rows(const sp::Q8GemmArgs& a, int64_t col, int64_t r0, int rows) {
  float acc[kRows][8] = {};
  const uint8_t* row = a.w + col * a.row_bytes;
  const int64_t nb = a.x.k / 32;
  const bool has_min = sp::q8_has_min(a.qtype);
  int8_t w[32];
  for (int64_t j = 0; j < nb; ++j) {
    float aw, bw;
    int sc0, sc1;
    sp::q8_weight_block(a.qtype, row, j, w, &aw, &bw, &sc0, &sc1);
    for (int r = 0; r < rows; ++r) {
      const int64_t xr = r0 + r;
      const int8_t* q = a.x.q + xr * a.x.k + 32 * j;
      int32_t lo = 0, hi = 0;
      for (int l = 0; l < 16; ++l) lo += static_cast<int32_t>(w[l]) * q[l];
      for (int l = 16; l < 32; ++l) hi += static_cast<int32_t>(w[l]) * q[l];
      const int32_t isum = sc0 * lo + sc1 * hi;
      float& lane = acc[r][j % 8];
      const float p = aw * a.x.d[xr * nb + j];
      lane = std::fma(p, static_cast<float>(isum), lane);
      if (has_min) lane = std::fma(bw, a.x.s[xr * nb + j], lane);
    }
  }
  for (int r = 0; r < rows; ++r) {
    float v = reduce8(acc[r]);
    if (a.bias != nullptr) v = v + a.bias[col];
    a.y[(r0 + r) * a.n + col] = v;
  }
}

}  // namespace

extern "C" void sp_q8_quantize(const float* x, int64_t m, int64_t k, int8_t* q, float* d,
                               float* s) {
  const int64_t nb = k / 32;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < nb; ++j) {
      const float* xb = x + r * k + 32 * j;
      float amax = 0.0f;
      for (int l = 0; l < 32; ++l) {
        const float v = std::fabs(xb[l]);
        amax = v > amax ? v : amax;
      }
      const float dj = amax / 127.0f;
      const float id = dj != 0.0f ? 1.0f / dj : 0.0f;
      int32_t sum = 0;
      int8_t* qb = q + r * k + 32 * j;
      for (int l = 0; l < 32; ++l) {
        // |x * id| <= 127 + ulp: adding 1.5 * 2^23 rounds to an integer, half to even, exactly
        // as nearbyint in the default rounding mode (and vectorizes); the subtraction is exact
        const float t = (xb[l] * id + kRound) - kRound;
        const int v = static_cast<int>(t);
        qb[l] = static_cast<int8_t>(v);
        sum += v;
      }
      d[r * nb + j] = dj;
      s[r * nb + j] = dj * static_cast<float>(sum);
    }
  }
}

extern "C" void sp_gemm_q8_scalar(const sp::Q8GemmArgs* a, int64_t n0, int64_t n1) {
  for (int64_t col = n0; col < n1; ++col) {
    for (int64_t r0 = 0; r0 < a->x.m; r0 += kRows) {
      const int rows = static_cast<int>(a->x.m - r0 < kRows ? a->x.m - r0 : kRows);
      column_rows(*a, col, r0, rows);
    }
  }
}

extern "C" void sp_q8_interleave(const int8_t* q, int64_t m, int64_t k, int8_t* qt) {
  const int64_t nb = k / 32, ng = (nb + 7) / 8;
  for (int64_t r = 0; r < m; ++r) {
    const int8_t* src = q + r * k;
    int8_t* dst = qt + r * ng * 256;
    for (int64_t g = 0; g < ng; ++g) {
      for (int t = 0; t < 8; ++t) {
        for (int j = 0; j < 8; ++j) {
          const int64_t b = 8 * g + j;
          int8_t* o = dst + 256 * g + 32 * t + 4 * j;
          if (b < nb) std::memcpy(o, src + 32 * b + 4 * t, 4);
          else std::memset(o, 0, 4);
        }
      }
    }
  }
}

extern "C" void sp_q8_pack(const uint8_t* src, int qt, int64_t n, int64_t k, uint8_t* dst,
                           bool unpack) {
  const int bb = sp::block_bytes(qt), off = qt == sp::Q4_1 ? 4 : 2;  // integers after d (, m)
  const int V = (bb - off) / 4;  // 32-bit words of a block's integers: 4 (nibbles) or 8 (Q8_0)
  const int64_t nb = k / 32, ng = nb / 8, tail = nb % 8, rb = nb * bb;
  const int64_t group = 16 * static_cast<int64_t>(bb);  // bytes of one pair's packed group
  // P: the packed bytes, B: the blocks; one is read (src), the other written (dst)
  uint8_t* P = unpack ? const_cast<uint8_t*>(src) : dst;
  uint8_t* B = unpack ? dst : const_cast<uint8_t*>(src);
  const auto move = [unpack](uint8_t* packed, uint8_t* block, size_t len) {
    if (unpack) std::memcpy(block, packed, len);
    else std::memcpy(packed, block, len);
  };
  for (int64_t p = 0; p < n / 2; ++p) {
    uint8_t* pk = P + 2 * p * rb;
    for (int c = 0; c < 2; ++c) {
      uint8_t* col = B + (2 * p + c) * rb;
      for (int64_t g = 0; g < ng; ++g) {
        uint8_t* o = pk + g * group;
        for (int j = 0; j < 8; ++j) {  // lane 8 c + j of each vector
          uint8_t* blk = col + (8 * g + j) * bb;
          for (int w = 0; w < V; ++w) move(o + 64 * w + 4 * (8 * c + j), blk + off + 4 * w, 4);
          for (int h = 0; h < off / 2; ++h) {  // d, then (Q4_1) m
            move(o + 64 * V + 32 * h + 2 * (8 * c + j), blk + 2 * h, 2);
          }
        }
      }
      uint8_t* t = pk + ng * group;  // the trailing blocks: word ci = c * tail + j of each
      for (int64_t j = 0; j < tail; ++j) {
        uint8_t* blk = col + (8 * ng + j) * bb;
        const int64_t ci = c * tail + j;
        for (int w = 0; w < V; ++w) move(t + 8 * tail * w + 4 * ci, blk + off + 4 * w, 4);
        for (int h = 0; h < off / 2; ++h) {
          move(t + 8 * tail * V + 4 * tail * h + 2 * ci, blk + 2 * h, 2);
        }
      }
    }
  }
}
