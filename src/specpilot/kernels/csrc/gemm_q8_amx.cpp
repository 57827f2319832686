// AMX schedule of the int8-activation GEMM (Intel AMX-INT8 tiles for the block dot products,
// AVX-512 for the float steps), for Q4_0, Q4_1, Q5_0 and Q8_0 weights (calls of sp::q8_amx_runs).
//
// The integer part: one tile product per weight block and 16 output columns. Tile A holds one
// block (32 int8) of each of up to 16 activation rows, loaded in place from the row-major Q8
// rows (stride k); tile B the same block of 16 weight columns in the VNNI layout (B[t][4c + i] =
// element 4t + i of column c: the decoded blocks transposed 16 x 8 in 32-bit words); tdpbssd
// leaves in C[r][c] the block's exact int32 dot product of row r and column c (signed x signed,
// so Q4_0 is w - 8, Q5_0 w - 16 and Q8_0 w as they are; Q4_1's nibbles 0..15 multiply as
// signed too).
//
// The float part is the contract's, vectorized over the 16 columns: fp32 lane j of an output
// takes blocks j, j + 8, .. in increasing order, lane = fma(a * d_x, float(isum), lane), then
// for Q4_1 lane = fma(m, s_x, lane); the lanes are built one at a time over all blocks (so the
// accumulators of up to 16 rows stay in registers), then reduced pairwise (a_i + a_(i+4), + a_(i+2),
// + a_1) and the bias added last. Integer sums are exact and every float step is the portable
// path's, element by element: the same bits as every other path (tests/test_kernels_int8.py).
// Calls of more than 16 rows decode a chunk of strips (kChunk x 16 columns) once, B tiles and
// widened scales into a per-thread buffer, and run every 16-row block against it (the same
// tiles and the same float steps, so the same bits; what changes is only how often a block is
// decoded). Called only after a run-time check that the CPU has AMX-INT8 and the kernel granted
// this process the tile state (isa.h: cpu_has_amx).
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "gemm_q8.h"
#include "transpose512.h"

