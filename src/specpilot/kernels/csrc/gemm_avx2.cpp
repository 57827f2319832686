// AVX2 + FMA + F16C GEMM over GGUF blocks, bit-identical to the portable path (gemm_scalar.cpp).
//
// One __m256 accumulator per (row, column) holds the contract's 8 lanes: lane i gets the
// elements k = 8t + i, fused in increasing t with _mm256_fmadd_ps (one rounding, as std::fma);
// reduce8 is the contract's fixed pairwise reduction. Weights are decoded 32 at a time in
// registers (the same fp32 values as formats.h: products of an fp16 scale and a small integer
// are exact in fp32, so a fused d*q+m rounds once, exactly like the reference's d*q then +m).
// A tile is RB rows x CN columns; the tile shape changes only the schedule, never an order.
// Compiled with -mavx2 -mfma -mf16c; called only after a run-time CPU check.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "formats.h"

#if defined(SP_AVX512)
#define SP_GEMM_ENTRY sp_gemm_avx512
#else
#define SP_GEMM_ENTRY sp_gemm_avx2
#endif

namespace {

inline __m256 cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }

// fp16 -> fp32 with F16C: exact, like sp::half_to_float, but branch-free (subnormal scales).
inline float h2f(const uint8_t* p) { return _cvtsh_ss(sp::rd16(p)); }

inline float reduce8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// The 32 nibbles of 16 bytes in element order: low nibbles are 0..15, high nibbles 16..31.
inline void nibbles(const uint8_t* p, __m256i* q) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i m = _mm256_set1_epi32(0x0f);
  q[0] = _mm256_and_si256(lo, m);
  q[1] = _mm256_and_si256(hi, m);
  q[2] = _mm256_srli_epi32(lo, 4);
  q[3] = _mm256_srli_epi32(hi, 4);
}

inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

struct FQ4_0 {
  static constexpr int NV = 4;
  static void load(const uint8_t* row, int64_t s, __m256* w) {
    const uint8_t* b = row + s * 18;
    const __m256 d = _mm256_set1_ps(h2f(b));
    __m256i q[4];
    nibbles(b + 2, q);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int v = 0; v < 4; ++v) w[v] = _mm256_mul_ps(d, cvt(_mm256_sub_epi32(q[v], eight)));
  }
};

struct FQ4_1 {
  static constexpr int NV = 4;
  static void load(const uint8_t* row, int64_t s, __m256* w) {
    const uint8_t* b = row + s * 20;
    const __m256 d = _mm256_set1_ps(h2f(b));
    const __m256 m = _mm256_set1_ps(h2f(b + 2));
    __m256i q[4];
    nibbles(b + 4, q);
    for (int v = 0; v < 4; ++v) w[v] = _mm256_fmadd_ps(d, cvt(q[v]), m);  // d*q exact
  }
};

struct FQ5_0 {
  static constexpr int NV = 4;
  static void load(const uint8_t* row, int64_t s, __m256* w) {
    const uint8_t* b = row + s * 22;
    const __m256 d = _mm256_set1_ps(h2f(b));
    const __m256i qh = _mm256_set1_epi32(static_cast<int>(sp::rd32(b + 2)));
    __m256i q[4];
    nibbles(b + 6, q);
    const __m256i one = _mm256_set1_epi32(1), sixteen = _mm256_set1_epi32(16);
    const __m256i base = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int v = 0; v < 4; ++v) {
      const __m256i sh = _mm256_add_epi32(base, _mm256_set1_epi32(8 * v));
      const __m256i hb = _mm256_and_si256(_mm256_srlv_epi32(qh, sh), one);
      const __m256i qv = _mm256_or_si256(q[v], _mm256_slli_epi32(hb, 4));
      w[v] = _mm256_mul_ps(d, cvt(_mm256_sub_epi32(qv, sixteen)));
    }
  }
};

struct FQ8_0 {
  static constexpr int NV = 4;
  static void load(const uint8_t* row, int64_t s, __m256* w) {
    const uint8_t* b = row + s * 34;
    const __m256 d = _mm256_set1_ps(h2f(b));
    for (int v = 0; v < 4; ++v) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * v));
      w[v] = _mm256_mul_ps(cvt(_mm256_cvtepi8_epi32(raw)), d);
    }
  }
};

