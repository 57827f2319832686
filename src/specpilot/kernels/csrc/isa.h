// The run-time ISA choice of the op registration units, in one place. The AVX2 kernel units are
// compiled with -mavx2 -mfma -mf16c, so the AVX2 path runs only where the CPU has all three.
// isa: 0 = auto, 1 = portable, 2 = avx2 (kernels/linear.py ISAS; SPECPILOT_KERNELS_ISA).
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

// Whether a call with this isa code runs the AVX2 path; a bad code or an AVX2 request on a CPU
// without it is a one-line error.
inline bool use_avx2(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 2, "specpilot: isa must be 0 (auto), 1 (portable) or 2 (avx2)");
  const bool avx2 = isa == 2 || (isa == 0 && cpu_has_avx2());
  TORCH_CHECK(!avx2 || cpu_has_avx2(), "specpilot: the AVX2 path is not available here");
  return avx2;
}

}  // namespace sp