namespace {

// GCC's tile intrinsics are asm statements that do not name the memory they read or write
// (_tile_loadconfig names 8 of its 64 bytes): without this barrier the compiler may drop or
// move the stores of a tile config or of a B tile before the instruction that reads them, or
// read a tile's stored sums before the store.
#define SP_TILE_MEMORY() asm volatile("" ::: "memory")

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Two tile sets, so that two blocks' tile products are in flight at once: 0 / 3 = C (rb rows x
// 16 int32), 1 / 4 = A (rb rows x 32 int8), 2 / 5 = B (8 rows x 64 int8).
void configure(int rb) {
  alignas(64) TileConfig c = {};
  c.palette_id = 1;
  for (int t = 0; t < 6; t += 3) {
    c.rows[t] = static_cast<uint8_t>(rb);
    c.colsb[t] = 64;
    c.rows[t + 1] = static_cast<uint8_t>(rb);
    c.colsb[t + 1] = 32;
    c.rows[t + 2] = 8;
    c.colsb[t + 2] = 64;
  }
  SP_TILE_MEMORY();
  _tile_loadconfig(&c);
}

// Block layouts: bytes, offset of the quants, a min (Q4_1), nibbles, the fifth bits (Q5_0's 32
// high bits at offset 2), and the offset taken off each integer.
struct AQ4_0 {
  static constexpr int kBytes = 18, kOff = 2;
  static constexpr bool kMin = false, kNibbles = true, kFifth = false;
  static constexpr char kBias = 8;
};
struct AQ4_1 {
  static constexpr int kBytes = 20, kOff = 4;
  static constexpr bool kMin = true, kNibbles = true, kFifth = false;
  static constexpr char kBias = 0;
};
struct AQ5_0 {
  static constexpr int kBytes = 22, kOff = 6;
  static constexpr bool kMin = false, kNibbles = true, kFifth = true;
  static constexpr char kBias = 16;
};
struct AQ8_0 {
  static constexpr int kBytes = 34, kOff = 2;
  static constexpr bool kMin = false, kNibbles = false, kFifth = false;
  static constexpr char kBias = 0;
};

// Q5_0's fifth bits of B rows t and t + 4 as 0x10 in each byte: bit 4t + i (and 16 + 4t + i)
// of a column's 32-bit qh goes to byte i of its word; x * 0x204081 copies bit i of a 4-bit x
// to bit 8i (the four shifted copies do not overlap, so nothing carries).
inline __m512i fifth_bits(__m512i qh, int shift) {
  const __m512i x = _mm512_and_si512(_mm512_srli_epi32(qh, shift), _mm512_set1_epi32(0xf));
  const __m512i spread = _mm512_and_si512(_mm512_mullo_epi32(x, _mm512_set1_epi32(0x204081)),
                                          _mm512_set1_epi32(0x01010101));
  return _mm512_slli_epi32(spread, 4);
}

inline __m128i ld128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i ld256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Tile B of block b for the 16 columns at row[0..15] (row[c] = row[0] + idx word c): 8 rows of
// 64 bytes at out.
template <class W>
__attribute__((always_inline)) inline void btile(const uint8_t* const* row, __m512i idx,
                                                 int64_t b, int8_t* out) {
  const int64_t o = b * W::kBytes + W::kOff;
  if constexpr (W::kNibbles) {
    // 16 bytes of nibbles per column (low nibbles: elements 0..15, high: 16..31) as 4 words;
    // column 4L + q in 128-bit lane L of z[q], so a 4 x 4 word transpose per lane leaves word t
    // of column c at position c of r[t]
    __m512i z[4];
    for (int q = 0; q < 4; ++q) {
      __m512i v = _mm512_castsi128_si512(ld128(row[q] + o));
      v = _mm512_inserti32x4(v, ld128(row[4 + q] + o), 1);
      v = _mm512_inserti32x4(v, ld128(row[8 + q] + o), 2);
      z[q] = _mm512_inserti32x4(v, ld128(row[12 + q] + o), 3);
    }
    const __m512i a0 = _mm512_unpacklo_epi32(z[0], z[1]), a1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i a2 = _mm512_unpacklo_epi32(z[2], z[3]), a3 = _mm512_unpackhi_epi32(z[2], z[3]);
    const __m512i r[4] = {_mm512_unpacklo_epi64(a0, a2), _mm512_unpackhi_epi64(a0, a2),
                          _mm512_unpacklo_epi64(a1, a3), _mm512_unpackhi_epi64(a1, a3)};
    const __m512i low = _mm512_set1_epi8(0x0f), bias = _mm512_set1_epi8(W::kBias);
    __m512i qh = _mm512_setzero_si512();
    if constexpr (W::kFifth) qh = _mm512_i32gather_epi32(idx, row[0] + b * W::kBytes + 2, 1);
    for (int t = 0; t < 4; ++t) {
      __m512i lo = _mm512_and_si512(r[t], low);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(r[t], 4), low);
      if constexpr (W::kFifth) {
        lo = _mm512_or_si512(lo, fifth_bits(qh, 4 * t));
        hi = _mm512_or_si512(hi, fifth_bits(qh, 16 + 4 * t));
      }
      if constexpr (W::kBias != 0) {
        lo = _mm512_sub_epi8(lo, bias);
        hi = _mm512_sub_epi8(hi, bias);
      }
      _mm512_store_si512(out + 64 * t, lo);
      _mm512_store_si512(out + 64 * (t + 4), hi);
    }
  } else {
    // 32 bytes per column: columns p and 8 + p in the halves of z[p], 8 x 8 words transposed
    // per half
    __m512i z[8];
    for (int p = 0; p < 8; ++p) {
      z[p] = _mm512_inserti64x4(_mm512_castsi256_si512(ld256(row[p] + o)), ld256(row[8 + p] + o),
                                1);
    }
    sp::transpose8x8(z);
    for (int t = 0; t < 8; ++t) _mm512_store_si512(out + 64 * t, z[t]);
  }
}

