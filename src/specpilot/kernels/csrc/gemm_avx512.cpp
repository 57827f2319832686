// AVX-512 build of the fp32-activation GEMM (gemm_avx2.cpp compiled with AVX-512 F/BW/DQ/VL and
// VNNI): the same decoders and the same per-lane fma chains, with 32 vector registers for
// larger register tiles. Bit-identical to the AVX2 and portable paths. Called only after a
// run-time CPU check (isa.h).
#define SP_AVX512 1
#include "gemm_avx2.cpp"