struct FQ4_K {
  static constexpr int NV = 4;
  static void load(const uint8_t* row, int64_t s, __m256* w) {
    const uint8_t* b = row + (s / 8) * 144;
    const int j = static_cast<int>(s % 8);
    int sc, mn;
    sp::q4k_scale_min(b + 4, j, &sc, &mn);
    const __m256 dsc = _mm256_set1_ps(h2f(b) * static_cast<float>(sc));
    const __m256 dm = _mm256_set1_ps(h2f(b + 2) * static_cast<float>(mn));
    const uint8_t* q = b + 16 + 32 * (j / 2);
    const __m128i shift = _mm_cvtsi32_si128(4 * (j % 2));
    const __m256i m = _mm256_set1_epi32(0x0f);
    for (int v = 0; v < 4; ++v) {
      const __m256i qv = _mm256_and_si256(_mm256_srl_epi32(bytes8(q + 8 * v), shift), m);
      w[v] = _mm256_fmsub_ps(dsc, cvt(qv), dm);  // dsc*q exact
    }
  }
};

struct FQ6_K {
  static constexpr int NV = 4;
  static void load(const uint8_t* row, int64_t s, __m256* w) {
    const uint8_t* b = row + (s / 8) * 210;
    const int j = static_cast<int>(s % 8), h = j / 4, jj = j % 4;
    const uint8_t* ql = b + 64 * h + 32 * (jj % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const __m128i sl = _mm_cvtsi32_si128(4 * (jj / 2)), sh = _mm_cvtsi32_si128(2 * jj);
    const float d = h2f(b + 208);
    const __m256 ds0 = _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * j])));
    const __m256 ds1 =
        _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * j + 1])));
    const __m256i m4 = _mm256_set1_epi32(0x0f), m2 = _mm256_set1_epi32(3);
    const __m256i off = _mm256_set1_epi32(32);
    for (int v = 0; v < 4; ++v) {
      const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(bytes8(ql + 8 * v), sl), m4);
      const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(bytes8(qh + 8 * v), sh), m2);
      const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), off);
      w[v] = _mm256_mul_ps(v < 2 ? ds0 : ds1, cvt(q));
    }
  }
};

// Dense rows: 8 elements per load; a k % 8 tail is done lane by lane (see tile()).
struct FF32 {
  static constexpr int NV = 1;
  static void load(const uint8_t* row, int64_t s, __m256* w) {
    w[0] = _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 8 * s);
  }
};

struct FF16 {
  static constexpr int NV = 1;
  static void load(const uint8_t* row, int64_t s, __m256* w) {
    w[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * s)));
  }
};

struct FBF16 {
  static constexpr int NV = 1;
  static void load(const uint8_t* row, int64_t s, __m256* w) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * s));
    const __m256i h = _mm256_cvtepu16_epi32(raw);
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
};

// Weight bytes per load step, rounded up (at most 34: one prefetch per step touches every line).
inline int64_t step_bytes(const sp::GemmArgs& a, int64_t steps) {
  return steps > 0 ? (a.row_bytes + steps - 1) / steps : 0;
}

template <class F, int RB, int CN>
void tile(const sp::GemmArgs& a, int64_t r0, int64_t c0) {
  constexpr int E = 8 * F::NV;  // elements per load
  __m256 acc[RB][CN];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CN; ++c) acc[r][c] = _mm256_setzero_ps();
  const uint8_t* wr[CN];
  for (int c = 0; c < CN; ++c) wr[c] = a.w + (c0 + c) * a.row_bytes;
  const float* xr = a.x + r0 * a.k;
  const int64_t steps = a.k / E;
  // software prefetch of the next column tile, as far into it as this one has come (the
  // hardware prefetcher alone leaves a one-row stream over a large weight latency-bound)
  const int64_t bps = step_bytes(a, steps), ahead = CN * a.row_bytes;
  for (int64_t s = 0; s < steps; ++s) {
    for (int c = 0; c < CN; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[c]) + ahead + s * bps, _MM_HINT_T0);
      __m256 w[F::NV];
      F::load(wr[c], s, w);
      for (int v = 0; v < F::NV; ++v) {  // per accumulator still v = 0, 1, ... in order
        const float* x = xr + s * E + 8 * v;
        for (int r = 0; r < RB; ++r)
          acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * a.k), w[v], acc[r][c]);
      }
    }
  }
  const int64_t k_tail = steps * E;
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CN; ++c) {
      __m256 v = acc[r][c];
      if (k_tail < a.k) {  // dense only: lanes k % 8 of the last partial chunk, in increasing k
        alignas(32) float lanes[8];
        float tail[8] = {};
        _mm256_store_ps(lanes, v);
        sp::decode_dense(a.qtype, wr[c], k_tail, static_cast<int>(a.k - k_tail), tail);
        const float* x = xr + r * a.k;
        for (int64_t k = k_tail; k < a.k; ++k)
          lanes[k % 8] = std::fma(x[k], tail[k - k_tail], lanes[k % 8]);
        v = _mm256_load_ps(lanes);
      }
      float y = reduce8(v);
      if (a.bias != nullptr) y = y + a.bias[c0 + c];
      a.y[(r0 + r) * a.n + c0 + c] = y;
    }
  }
}

