// AVX-512 VNNI build of the int8-activation GEMM (gemm_q8_avx2.cpp compiled with AVX-512
// F/BW/DQ/VL and VNNI): a block's exact int32 partial sums by _mm256_dpbusd_epi32 instead of
// maddubs + madd, and from sp::kQ8InterleaveRows rows the blocks-across-lanes schedule of
// gemm_q8_vnni.h. Bit-identical to the AVX2 and portable paths (integer sums are exact). Called
// only after a run-time CPU check (isa.h).
#define SP_AVX512 1
#include "gemm_q8_avx2.cpp"