// The 16 weight rows of the strip at column c (nc live; the others repeat the last live one) and
// their byte offsets from row[0] (the gathers' index).
struct StripRows {
  const uint8_t* row[16];
  __m512i idx;
  StripRows(const sp::Q8GemmArgs& a, int64_t c, int nc) {
    alignas(64) int32_t offs[16];
    for (int i = 0; i < 16; ++i) {
      row[i] = a.w + (c + (i < nc ? i : nc - 1)) * a.row_bytes;
      offs[i] = static_cast<int32_t>((i < nc ? i : nc - 1) * a.row_bytes);
    }
    idx = _mm512_load_si512(offs);
  }
};

// The next strip's weights (up to n1), streamed in while this one runs.
inline void prefetch_next(const sp::Q8GemmArgs& a, int64_t c, int64_t n1) {
  if (c + 16 < n1) {  // a.n is the row stride of y, past this part's columns in a fused call
    const int64_t next = n1 - (c + 16) < 16 ? n1 - (c + 16) : 16;
    const char* p = reinterpret_cast<const char*>(a.w + (c + 16) * a.row_bytes);
    for (int64_t o = 0; o < next * a.row_bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
  }
}

// The fp16 scale (and min) of block b of the strip's 16 columns, widened exactly.
template <class W>
inline void block_scales(const StripRows& s, int64_t b, __m512* sa, __m512* sm) {
  const __m512i g = _mm512_i32gather_epi32(s.idx, s.row[0] + b * W::kBytes, 1);
  *sa = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
  *sm = _mm512_setzero_ps();
  if constexpr (W::kMin) *sm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
}

// A strip's decoded blocks: nb B tiles of 512 bytes, then the widened scales and mins (nb x 16
// floats each), as decode_strip writes them.
struct Decoded {
  const int8_t* tiles;
  const float* sa;
  const float* sm;
};

// Columns [c, c + nc) (nc <= 16) for rows [r0, r0 + RB), tiles configured for RB rows; n1: the
// end of this call's columns (the next strip's weights are prefetched up to it). dec: the strip
// decoded by decode_strip (its tiles and scales are read from there), or null (decoded here).
template <class W, int RB>
void strip(const sp::Q8GemmArgs& a, int64_t c, int nc, int64_t n1, int64_t r0, int8_t* bbuf,
           int32_t* cbuf, const Decoded* dec = nullptr) {
  const int64_t nb = a.x.k / 32;
  const StripRows sr(a, c, nc);
  const uint8_t* const* row = sr.row;
  const __m512i idx = sr.idx;
  if (dec == nullptr) prefetch_next(a, c, n1);  // its lanes visit each row 8 times
  const int8_t* xq = a.x.q + r0 * a.x.k;
  const float* xd = a.x.d + r0 * nb;
  const float* xs = a.x.s + r0 * nb;
  alignas(64) float lanes[8][RB][16];
  // B tile of block b (decoded into buf, or in the decoded strip)
  const auto tile_b = [&](int64_t b, int8_t* buf) -> const int8_t* {
    if (dec != nullptr) return dec->tiles + 512 * b;
    btile<W>(row, idx, b, buf);
    return buf;
  };
  // The float steps of block b from its int32 sums at cs: lane acc of the RB rows
  const auto fold = [&](int64_t b, const int32_t* cs, __m512* acc) {
    __m512 sa, sm;
    if (dec != nullptr) {
      sa = _mm512_load_ps(dec->sa + 16 * b);
      sm = W::kMin ? _mm512_load_ps(dec->sm + 16 * b) : _mm512_setzero_ps();
    } else {
      block_scales<W>(sr, b, &sa, &sm);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512 is = _mm512_cvtepi32_ps(_mm512_load_si512(cs + 16 * r));
      __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(sa, _mm512_set1_ps(xd[r * nb + b])), is, acc[r]);
      if constexpr (W::kMin) v = _mm512_fmadd_ps(sm, _mm512_set1_ps(xs[r * nb + b]), v);
      acc[r] = v;
    }
  };
  for (int j = 0; j < 8; ++j) {
    __m512 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
    int64_t b = j;
    for (; b + 8 < nb; b += 16) {  // blocks b and b + 8 of lane j, one tile set each
      const int8_t* t0 = tile_b(b, bbuf);
      const int8_t* t1 = tile_b(b + 8, bbuf + 512);
      SP_TILE_MEMORY();
      _tile_loadd(2, t0, 64);
      _tile_loadd(1, xq + 32 * b, a.x.k);
      _tile_zero(0);
      _tile_dpbssd(0, 1, 2);
      _tile_loadd(5, t1, 64);
      _tile_loadd(4, xq + 32 * (b + 8), a.x.k);
      _tile_zero(3);
      _tile_dpbssd(3, 4, 5);
      _tile_stored(0, cbuf, 64);
      _tile_stored(3, cbuf + 256, 64);
      SP_TILE_MEMORY();
      fold(b, cbuf, acc);
      fold(b + 8, cbuf + 256, acc);
    }
    if (b < nb) {
      const int8_t* t0 = tile_b(b, bbuf);
      SP_TILE_MEMORY();
      _tile_loadd(2, t0, 64);
      _tile_loadd(1, xq + 32 * b, a.x.k);
      _tile_zero(0);
      _tile_dpbssd(0, 1, 2);
      _tile_stored(0, cbuf, 64);
      SP_TILE_MEMORY();
      fold(b, cbuf, acc);
    }
    for (int r = 0; r < RB; ++r) _mm512_store_ps(lanes[j][r], acc[r]);
  }
  const __mmask16 live = static_cast<__mmask16>((1u << nc) - 1);
  const __m512 bias =
      a.bias != nullptr ? _mm512_maskz_loadu_ps(live, a.bias + c) : _mm512_setzero_ps();
  for (int r = 0; r < RB; ++r) {
    __m512 s[4];
    for (int i = 0; i < 4; ++i) {
      s[i] = _mm512_add_ps(_mm512_load_ps(lanes[i][r]), _mm512_load_ps(lanes[i + 4][r]));
    }
    const __m512 t0 = _mm512_add_ps(s[0], s[2]), t1 = _mm512_add_ps(s[1], s[3]);
    __m512 y = _mm512_add_ps(t0, t1);
    if (a.bias != nullptr) y = _mm512_add_ps(y, bias);
    _mm512_mask_storeu_ps(a.y + (r0 + r) * a.n + c, live, y);
  }
}

