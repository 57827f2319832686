// GGUF block formats: layout constants and the scalar decoders shared by every ISA path.
//
// Each decoder reproduces, value for value, the fp32 arithmetic of gguf.quants.dequantize
// (gguf-py): scales are fp16 -> fp32 (exact), then the same products / sums in the same order,
// each rounded to fp32 once. Both translation units are compiled with -ffp-contract=off, so the
// compiler never fuses a multiply and an add that the reference rounds separately.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace sp {

enum QType : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14, BF16 = 30,
};

// Elements per block and bytes per block (ggml's GGML_QUANT_SIZES); 0 when unsupported.
inline int block_elems(int qt) {
  switch (qt) {
    case F32: case F16: case BF16: return 1;
    case Q4_0: case Q4_1: case Q5_0: case Q8_0: return 32;
    case Q4_K: case Q6_K: return 256;
    default: return 0;
  }
}

inline int block_bytes(int qt) {
  switch (qt) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q6_K: return 210;
    default: return 0;
  }
}

inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t rd32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

inline float bits_f32(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

// IEEE half -> float, exact (as numpy's float16.astype(float32)).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline float bf16_to_float(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Q4_K: 6-bit scale and min of sub-block j (0..7), as gguf's Q4_K.get_scale_min.
inline void q4k_scale_min(const uint8_t* sc12, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = sc12[j] & 0x3f;
    *mn = sc12[4 + j] & 0x3f;
  } else {
    *sc = (sc12[8 + j - 4] & 0x0f) | ((sc12[j - 4] >> 2) & 0x30);
    *mn = (sc12[8 + j - 4] >> 4) | ((sc12[4 + j - 4] >> 2) & 0x30);
  }
}

// Decode the 32 elements [32*s, 32*s + 32) of a quantized row (s: sub-block index along K).
inline void decode32(int qt, const uint8_t* row, int64_t s, float* out) {
  switch (qt) {
    case Q4_0: {
      const uint8_t* b = row + s * 18;
      const float d = half_to_float(rd16(b));
      for (int l = 0; l < 16; ++l) {
        out[l] = d * static_cast<float>((b[2 + l] & 0x0f) - 8);
        out[l + 16] = d * static_cast<float>((b[2 + l] >> 4) - 8);
      }
      return;
    }
    case Q4_1: {
      const uint8_t* b = row + s * 20;
      const float d = half_to_float(rd16(b)), m = half_to_float(rd16(b + 2));
      for (int l = 0; l < 16; ++l) {
        out[l] = d * static_cast<float>(b[4 + l] & 0x0f) + m;
        out[l + 16] = d * static_cast<float>(b[4 + l] >> 4) + m;
      }
      return;
    }
    case Q5_0: {
      const uint8_t* b = row + s * 22;
      const float d = half_to_float(rd16(b));
      const uint32_t qh = rd32(b + 2);
      for (int l = 0; l < 16; ++l) {
        const int lo = (b[6 + l] & 0x0f) | static_cast<int>(((qh >> l) & 1u) << 4);
        const int hi = (b[6 + l] >> 4) | static_cast<int>(((qh >> (l + 16)) & 1u) << 4);
        out[l] = d * static_cast<float>(lo - 16);
        out[l + 16] = d * static_cast<float>(hi - 16);
      }
      return;
    }
    case Q8_0: {
      const uint8_t* b = row + s * 34;
      const float d = half_to_float(rd16(b));
      for (int l = 0; l < 32; ++l) out[l] = static_cast<float>(static_cast<int8_t>(b[2 + l])) * d;
      return;
    }
    case Q4_K: {
      const uint8_t* b = row + (s / 8) * 144;
      const int j = static_cast<int>(s % 8);
      int sc, mn;
      q4k_scale_min(b + 4, j, &sc, &mn);
      const float dsc = half_to_float(rd16(b)) * static_cast<float>(sc);
      const float dm = half_to_float(rd16(b + 2)) * static_cast<float>(mn);
      const uint8_t* q = b + 16 + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) out[l] = dsc * static_cast<float>((q[l] >> shift) & 0x0f) - dm;
      return;
    }
    case Q6_K: {
      const uint8_t* b = row + (s / 8) * 210;
      const int j = static_cast<int>(s % 8), h = j / 4, jj = j % 4;
      const uint8_t* ql = b + 64 * h + 32 * (jj % 2);
      const uint8_t* qh = b + 128 + 32 * h;
      const int sl = 4 * (jj / 2), sh = 2 * jj;
      const float d = half_to_float(rd16(b + 208));
      const float ds0 = d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * j]));
      const float ds1 = d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * j + 1]));
      for (int l = 0; l < 32; ++l) {
        const int q = (((ql[l] >> sl) & 0x0f) | (((qh[l] >> sh) & 3) << 4)) - 32;
        out[l] = (l < 16 ? ds0 : ds1) * static_cast<float>(q);
      }
      return;
    }
    default:
      return;
  }
}

// Decode elements [k0, k0 + len) of a dense row (F32 / F16 / BF16).
inline void decode_dense(int qt, const uint8_t* row, int64_t k0, int len, float* out) {
  if (qt == F32) {
    std::memcpy(out, row + 4 * k0, 4 * static_cast<size_t>(len));
  } else if (qt == F16) {
    for (int i = 0; i < len; ++i) out[i] = half_to_float(rd16(row + 2 * (k0 + i)));
  } else {
    for (int i = 0; i < len; ++i) out[i] = bf16_to_float(rd16(row + 2 * (k0 + i)));
  }
}

inline bool is_dense(int qt) { return qt == F32 || qt == F16 || qt == BF16; }

// Arguments of one GEMM y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]); x, y contiguous rows.
struct GemmArgs {
  int qtype;
  const float* x;
  int64_t m;
  int64_t k;
  const uint8_t* w;
  int64_t row_bytes;
  const float* bias;  // nullptr: none
  float* y;
  int64_t n;
};

}  // namespace sp

namespace sp {
// Calls with at least this many rows decode each weight once into a panel (gemm_avx2.cpp);
// fewer rows decode in registers per row tile (and one more for the 32-element block types,
// see panel_rows there). Either way the same bits.
constexpr int64_t kPanelRows = 4;
// Threads get column ranges in multiples of this (a multiple of every column tile).
constexpr int64_t kColumnUnit = 12;
}  // namespace sp

// Entry points of the kernel translation units (plain C linkage, no torch types).
extern "C" {
// Portable path: columns [n0, n1) for all rows, with `lanes` accumulator lanes (8 = the contract).
void sp_gemm_scalar(const sp::GemmArgs* a, int64_t n0, int64_t n1, int lanes);
// AVX2+FMA+F16C path: columns [n0, n1), row tile <= row_tile, column tile col_tile.
void sp_gemm_avx2(const sp::GemmArgs* a, int64_t n0, int64_t n1, int row_tile, int col_tile);
// The same with AVX-512 (F/BW/DQ/VL, VNNI): the same bits (gemm_avx512.cpp).
void sp_gemm_avx512(const sp::GemmArgs* a, int64_t n0, int64_t n1, int row_tile, int col_tile);
// 1 when the AVX2 translation unit was compiled in (its object linked).
int sp_avx2_compiled(void);
}
