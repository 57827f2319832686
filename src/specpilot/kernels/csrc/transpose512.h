// 32-bit word transposes of AVX-512 registers shared by the int8 GEMM's AVX-512 VNNI and AMX
// schedules (include after <immintrin.h>, in a unit compiled with AVX-512 F).
#pragma once

#include <immintrin.h>

namespace sp {

// In each 256-bit half of z[0..7]: out word j of z[t] = word t of the input z[j] (8 x 8).
inline void transpose8x8(__m512i* z) {
  __m512i a[8], b[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  // b[t] (t < 4), per 128-bit lane L: word t + 4 (L % 2) of inputs 0..3; b[t + 4]: of 4..7
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int t = 0; t < 4; ++t) {
    z[t] = _mm512_permutex2var_epi64(b[t], lo, b[t + 4]);
    z[t + 4] = _mm512_permutex2var_epi64(b[t], hi, b[t + 4]);
  }
}

}  // namespace sp
