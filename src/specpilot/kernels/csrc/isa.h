// The run-time ISA choice of the op registration units, in one place. The AVX2 kernel units are
// compiled with -mavx2 -mfma -mf16c, so the AVX2 path runs only where the CPU has all three; the
// AVX-512 units (the GEMMs: gemm_avx512.cpp, gemm_q8_avx512.cpp) add AVX-512 F/BW/DQ/VL and VNNI
// and run only where the CPU has those too. Every path gives the same bits (the contracts of
// kernels/__init__.py); ops without an AVX-512 unit (attention, row ops) run their AVX2 path
// under isa 3.
// isa: 0 = auto (the widest the CPU has), 1 = portable, 2 = avx2, 3 = avx512
// (kernels/linear.py ISAS; SPECPILOT_KERNELS_ISA).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace sp {

inline bool cpu_has_avx2() {
#if defined(SP_NO_AVX2)
  return false;
#elif defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

inline bool cpu_has_avx512() {
#if defined(SP_NO_AVX2) || defined(SP_NO_AVX512)  // SP_NO_AVX512: the compiler could not build it
  return false;
#elif defined(__x86_64__) || defined(__i386__)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// The path a call with this isa code runs: 1 portable, 2 avx2, 3 avx512. A bad code, or a
// request for a path the CPU lacks, is a one-line error.
inline int pick_isa(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 3,
              "specpilot: isa must be 0 (auto), 1 (portable), 2 (avx2) or 3 (avx512)");
  if (isa == 0) return cpu_has_avx512() ? 3 : cpu_has_avx2() ? 2 : 1;
  TORCH_CHECK(isa != 2 || cpu_has_avx2(), "specpilot: the AVX2 path is not available here");
  TORCH_CHECK(isa != 3 || cpu_has_avx512(), "specpilot: the AVX-512 path is not available here");
  return static_cast<int>(isa);
}

// Whether a call with this isa code runs an AVX2 (or wider) path.
inline bool use_avx2(int64_t isa) { return pick_isa(isa) >= 2; }

// Whether the CPU runs the path of this isa code (0 and 1: always).
inline bool isa_runs(int64_t isa) {
  return isa == 0 || isa == 1 || (isa == 2 && cpu_has_avx2()) || (isa == 3 && cpu_has_avx512());
}

}  // namespace sp