#if defined(SP_AVX512)
constexpr int kMaxAcc = 24;  // accumulators of one tile or micro-kernel (32 ymm registers)
#else
constexpr int kMaxAcc = 12;  // accumulators of one tile or micro-kernel (16 ymm registers)
#endif

// The next row block of the `left` rows still to do. R is the largest of 8, 4, 3, 2 (else 1)
// with R <= row_tile and R * CN <= kMaxAcc; blocks of R rows, and a remainder in blocks of 3
// (and 2) instead of one short block that is load-bound on few accumulators: with R = 4,
// 5 = 3 + 2, 6 = 3 + 3, 7 = 4 + 3, 9 = 3 + 3 + 3, 10 = 4 + 3 + 3.
template <int CN>
int pick_rows(int row_tile, int64_t left) {
  int R = 1;
  for (int rb : {8, 4, 3, 2}) {
    if (rb <= row_tile && rb * CN <= kMaxAcc) {
      R = rb;
      break;
    }
  }
  if (R == 8 && left >= 8) return 8;
  if (R >= 4) {
    if (left <= 4) return static_cast<int>(left);
    if (left == 5) return 3;
    const int64_t r = left % 4;
    return r == 0 || r == 3 ? 4 : 3;
  }
  if (R == 3) return left <= 3 ? static_cast<int>(left) : (left == 4 ? 2 : 3);
  return left >= 2 && R >= 2 ? 2 : 1;
}

template <class F, int CN>
void tile_rows(int rb, const sp::GemmArgs& a, int64_t r0, int64_t c0) {
  if constexpr (8 * CN <= kMaxAcc) {
    if (rb == 8) return tile<F, 8, CN>(a, r0, c0);
  }
  if constexpr (4 * CN <= kMaxAcc) {
    if (rb == 4) return tile<F, 4, CN>(a, r0, c0);
  }
  if constexpr (3 * CN <= kMaxAcc) {
    if (rb == 3) return tile<F, 3, CN>(a, r0, c0);
  }
  if (rb == 2) return tile<F, 2, CN>(a, r0, c0);
  tile<F, 1, CN>(a, r0, c0);
}

// All rows of the column tile [c0, c0 + CN), in the row blocks of pick_rows: each block
// decodes the weights once in registers.
template <class F, int CN>
void column_tile(const sp::GemmArgs& a, int64_t c0, int row_tile) {
  for (int64_t r0 = 0; r0 < a.m;) {
    const int rb = pick_rows<CN>(row_tile, a.m - r0);
    tile_rows<F, CN>(rb, a, r0, c0);
    r0 += rb;
  }
}

// ---- many rows: each weight decoded once per call into a thread-local panel -----------------
//
// A panel of columns is decoded with F::load (the same fp32 values as the direct path) into
// 32-byte-aligned scratch, kp = k rounded up to 8 floats per column; then a register-blocked
// micro-kernel of RB rows x CN columns runs over all rows, x and w loaded from cache. Each
// accumulator is still one fma chain per lane in increasing k, so the bits equal the direct path.

constexpr int64_t kPanelBytes = 24576;  // decoded panel per thread (L1-resident for k = 576)
constexpr int64_t kPrefetchBytes = 2048;  // software prefetch distance of the panel decode

struct Scratch {
  float* p = nullptr;
  size_t cap = 0;
  ~Scratch() { std::free(p); }
  float* get(size_t floats) {
    if (floats > cap) {
      std::free(p);
      cap = (floats + 15) / 16 * 16;
      p = static_cast<float*>(std::aligned_alloc(64, cap * sizeof(float)));
    }
    return p;
  }
};

thread_local Scratch tls_panel;

