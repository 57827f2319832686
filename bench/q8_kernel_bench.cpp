// Single-thread timing of the int8 GEMM's packed AVX-512 schedule on random blocks, with a hash
// of the output bits (two builds of the same contract must print the same hash). Built and run
// by bench/q8_kernel_ab.py; not part of the package.
//
//   q8_kernel_bench K N ROWS COPIES QTYPE   (QTYPE 41: Q4_1, 80: Q8_0; COPIES > 1: that many
//                                            weight tensors in turn, so the weights come from
//                                            farther than the L2)
#include "gemm_q8_avx512.cpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: q8_kernel_bench K N ROWS COPIES QTYPE(41|80)\n");
    return 2;
  }
  const int64_t k = std::atoll(argv[1]), n = std::atoll(argv[2]), m = std::atoll(argv[3]);
  const int copies = std::atoi(argv[4]);
  const bool q8 = std::atoi(argv[5]) == 80;
  const int64_t nb = k / 32, row_bytes = nb * (q8 ? 34 : 20), xs = (nb + 7) / 8 * 256;
  std::mt19937 rng(1);
  std::vector<std::vector<uint8_t>> ws(copies, std::vector<uint8_t>(n * row_bytes));
  for (auto& w : ws) {
    for (auto& b : w) b = static_cast<uint8_t>(rng());
    // Every odd byte is some fp16's high byte in the packed layout, or a weight byte: clearing
    // the exponent's top bit keeps every scale finite (the timing does not depend on values).
    for (size_t i = 1; i < w.size(); i += 2) w[i] &= 0xbf;
  }
  std::vector<int8_t> qt(m * xs), q(m * k);
  for (auto& v : qt) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  std::vector<float> d(m * nb), s(m * nb), y(m * n);
  for (auto& v : d) v = 0.01f * static_cast<float>(rng() % 100 + 1);
  for (auto& v : s) v = 0.1f * static_cast<float>(static_cast<int>(rng() % 200) - 100);
  std::vector<int32_t> qsum(m * nb, 5);
  sp::Q8GemmArgs a{};
  a.qtype = (q8 ? sp::Q8_0 : sp::Q4_1) | sp::kQ8Packed;
  a.x = sp::Q8Rows{q.data(), d.data(), s.data(), m, k, qsum.data(), qt.data()};
  a.row_bytes = row_bytes;
  a.y = y.data();
  a.n = n;
  const int col_tile = m <= 16 ? 64 : 8;  // ops_q8.cpp's default_col_tile for packed weights
  const double work = static_cast<double>(n) * row_bytes * m;
  const int iters = static_cast<int>(std::max(20.0, 2e9 / std::max(work, 1.0)));
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) {
      a.w = ws[i % copies].data();
      a.w_end = a.w + n * row_bytes;
      sp_gemm_q8_avx512(&a, 0, n, 16, col_tile);
    }
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, t / iters);
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the output's bits
  for (float f : y) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    h = (h ^ u) * 1099511628211ull;
  }
  std::printf("%.3f %016llx\n", best * 1e6, static_cast<unsigned long long>(h));
  return 0;
}
