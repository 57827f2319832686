// Int8-activation profile: Q8 activation rows and the integer weight terms shared by every path.
//
// Activations are quantized per row in blocks of 32 (sp_q8_quantize): d = max|x| / 127 (fp32
// division), id = d != 0 ? 1 / d : 0, q = x * id rounded to an integer, half to even (as
// nearbyint in the default rounding mode), s = d * (float)sum(q); x must be finite. A weight
// block of 32 gives integers w[32] and floats a (scale) and b (min; 0 when the type has none),
// so that the block's exact contribution sum(w_dequant * x_dequant) is a * d * isum + b * s,
// with isum an exact int32 dot product
// (Q6_K: isum = sc0 * dot(lo 16) + sc1 * dot(hi 16), its two integer sub-scales folded in).
#pragma once

#include <cstdint>

#include "formats.h"

namespace sp {

// Quantized activations: m rows of k int8 values, k / 32 scales d and block sums s per row.
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t m;
  int64_t k;
  const int32_t* qsum = nullptr;  // (m, k / 32) integer block sums (vector paths' offset types)
  const int8_t* qt = nullptr;  // q interleaved by sp_q8_interleave (the AVX-512 path only)
};

// Calls of at least this many rows run the AVX-512 path's blocks-across-lanes schedule
// (gemm_q8_vnni.h); fewer rows do not repay its per-column transposition. Either schedule
// gives the same bits.
constexpr int64_t kQ8InterleaveRows = 3;

inline bool q8_amx_type(int qt) { return qt == Q4_0 || qt == Q4_1 || qt == Q5_0 || qt == Q8_0; }

// Whether a call of m rows of k-wide qt weights runs the AMX schedule (gemm_q8_amx.cpp) on the
// AMX path; other calls there run the AVX-512 path (the same bits). Its cost is nearly flat in
// m up to 16 rows but pays a tile round per block and 16 columns, so it wins from 4 rows (from
// 6 where k > 1024, whose AVX-512 schedule is cheaper per block); single-op timings on a
// 2-core Xeon with AMX, BENCHMARKS.md.
inline bool q8_amx_runs(int qt, int64_t m, int64_t k) {
  return q8_amx_type(qt) && m >= (k > 1024 ? 6 : 4);
}

// One GEMM y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) with x in Q8 blocks.
struct Q8GemmArgs {
  int qtype;
  Q8Rows x;
  const uint8_t* w;
  int64_t row_bytes;
  const float* bias;  // nullptr: none
  float* y;
  int64_t n;
  // One past the last byte of the weight tensor w points into (nullptr: unknown). A schedule
  // may read a trailing group's 8 blocks in place where they end before it (the blocks past
  // the row's end then meet zero activations in lanes that are not stored).
  const uint8_t* w_end = nullptr;
  // Software prefetch distance of the weight stream in columns (0: the schedule's own; see
  // q8_prefetch in ops_q8.cpp). A schedule choice: it never changes a bit of y.
  int64_t ahead = 0;
};

// A weight tensor in the AVX-512 path's packed layout (sp_q8_pack) passes its type as
// qt | kQ8Packed. Q4_0, Q4_1 and Q8_0; the same bytes, reordered. A block's integers are V
// 32-bit words (V = 4 nibble words for Q4_0 / Q4_1, 8 byte words for Q8_0). Per pair of columns
// (2P, 2P + 1), each full group of 8 blocks as the V vectors of 64 bytes the blocks-across-lanes
// schedule reads (byte 64 w + 4 (8 c + j) + b is byte 4 w + b of the integers of block 8g + j of
// column 2P + c: lane 8 c + j), then the 16 fp16 scales d (column 2P's blocks 0-7, then column
// 2P + 1's), for Q4_1 the 16 mins m the same way; after the full groups the T = k / 32 % 8
// trailing blocks of both columns compacted the same way: V vectors of 2T words (byte 8T w + 4
// (T c + j) + b is byte 4 w + b of the integers of trailing block j of column 2P + c: the lanes j
// and 8 + j, j < T, of a full group's vector, expanded at load), then the 2T scales d in the
// same order, for Q4_1 the 2T mins. n must be even.
constexpr int kQ8Packed = 0x100;

inline bool q8_packed(int qt) { return (qt & kQ8Packed) != 0; }

inline int q8_base_type(int qt) { return qt & ~kQ8Packed; }

inline bool q8_packable(int qt) { return qt == Q4_0 || qt == Q4_1 || qt == Q8_0; }

inline bool q8_supported(int qt) {
  if (q8_packed(qt)) return q8_packable(q8_base_type(qt));
  return qt == Q4_0 || qt == Q4_1 || qt == Q5_0 || qt == Q8_0 || qt == Q4_K || qt == Q6_K;
}

inline bool q8_has_min(int qt) { return qt == Q4_1 || qt == Q4_K; }