inline int64_t padded_k(int64_t k) { return (k + 7) / 8 * 8; }

// Column `col` of the weight, decoded to dst[0, k) (the dense k % 8 tail by decode_dense).
template <class F>
void decode_column(const sp::GemmArgs& a, int64_t col, float* dst) {
  constexpr int E = 8 * F::NV;
  const uint8_t* row = a.w + col * a.row_bytes;
  const int64_t steps = a.k / E;
  const char* next = reinterpret_cast<const char*>(row) + kPrefetchBytes;  // the columns after
  const int64_t bps = step_bytes(a, steps);
  for (int64_t s = 0; s < steps; ++s) {
    _mm_prefetch(next + s * bps, _MM_HINT_T0);
    __m256 w[F::NV];
    F::load(row, s, w);
    for (int v = 0; v < F::NV; ++v) _mm256_store_ps(dst + s * E + 8 * v, w[v]);
  }
  if (steps * E < a.k)
    sp::decode_dense(a.qtype, row, steps * E, static_cast<int>(a.k - steps * E), dst + steps * E);
}

// Rows [r0, r0 + RB) x columns [c0, c0 + CN) from the decoded columns w (stride kp).
template <int RB, int CN>
void micro(const sp::GemmArgs& a, int64_t r0, int64_t c0, const float* w, int64_t kp) {
  __m256 acc[RB][CN];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CN; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* x = a.x + r0 * a.k;
  const int64_t k8 = a.k / 8;
  for (int64_t s = 0; s < k8; ++s) {
    __m256 wv[CN];
    for (int c = 0; c < CN; ++c) wv[c] = _mm256_load_ps(w + c * kp + 8 * s);
    for (int r = 0; r < RB; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * a.k + 8 * s);
      for (int c = 0; c < CN; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  const int64_t k_tail = k8 * 8;
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CN; ++c) {
      __m256 v = acc[r][c];
      if (k_tail < a.k) {  // dense only: lanes k % 8 of the last partial chunk, in increasing k
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, v);
        const float* xr = x + r * a.k;
        for (int64_t k = k_tail; k < a.k; ++k)
          lanes[k % 8] = std::fma(xr[k], w[c * kp + k], lanes[k % 8]);
        v = _mm256_load_ps(lanes);
      }
      float y = reduce8(v);
      if (a.bias != nullptr) y = y + a.bias[c0 + c];
      a.y[(r0 + r) * a.n + c0 + c] = y;
    }
  }
}

template <int CN>
void micro_rows(int rb, const sp::GemmArgs& a, int64_t r0, int64_t c0, const float* w,
                int64_t kp) {
  if constexpr (8 * CN <= kMaxAcc) {
    if (rb == 8) return micro<8, CN>(a, r0, c0, w, kp);
  }
  if constexpr (4 * CN <= kMaxAcc) {
    if (rb == 4) return micro<4, CN>(a, r0, c0, w, kp);
  }
  if constexpr (3 * CN <= kMaxAcc) {
    if (rb == 3) return micro<3, CN>(a, r0, c0, w, kp);
  }
  if (rb == 2) return micro<2, CN>(a, r0, c0, w, kp);
  micro<1, CN>(a, r0, c0, w, kp);
}

// Columns [c0, c0 + g * CN): decode them once, then every row block over every column group
// (the x rows of one block stay in L1 across the groups).
template <class F, int CN>
void panel(const sp::GemmArgs& a, int64_t c0, int64_t g, int row_tile, float* buf) {
  const int64_t kp = padded_k(a.k);
  for (int64_t c = 0; c < g * CN; ++c) decode_column<F>(a, c0 + c, buf + c * kp);
  int64_t r0 = 0;
  while (r0 < a.m) {
    const int rb = pick_rows<CN>(row_tile, a.m - r0);
    for (int64_t j = 0; j < g; ++j) micro_rows<CN>(rb, a, r0, c0 + j * CN, buf + j * CN * kp, kp);
    r0 += rb;
  }
}

template <class F, int CN>
int64_t run_panels(const sp::GemmArgs& a, int64_t n0, int64_t n1, int row_tile) {
  const int64_t kp = padded_k(a.k);
  const int64_t groups = std::max<int64_t>(1, kPanelBytes / (CN * kp * 4));
  float* buf = tls_panel.get(static_cast<size_t>(groups * CN * kp));
  int64_t c = n0;
  while (c + CN <= n1) {
    const int64_t g = std::min<int64_t>(groups, (n1 - c) / CN);
    panel<F, CN>(a, c, g, row_tile, buf);
    c += g * CN;
  }
  return c;
}