// Columns [n0, n1) for rows [r0, r0 + RB); dec: their strips decoded (decode_strip, one
// Decoded per strip in order), or null.
template <class W, int RB>
void rows_tile(const sp::Q8GemmArgs& a, int64_t n0, int64_t n1, int64_t r0, int8_t* bbuf,
               int32_t* cbuf, const Decoded* dec) {
  for (int64_t c = n0; c < n1; c += 16) {
    strip<W, RB>(a, c, static_cast<int>(n1 - c < 16 ? n1 - c : 16), n1, r0, bbuf, cbuf,
                 dec != nullptr ? dec + (c - n0) / 16 : nullptr);
  }
}

template <class W, int RB = 1>
void rows_dispatch(const sp::Q8GemmArgs& a, int64_t n0, int64_t n1, int64_t r0, int rb,
                   int8_t* bbuf, int32_t* cbuf, const Decoded* dec = nullptr) {
  if constexpr (RB < 16) {
    if (rb > RB) return rows_dispatch<W, RB + 1>(a, n0, n1, r0, rb, bbuf, cbuf, dec);
  }
  rows_tile<W, RB>(a, n0, n1, r0, bbuf, cbuf, dec);
}

// Strips per decoded chunk: 128 columns, 8 x nb x 576 bytes (74 KB at k = 576, 221 KB at
// k = 1536), so a chunk stays in L2 while every row block reads it.
constexpr int64_t kChunk = 8;