// Integer weights w[32] of block s (32 elements) of a quantized row, its scale a and min b,
// and the integer sub-scales of its two halves (1 and 1 except for Q6_K).
inline void q8_weight_block(int qt, const uint8_t* row, int64_t s, int8_t* w, float* a, float* b,
                            int* sc0, int* sc1) {
  *b = 0.0f;
  *sc0 = 1;
  *sc1 = 1;
  switch (qt) {
    case Q4_0: {
      const uint8_t* p = row + s * 18;
      *a = half_to_float(rd16(p));
      for (int l = 0; l < 16; ++l) {
        w[l] = static_cast<int8_t>((p[2 + l] & 0x0f) - 8);
        w[l + 16] = static_cast<int8_t>((p[2 + l] >> 4) - 8);
      }
      return;
    }
    case Q4_1: {
      const uint8_t* p = row + s * 20;
      *a = half_to_float(rd16(p));
      *b = half_to_float(rd16(p + 2));
      for (int l = 0; l < 16; ++l) {
        w[l] = static_cast<int8_t>(p[4 + l] & 0x0f);
        w[l + 16] = static_cast<int8_t>(p[4 + l] >> 4);
      }
      return;
    }
    case Q5_0: {
      const uint8_t* p = row + s * 22;
      *a = half_to_float(rd16(p));
      const uint32_t qh = rd32(p + 2);
      for (int l = 0; l < 16; ++l) {
        const int lo = (p[6 + l] & 0x0f) | static_cast<int>(((qh >> l) & 1u) << 4);
        const int hi = (p[6 + l] >> 4) | static_cast<int>(((qh >> (l + 16)) & 1u) << 4);
        w[l] = static_cast<int8_t>(lo - 16);
        w[l + 16] = static_cast<int8_t>(hi - 16);
      }
      return;
    }
    case Q8_0: {
      const uint8_t* p = row + s * 34;
      *a = half_to_float(rd16(p));
      for (int l = 0; l < 32; ++l) w[l] = static_cast<int8_t>(p[2 + l]);
      return;
    }
    case Q4_K: {
      const uint8_t* p = row + (s / 8) * 144;
      const int j = static_cast<int>(s % 8);
      int sc, mn;
      q4k_scale_min(p + 4, j, &sc, &mn);
      *a = half_to_float(rd16(p)) * static_cast<float>(sc);         // exact in fp32
      *b = -(half_to_float(rd16(p + 2)) * static_cast<float>(mn));  // exact in fp32
      const uint8_t* q = p + 16 + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) w[l] = static_cast<int8_t>((q[l] >> shift) & 0x0f);
      return;
    }
    case Q6_K: {
      const uint8_t* p = row + (s / 8) * 210;
      const int j = static_cast<int>(s % 8), h = j / 4, jj = j % 4;
      const uint8_t* ql = p + 64 * h + 32 * (jj % 2);
      const uint8_t* qh = p + 128 + 32 * h;
      const int sl = 4 * (jj / 2), sh = 2 * jj;
      *a = half_to_float(rd16(p + 208));
      *sc0 = static_cast<int8_t>(p[192 + 2 * j]);
      *sc1 = static_cast<int8_t>(p[192 + 2 * j + 1]);
      for (int l = 0; l < 32; ++l) {
        w[l] = static_cast<int8_t>((((ql[l] >> sl) & 0x0f) | (((qh[l] >> sh) & 3) << 4)) - 32);
      }
      return;
    }
    default:
      return;
  }
}

}  // namespace sp

extern "C" {
// Quantize m rows of k floats (k % 32 == 0) to Q8 blocks: q (m, k), d and s (m, k / 32).
void sp_q8_quantize(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s);
// AVX2 quantization, the same bits as sp_q8_quantize; qsum (nullable): the integer block sums.
void sp_q8_quantize_avx2(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s,
                         int32_t* qsum);
// q (m, k) interleaved for the AVX-512 path: per row, ceil(k / 256) groups of 256 bytes; in
// group g, the 32 bytes of step t hold, at 4 * j, elements 4t..4t+3 of block 8g + j (zero past
// the last block).
void sp_q8_interleave(const int8_t* q, int64_t m, int64_t k, int8_t* qt);
// n rows of k-wide Q4_0 / Q4_1 / Q8_0 blocks (qt, unflagged) into the packed layout above (unpack:
// back); src and dst do not overlap and hold n * row_bytes each; n even.
void sp_q8_pack(const uint8_t* src, int qt, int64_t n, int64_t k, uint8_t* dst, bool unpack);
// Portable int8-activation GEMM: columns [n0, n1), the profile's reference order.
void sp_gemm_q8_scalar(const sp::Q8GemmArgs* a, int64_t n0, int64_t n1);
// AVX2 int8-activation GEMM: columns [n0, n1), row tile <= row_tile, column tile col_tile.
void sp_gemm_q8_avx2(const sp::Q8GemmArgs* a, int64_t n0, int64_t n1, int row_tile, int col_tile);
// The same with AVX-512 VNNI: the same bits (gemm_q8_avx512.cpp).
void sp_gemm_q8_avx512(const sp::Q8GemmArgs* a, int64_t n0, int64_t n1, int row_tile,
                       int col_tile);
// The same on AMX-INT8 tiles, for sp::q8_amx_type weights: the same bits (gemm_q8_amx.cpp).
void sp_gemm_q8_amx(const sp::Q8GemmArgs* a, int64_t n0, int64_t n1);
}