template <class F>
void run_multi(const sp::GemmArgs& a, int64_t n0, int64_t n1, int row_tile, int col_tile) {
  int64_t c = n0;
  if (col_tile >= 4) {
    c = run_panels<F, 4>(a, c, n1, row_tile);
  } else if (col_tile == 3) {
    c = run_panels<F, 3>(a, c, n1, row_tile);
  } else if (col_tile == 2) {
    c = run_panels<F, 2>(a, c, n1, row_tile);
  }
  if (c < n1) run_panels<F, 1>(a, c, n1, row_tile);
}

#if defined(SP_AVX512)
// ---- AVX-512 panels: two columns per 512-bit accumulator -------------------------------------
//
// A panel holds column pairs: for pair (c, c + 1) and chunk s (elements 8s..8s+7), 16 floats,
// column c's 8 in the low half and column c + 1's in the high half. One zmm accumulator is then
// the contract's 8 lanes of two (row, column) outputs side by side: x's 8 elements of row r are
// broadcast to both halves, so each half is still lane i += x[8s + i] * w[8s + i] by one fma in
// increasing s, exactly the ymm chain. Needs k % 8 == 0 (no dense tail); the halves are reduced
// by reduce8 each.

constexpr int kMaxAcc512 = 24;  // zmm accumulators of one micro-kernel (of 32 registers)

// Columns col, col + 1 decoded into the pair layout at dst (2 * k floats).
template <class F>
void decode_pair(const sp::GemmArgs& a, int64_t col, float* dst) {
  constexpr int E = 8 * F::NV;
  const uint8_t* r0 = a.w + col * a.row_bytes;
  const uint8_t* r1 = r0 + a.row_bytes;
  const int64_t steps = a.k / E;
  const char* next = reinterpret_cast<const char*>(r0) + kPrefetchBytes;
  const int64_t bps = step_bytes(a, steps);
  for (int64_t s = 0; s < steps; ++s) {
    _mm_prefetch(next + s * bps, _MM_HINT_T0);
    _mm_prefetch(next + a.row_bytes + s * bps, _MM_HINT_T0);
    __m256 w0[F::NV], w1[F::NV];
    F::load(r0, s, w0);
    F::load(r1, s, w1);
    for (int v = 0; v < F::NV; ++v) {
      const __m512 both = _mm512_insertf32x8(_mm512_castps256_ps512(w0[v]), w1[v], 1);
      _mm512_store_ps(dst + 2 * (s * E + 8 * v), both);
    }
  }
}

// Rows [r0, r0 + RB) x column pairs from c0: each half of acc[r][c] reduced as one ymm chain,
// the low half column c0 + 2c, the high half c0 + 2c + 1, then the bias.
template <int RB, int CP>
void store_pairs(const sp::GemmArgs& a, int64_t r0, int64_t c0, const __m512 (&acc)[RB][CP]) {
  for (int r = 0; r < RB; ++r) {
    float* y = a.y + (r0 + r) * a.n + c0;
    for (int c = 0; c < CP; ++c) {
      float lo = reduce8(_mm512_castps512_ps256(acc[r][c]));
      float hi = reduce8(_mm512_extractf32x8_ps(acc[r][c], 1));
      if (a.bias != nullptr) {
        lo = lo + a.bias[c0 + 2 * c];
        hi = hi + a.bias[c0 + 2 * c + 1];
      }
      y[2 * c] = lo;
      y[2 * c + 1] = hi;
    }
  }
}

// Rows [r0, r0 + RB) x column pairs [c0, c0 + 2 CP) from the pair panel w (2 k floats a pair).
template <int RB, int CP>
void micro512(const sp::GemmArgs& a, int64_t r0, int64_t c0, const float* w) {
  __m512 acc[RB][CP];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CP; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* x = a.x + r0 * a.k;
  const int64_t k8 = a.k / 8, kp2 = 2 * a.k;
  for (int64_t s = 0; s < k8; ++s) {
    __m512 wv[CP];
    for (int c = 0; c < CP; ++c) wv[c] = _mm512_load_ps(w + c * kp2 + 16 * s);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * a.k + 8 * s));
      for (int c = 0; c < CP; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  store_pairs<RB, CP>(a, r0, c0, acc);
}

