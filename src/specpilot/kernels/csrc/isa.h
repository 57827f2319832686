// The run-time ISA choice of the op registration units, in one place. The AVX2 kernel units are
// compiled with -mavx2 -mfma -mf16c, so the AVX2 path runs only where the CPU has all three; the
// AVX-512 units (the GEMMs: gemm_avx512.cpp, gemm_q8_avx512.cpp; the attention and its exp:
// attention_avx512.cpp) add AVX-512 F/BW/DQ/VL and VNNI and run only where the CPU has those
// too; the AMX unit (gemm_q8_amx.cpp, the int8 profile's block dot products on AMX-INT8 tiles)
// runs only where the CPU has AMX-INT8 as well and the kernel grants this process the tile
// state. Every path gives the same bits (the contracts of kernels/__init__.py); ops without an
// AVX-512 unit (the row ops) run their AVX2 path under isa 3 and 4, ops without an AMX unit (all
// but the int8 GEMM) their AVX-512 path under 4.
// isa: 0 = auto (the widest the CPU has), 1 = portable, 2 = avx2, 3 = avx512, 4 = amx
// (kernels/linear.py ISAS; SPECPILOT_KERNELS_ISA).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

#if defined(__linux__) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

// AVX-512 (as above) and AMX-INT8 (CPUID leaf 7: AMX-TILE, EDX bit 24; AMX-INT8, bit 25), with
// the tile data state granted to this process by Linux (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, asked once; a kernel that refuses it leaves the AVX-512 path).
inline bool cpu_has_amx() {
#if defined(SP_NO_AVX2) || defined(SP_NO_AVX512) || defined(SP_NO_AMX) || \
    !defined(__linux__) || !(defined(__x86_64__) || defined(__i386__))
  return false;
#else
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!cpu_has_avx512() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (((edx >> 24) & 3u) != 3u) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
#endif
}

// The path a call with this isa code runs: 1 portable, 2 avx2, 3 avx512, 4 amx. A bad code, or
// a request for a path the CPU lacks, is a one-line error.
inline int pick_isa(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 4,
              "specpilot: isa must be 0 (auto), 1 (portable), 2 (avx2), 3 (avx512) or 4 (amx)");
  if (isa == 0) return cpu_has_amx() ? 4 : cpu_has_avx512() ? 3 : cpu_has_avx2() ? 2 : 1;
  TORCH_CHECK(isa != 2 || cpu_has_avx2(), "specpilot: the AVX2 path is not available here");
  TORCH_CHECK(isa != 3 || cpu_has_avx512(), "specpilot: the AVX-512 path is not available here");
  TORCH_CHECK(isa != 4 || cpu_has_amx(), "specpilot: the AMX path is not available here");
  return static_cast<int>(isa);
}

// Whether a call with this isa code runs an AVX2 (or wider) path.
inline bool use_avx2(int64_t isa) { return pick_isa(isa) >= 2; }

// Whether the CPU runs the path of this isa code (0 and 1: always).
inline bool isa_runs(int64_t isa) {
  return isa == 0 || isa == 1 || (isa == 2 && cpu_has_avx2()) ||
         (isa == 3 && cpu_has_avx512()) || (isa == 4 && cpu_has_amx());
}

}  // namespace sp