// Decode the strip at column c: its nb B tiles and widened scales into out (Decoded's layout:
// nb x 512 bytes of tiles, then nb x 16 scales, then nb x 16 mins).
template <class W>
Decoded decode_strip(const sp::Q8GemmArgs& a, int64_t c, int nc, int64_t n1, int8_t* out) {
  const int64_t nb = a.x.k / 32;
  const StripRows sr(a, c, nc);
  prefetch_next(a, c, n1);
  float* sa = reinterpret_cast<float*>(out + 512 * nb);
  float* sm = sa + 16 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    btile<W>(sr.row, sr.idx, b, out + 512 * b);
    __m512 va, vm;
    block_scales<W>(sr, b, &va, &vm);
    _mm512_store_ps(sa + 16 * b, va);
    _mm512_store_ps(sm + 16 * b, vm);
  }
  return Decoded{out, sa, sm};
}

template <class W>
void run(const sp::Q8GemmArgs& a, int64_t n0, int64_t n1) {
  alignas(64) int8_t bbuf[2 * 512];
  alignas(64) int32_t cbuf[2 * 16 * 16];
  const int64_t m = a.x.m;
  if (m <= 16) {  // one row block: each block decoded where it is used
    configure(static_cast<int>(m));
    rows_dispatch<W>(a, n0, n1, 0, static_cast<int>(m), bbuf, cbuf);
    _tile_release();
    return;
  }
  // more rows: each chunk of strips decoded once, then every row block against it
  const int64_t nb = a.x.k / 32, bytes = 512 * nb + 2 * 64 * nb;  // per strip, 64-byte multiple
  thread_local std::vector<int8_t> store;
  if (store.size() < static_cast<size_t>(kChunk * bytes + 64)) store.resize(kChunk * bytes + 64);
  int8_t* buf = reinterpret_cast<int8_t*>(
      (reinterpret_cast<uintptr_t>(store.data()) + 63) & ~static_cast<uintptr_t>(63));
  Decoded dec[kChunk];
  int configured = -1;
  for (int64_t c0 = n0; c0 < n1; c0 += 16 * kChunk) {
    const int64_t c1 = n1 - c0 < 16 * kChunk ? n1 : c0 + 16 * kChunk;
    for (int64_t c = c0; c < c1; c += 16) {
      dec[(c - c0) / 16] = decode_strip<W>(a, c, static_cast<int>(c1 - c < 16 ? c1 - c : 16),
                                           n1, buf + bytes * ((c - c0) / 16));
    }
    SP_TILE_MEMORY();
    for (int64_t r0 = 0; r0 < m; r0 += 16) {
      const int rb = static_cast<int>(m - r0 < 16 ? m - r0 : 16);
      if (rb != configured) configure(rb);
      configured = rb;
      rows_dispatch<W>(a, c0, c1, r0, rb, bbuf, cbuf, dec);
    }
  }
  _tile_release();
}

}  // namespace

extern "C" void sp_gemm_q8_amx(const sp::Q8GemmArgs* a, int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
  switch (a->qtype) {
    case sp::Q4_0:
      return run<AQ4_0>(*a, n0, n1);
    case sp::Q4_1:
      return run<AQ4_1>(*a, n0, n1);
    case sp::Q5_0:
      return run<AQ5_0>(*a, n0, n1);
    case sp::Q8_0:
      return run<AQ8_0>(*a, n0, n1);
    default:
      return;
  }
}