template <int CP>
void micro512_rows(int rb, const sp::GemmArgs& a, int64_t r0, int64_t c0, const float* w) {
  if constexpr (8 * CP <= kMaxAcc512) {
    if (rb == 8) return micro512<8, CP>(a, r0, c0, w);
  }
  if (rb == 4) return micro512<4, CP>(a, r0, c0, w);
  if (rb == 3) return micro512<3, CP>(a, r0, c0, w);
  if (rb == 2) return micro512<2, CP>(a, r0, c0, w);
  micro512<1, CP>(a, r0, c0, w);
}

// The next row block: 8 while 8 are left (row_tile 8), else pick_rows' blocks of at most 4.
inline int pick_rows512(int row_tile, int64_t left) {
  if (row_tile >= 8 && left >= 8) return 8;
  return pick_rows<3>(std::min(row_tile, 4), left);
}

// Columns [c, c + 2 CP g) decoded once as g groups of CP pairs, then every row block over them.
template <class F, int CP>
int64_t run_panels512(const sp::GemmArgs& a, int64_t c, int64_t n1, int row_tile) {
  const int64_t kp2 = 2 * a.k;
  const int64_t groups = std::max<int64_t>(1, kPanelBytes / (CP * kp2 * 4));
  float* buf = tls_panel.get(static_cast<size_t>(groups * CP * kp2));
  while (c + 2 * CP <= n1) {
    const int64_t g = std::min<int64_t>(groups, (n1 - c) / (2 * CP));
    for (int64_t p = 0; p < g * CP; ++p) decode_pair<F>(a, c + 2 * p, buf + p * kp2);
    for (int64_t r0 = 0; r0 < a.m;) {
      const int rb = pick_rows512(row_tile, a.m - r0);
      for (int64_t j = 0; j < g; ++j) micro512_rows<CP>(rb, a, r0, c + 2 * CP * j, buf + j * CP * kp2);
      r0 += rb;
    }
    c += 2 * CP * g;
  }
  return c;
}

// The pair panels for as many columns as pairs cover (CP = col_tile pairs, at most 3), a last
// odd column by the ymm panels.
template <class F>
void run_multi512(const sp::GemmArgs& a, int64_t n0, int64_t n1, int row_tile, int col_tile) {
  int64_t c = n0;
  if (col_tile >= 3) c = run_panels512<F, 3>(a, c, n1, row_tile);
  if (col_tile >= 2) c = run_panels512<F, 2>(a, c, n1, row_tile);
  c = run_panels512<F, 1>(a, c, n1, row_tile);
  if (c < n1) run_panels<F, 1>(a, c, n1, std::min(row_tile, 4));
}

// ---- AVX-512 register tiles for few rows: two columns decoded side by side ------------------
//
// Pair<F>::load2 decodes block s of two weight rows into 512-bit vectors: chunk v of column c in
// the low half and of column c + 1 in the high half, each half exactly F::load's ymm (the same
// integer unpacking and the same one-rounding float ops on the same values). A tile of RB rows
// x CP column pairs then runs the ymm tile's fma chains two columns at a time.

template <class F>
struct Pair {
  static constexpr bool kHas = false;
};

// An fp16 scale of each column, broadcast over its half.
inline __m512 scale2(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_insertf32x8(_mm512_set1_ps(h2f(p0)), _mm256_set1_ps(h2f(p1)), 1);
}

// 8 bytes of each column (p0, p1) widened to 16 dwords: p0's in the low half.
inline __m512i bytes2(const uint8_t* p0, const uint8_t* p1) {
  const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)));
  return _mm512_cvtepu8_epi32(b);
}

// The nibble chunks of two 16-byte quant fields, as nibbles() per half.
inline void nibbles2(const uint8_t* p0, const uint8_t* p1, __m512i* q) {
  const __m512i lo = bytes2(p0, p1), hi = bytes2(p0 + 8, p1 + 8);
  const __m512i m = _mm512_set1_epi32(0x0f);
  q[0] = _mm512_and_si512(lo, m);
  q[1] = _mm512_and_si512(hi, m);
  q[2] = _mm512_srli_epi32(lo, 4);
  q[3] = _mm512_srli_epi32(hi, 4);
}

template <>
struct Pair<FQ4_0> {
  static constexpr bool kHas = true;
  static void load2(const uint8_t* r0, const uint8_t* r1, int64_t s, __m512* w) {
    const uint8_t *b0 = r0 + s * 18, *b1 = r1 + s * 18;
    const __m512 d = scale2(b0, b1);
    __m512i q[4];
    nibbles2(b0 + 2, b1 + 2, q);
    const __m512i eight = _mm512_set1_epi32(8);
    for (int v = 0; v < 4; ++v)
      w[v] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(q[v], eight)));
  }
};

template <>
struct Pair<FQ4_1> {
  static constexpr bool kHas = true;
  static void load2(const uint8_t* r0, const uint8_t* r1, int64_t s, __m512* w) {
    const uint8_t *b0 = r0 + s * 20, *b1 = r1 + s * 20;
    const __m512 d = scale2(b0, b1), m = scale2(b0 + 2, b1 + 2);
    __m512i q[4];
    nibbles2(b0 + 4, b1 + 4, q);
    for (int v = 0; v < 4; ++v) w[v] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q[v]), m);
  }
};

template <>
struct Pair<FQ8_0> {
  static constexpr bool kHas = true;
  static void load2(const uint8_t* r0, const uint8_t* r1, int64_t s, __m512* w) {
    const uint8_t *b0 = r0 + s * 34, *b1 = r1 + s * 34;
    const __m512 d = scale2(b0, b1);
    for (int v = 0; v < 4; ++v) {
      const __m128i raw =
          _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b0 + 2 + 8 * v)),
                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b1 + 2 + 8 * v)));
      w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), d);
    }
  }
};

// Rows [r0, r0 + RB) x column pairs [c0, c0 + 2 CP), weights decoded in registers.
template <class F, int RB, int CP>
void tile512(const sp::GemmArgs& a, int64_t r0, int64_t c0) {
  __m512 acc[RB][CP];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CP; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint8_t* wr[2 * CP];
  for (int c = 0; c < 2 * CP; ++c) wr[c] = a.w + (c0 + c) * a.row_bytes;
  const float* xr = a.x + r0 * a.k;
  const int64_t steps = a.k / 32;
  const int64_t bps = step_bytes(a, steps), ahead = 2 * CP * a.row_bytes;
  for (int64_t s = 0; s < steps; ++s) {
    for (int c = 0; c < CP; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[2 * c]) + ahead + s * bps, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wr[2 * c + 1]) + ahead + s * bps, _MM_HINT_T0);
      __m512 w[4];
      Pair<F>::load2(wr[2 * c], wr[2 * c + 1], s, w);
      for (int v = 0; v < 4; ++v) {
        const float* x = xr + s * 32 + 8 * v;
        for (int r = 0; r < RB; ++r) {
          const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * a.k));
          acc[r][c] = _mm512_fmadd_ps(xv, w[v], acc[r][c]);
        }
      }
    }
  }
  store_pairs<RB, CP>(a, r0, c0, acc);
}

template <class F, int CP>
void tile512_rows(int rb, const sp::GemmArgs& a, int64_t r0, int64_t c0) {
  if constexpr (CP <= 2) {
    if (rb == 8) return tile512<F, 8, CP>(a, r0, c0);
    if (rb == 7) return tile512<F, 7, CP>(a, r0, c0);
    if (rb == 6) return tile512<F, 6, CP>(a, r0, c0);
    if (rb == 5) return tile512<F, 5, CP>(a, r0, c0);
  }
  if constexpr (4 * CP <= 16) {
    if (rb == 4) return tile512<F, 4, CP>(a, r0, c0);
    if (rb == 3) return tile512<F, 3, CP>(a, r0, c0);
  }
  if (rb == 2) return tile512<F, 2, CP>(a, r0, c0);
  tile512<F, 1, CP>(a, r0, c0);
}

// All rows of the columns [c, c + 2 CP k) for as many k as fit below n1; returns the next column.
template <class F, int CP>
int64_t pair_columns(const sp::GemmArgs& a, int64_t c, int64_t n1, int row_tile) {
  for (; c + 2 * CP <= n1; c += 2 * CP) {
    constexpr int kMost = CP <= 2 ? 8 : 4;
    for (int64_t r0 = 0; r0 < a.m;) {
      const int rb = static_cast<int>(std::min<int64_t>(std::min(row_tile, kMost), a.m - r0));
      tile512_rows<F, CP>(rb, a, r0, c);
      r0 += rb;
    }
  }
  return c;
}

// Up to 8 rows of a type with a pair decoder: col_tile pairs per tile (4 pairs up to 2 rows, 3 up
// to 4 rows, 2 up to 6 rows, then 1: at most 16 zmm accumulators, each block decoded once for
// up to 8 rows instead of once per 4-row tile), then smaller pair tiles, a last odd column by
// the ymm tile.
template <class F>
void run_direct512(const sp::GemmArgs& a, int64_t n0, int64_t n1, int row_tile, int col_tile) {
  int64_t c = n0;
  const int rows = static_cast<int>(std::min<int64_t>(row_tile, a.m));
  if (col_tile >= 4 && rows <= 2) c = pair_columns<F, 4>(a, c, n1, row_tile);
  if (col_tile >= 3 && rows <= 4) c = pair_columns<F, 3>(a, c, n1, row_tile);
  if (col_tile >= 2 && rows <= 6) c = pair_columns<F, 2>(a, c, n1, row_tile);
  c = pair_columns<F, 1>(a, c, n1, row_tile);
  for (; c < n1; ++c) column_tile<F, 1>(a, c, row_tile);
}
#endif


// Rows from which a call decodes panels. A 32-element block type (one scale, one load per 8
// weights) decodes cheaply in registers, so its 4-row calls stay direct (one 4 x CN tile, no
// panel stores and reloads: informally 5-11% faster on Gemma 3's Q5_0 / Q8_0 linears and its
// Q8_0 head); a K-quant (6-bit scale unpacking per 32 weights) is faster from panels at 4 rows.
// With AVX-512 the types with a pair decoder (Q4_0, Q4_1, Q8_0) stay direct up to 8 rows (their
// 5- to 8-row tiles: bench/step_cost.py, BENCHMARKS.md).
inline int64_t panel_rows(int qtype) {
  const bool cheap = qtype == sp::Q4_0 || qtype == sp::Q4_1 || qtype == sp::Q5_0 ||
                     qtype == sp::Q8_0;
  return cheap ? sp::kPanelRows + 1 : sp::kPanelRows;
}

template <class F>
void run(const sp::GemmArgs& a, int64_t n0, int64_t n1, int row_tile, int col_tile) {
#if defined(SP_AVX512)
  if constexpr (Pair<F>::kHas) {
    if (a.m <= 8) return run_direct512<F>(a, n0, n1, row_tile, col_tile);
  }
  if (a.m >= panel_rows(a.qtype) && a.k % 8 == 0)
    return run_multi512<F>(a, n0, n1, row_tile, col_tile);
#endif
  if (a.m >= panel_rows(a.qtype)) return run_multi<F>(a, n0, n1, row_tile, col_tile);
  int64_t c = n0;
  if (col_tile >= 4) {
    for (; c + 4 <= n1; c += 4) column_tile<F, 4>(a, c, row_tile);
  } else if (col_tile == 3) {
    for (; c + 3 <= n1; c += 3) column_tile<F, 3>(a, c, row_tile);
  } else if (col_tile == 2) {
    for (; c + 2 <= n1; c += 2) column_tile<F, 2>(a, c, row_tile);
  }
  for (; c < n1; ++c) column_tile<F, 1>(a, c, row_tile);
}

}  // namespace

extern "C" void SP_GEMM_ENTRY(const sp::GemmArgs* a, int64_t n0, int64_t n1, int row_tile,
                              int col_tile) {
  switch (a->qtype) {
    case sp::Q4_0: return run<FQ4_0>(*a, n0, n1, row_tile, col_tile);
    case sp::Q4_1: return run<FQ4_1>(*a, n0, n1, row_tile, col_tile);
    case sp::Q5_0: return run<FQ5_0>(*a, n0, n1, row_tile, col_tile);
    case sp::Q8_0: return run<FQ8_0>(*a, n0, n1, row_tile, col_tile);
    case sp::Q4_K: return run<FQ4_K>(*a, n0, n1, row_tile, col_tile);
    case sp::Q6_K: return run<FQ6_K>(*a, n0, n1, row_tile, col_tile);
    case sp::F32: return run<FF32>(*a, n0, n1, row_tile, col_tile);
    case sp::F16: return run<FF16>(*a, n0, n1, row_tile, col_tile);
    case sp::BF16: return run<FBF16>(*a, n0, n1, row_tile, col_tile);
    default: return;
  }
}

#if !defined(SP_AVX512)
extern "C" int sp_avx2_compiled(void) { return 1; }
#endif
