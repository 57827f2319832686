// Torch custom ops of the int8-activation profile (added to the `specpilot` library).
//
// q8_quantize(x) -> (q int8 (m, k), d fp32 (m, k/32), s fp32 (m, k/32)): the activation rows
// in Q8 blocks (gemm_q8.h). gguf_matmul_q8(x, ...): quantizes x, then y = x_q8 . W^T + b over
// the weight blocks; threads split the output columns only (at::parallel_for over n), k is never
// split, so neither the thread count nor the tile shape changes a column's order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <tuple>
#include <vector>

#include "gemm_q8.h"
#include "isa.h"
#include "ops_api.h"

namespace {

// The weight stream's software prefetch distance, in columns, of every int8 GEMM call of the
// process (0: each schedule's own: 8 columns in GGUF order, 8 column pairs packed). Set by
// q8_prefetch (the kernel_prefetch mechanism); a schedule choice, never a bit of the output.
std::atomic<int64_t> g_ahead{0};

// Q8 blocks of m rows of k floats, by the AVX2 path where it runs (the same bits; qsum, the
// integer block sums, only there).
void quantize(bool avx2, const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s,
              int32_t* qsum = nullptr) {
#if !defined(SP_NO_AVX2)
  if (avx2) return sp_q8_quantize_avx2(x, m, k, q, d, s, qsum);
#endif
  sp_q8_quantize(x, m, k, q, d, s);
}

// The default column tile of an m-row call with row tiles of rt rows: 8 columns keep a column
// tile's weights in L1 for the next row tile; a call of one row tile on packed weights reads each
// weight once anyway, and tiles of 64 save the per-tile work (SmolLM2's layers 2-6% faster at 1
// row, 1-7% at 2-8 rows, on a 2-core EPYC Zen 4, alternating in one process: BENCHMARKS.md,
// fifth session of 2026-12-07).
int default_col_tile(int64_t m, int rt, bool packed) { return packed && m <= rt ? 64 : 8; }

// The path that runs m rows of qt's k-wide weights: the AMX path leaves the calls its schedule
// does not repay (sp::q8_amx_runs) to the AVX-512 path (the same bits).
// Packed weights (sp::kQ8Packed) run the AVX-512 path only.
int q8_path(int path, int qt, int64_t m, int64_t k) {
  if (sp::q8_packed(qt)) {
    TORCH_CHECK(path >= 3, "specpilot: packed int8 weights run on the AVX-512 path only; unpack "
                           "them (set the linear's numerics profile again) for another path");
    return 3;
  }
  return path == 4 && !sp::q8_amx_runs(qt, m, k) ? 3 : path;
}

// Bytes of one k-wide weight row of type qt (packed or not: the same bytes).
int64_t q8_row_bytes(int qt, int64_t k) {
  const int base = sp::q8_base_type(qt);
  return k / sp::block_elems(base) * sp::block_bytes(base);
}

// Whether the kernel of path (q8_path) runs qt's weights as unsigned integers w + o, taking
// o * sum(q) off each block's dot product: the AVX2 path's Q4_0 and Q5_0, the AVX-512 path's
// Q8_0 too.
bool needs_sums(int path, int qt) {
  qt = sp::q8_base_type(qt);
  return (path >= 2 && path <= 3 && (qt == sp::Q4_0 || qt == sp::Q5_0)) ||
         (path == 3 && qt == sp::Q8_0);
}

// Whether the kernel of path (q8_path) runs qt's weights by the blocks-across-lanes schedule
// from sp::kQ8InterleaveRows rows (it reads the interleaved activations): every type on the
// AVX-512 path, Q4_0 and Q4_1 on the AVX2 path (the AMX schedule reads the rows as they are).
bool reads_interleaved(int path, int qt) {
  qt = sp::q8_base_type(qt);
  return path == 3 || (path == 2 && (qt == sp::Q4_0 || qt == sp::Q4_1));
}

// One thread's columns [n0, n1) of a by the kernel of path (q8_path).
void run_q8(const sp::Q8GemmArgs& a, int path, int64_t n0, int64_t n1, int rt, int ct) {
  if (path >= 2) {
#if !defined(SP_NO_AVX2)
#if !defined(SP_NO_AVX512)
#if !defined(SP_NO_AMX)
    if (path == 4) return sp_gemm_q8_amx(&a, n0, n1);
#endif
    if (path == 3) return sp_gemm_q8_avx512(&a, n0, n1, rt, ct);
#endif
    sp_gemm_q8_avx2(&a, n0, n1, rt, ct);
#endif
  } else {
    sp_gemm_q8_scalar(&a, n0, n1);
  }
}

// A buffer of at least n elements in the calling thread's scratch slot `slot`, reused by every
// call on that thread (a call's activations live until it returns; calls on one thread do not
// nest): a decode step makes ~120 GEMM calls, each of which would otherwise allocate and free
// four small buffers. A slot keeps the largest size any call on the thread asked for (a long
// prefill's m x k bytes of int8, twice, until the thread exits).
template <class T>
T* scratch(int slot, int64_t n) {
  thread_local std::array<std::unique_ptr<uint8_t[]>, 4> bufs;
  thread_local std::array<size_t, 4> sizes{};
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T);
  if (sizes[slot] < bytes) {
    bufs[slot].reset(new uint8_t[bytes]);
    sizes[slot] = bytes;
  }
  return reinterpret_cast<T*>(bufs[slot].get());
}

// The Q8 blocks of x (m, k) for the kernel of path, in the calling thread's scratch (every
// element written by the quantization); with sums, the integer block sums; with interleaved,
// from sp::kQ8InterleaveRows rows (from `from` rows where given: packed weights read it at any
// m), the interleaved copy of q the lanes schedules read (sp_q8_interleave).
class Activations {
 public:
  Activations(const at::Tensor& x, int path, bool sums, bool interleaved, int64_t from = 0)
      : m_(x.size(0)), k_(x.size(1)), nb_(k_ / 32),
        q_(scratch<int8_t>(0, m_ * k_)),
        ds_(scratch<float>(1, 2 * m_ * nb_)),
        qsum_(sums ? scratch<int32_t>(2, m_ * nb_) : nullptr) {
    quantize(path >= 2, x.data_ptr<float>(), m_, k_, q_, ds_, ds_ + m_ * nb_, qsum_);
    if (interleaved && m_ >= (from > 0 ? from : sp::kQ8InterleaveRows)) {
      qt_ = scratch<int8_t>(3, m_ * ((nb_ + 7) / 8) * 256);
      sp_q8_interleave(q_, m_, k_, qt_);
    }
  }
  Activations(const Activations&) = delete;
  Activations& operator=(const Activations&) = delete;
  sp::Q8Rows rows() const { return {q_, ds_, ds_ + m_ * nb_, m_, k_, qsum_, qt_}; }

 private:
  int64_t m_, k_, nb_;
  int8_t* q_;
  float* ds_;
  int32_t* qsum_;
  int8_t* qt_ = nullptr;
};

void check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.size(1) == k,
              "specpilot: x must be a CPU float32 tensor of shape (m, ", k, ")");
  TORCH_CHECK(k > 0 && k % 32 == 0, "specpilot: k=", k, " is not a multiple of 32");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> q8_quantize(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2, "specpilot: x must be 2-D");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  check_x(x, k);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, k / 32}, x.options());
  at::Tensor s = at::empty({m, k / 32}, x.options());
  if (m > 0) {
    quantize(sp::use_avx2(0), x.data_ptr<float>(), m, k, q.data_ptr<int8_t>(),
             d.data_ptr<float>(), s.data_ptr<float>());
  }
  return {q, d, s};
}

}  // namespace

namespace sp_ops {

at::Tensor gguf_matmul_q8(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype,
                          int64_t n, int64_t k, const c10::optional<at::Tensor>& bias,
                          int64_t isa, int64_t row_tile, int64_t col_tile) {
  const int qt = static_cast<int>(qtype);
  TORCH_CHECK(sp::q8_supported(qt), "specpilot: GGUF type ", qtype, " has no int8 kernel");
  const at::Tensor x = x_in.contiguous();
  check_x(x, k);
  TORCH_CHECK(n > 0, "specpilot: n must be positive");
  const int64_t rb = q8_row_bytes(qt, k);
  TORCH_CHECK(!sp::q8_packed(qt) || n % 2 == 0, "specpilot: packed weights need an even n");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous() && blocks.numel() == n * rb,
              "specpilot: blocks must be a contiguous CPU uint8 tensor of ", n * rb, " bytes");
  const int64_t m = x.size(0);
  const int path = q8_path(sp::pick_isa(isa), qt, m, k);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "specpilot: bias must be a contiguous float32 tensor of ", n, " elements");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const Activations act(x, path, needs_sums(path, qt), reads_interleaved(path, qt),
                        sp::q8_packed(qt) ? 1 : 0);
  const sp::Q8GemmArgs a{qt,
                         act.rows(),
                         blocks.data_ptr<uint8_t>(),
                         rb,
                         bp,
                         y.data_ptr<float>(),
                         n,
                         blocks.data_ptr<uint8_t>() + blocks.numel(),
                         g_ahead.load(std::memory_order_relaxed)};
  // default schedule: up to 4 rows (8 in the AVX2 lanes schedule, 16 on the AVX-512 path) share
  // each decoded weight block; column tiles: default_col_tile
  const int rt = row_tile > 0 ? static_cast<int>(row_tile) : path >= 3 ? 16 : 8;
  const int ct =
      col_tile > 0 ? static_cast<int>(col_tile) : default_col_tile(m, rt, sp::q8_packed(qt));
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 18) / std::max<int64_t>(1, m * k));
  at::parallel_for(0, n, grain,
                   [&](int64_t n0, int64_t n1) { run_q8(a, path, n0, n1, rt, ct); });
  return y;
}

// Several linears of one x (the int8 twin of gguf_matmul_multi in ops.cpp): x quantized once,
// part p writes the columns [off_p, off_p + ns[p]) of y (its Q8GemmArgs with y moved to its
// first column and the row stride a.n set to sum ns), one at::parallel_for over all columns,
// each column by the same kernel call as a gguf_matmul_q8 of that part alone: the same bits.

at::Tensor gguf_matmul_q8_multi(const at::Tensor& x_in, at::TensorList blocks,
                                at::IntArrayRef qtypes, at::IntArrayRef ns, int64_t k,
                                const c10::optional<at::Tensor>& bias, int64_t isa,
                                int64_t row_tile, int64_t col_tile) {
  const size_t parts = blocks.size();
  TORCH_CHECK(parts > 0 && qtypes.size() == parts && ns.size() == parts,
              "specpilot: gguf_matmul_q8_multi needs one type and one n per block tensor");
  const at::Tensor x = x_in.contiguous();
  check_x(x, k);
  int64_t total = 0;
  bool sums = false, interleaved = false, packed = false;
  const int64_t m = x.size(0);
  const int isa_path = sp::pick_isa(isa);
  std::vector<int> paths;
  for (size_t p = 0; p < parts; ++p) {
    const int qt = static_cast<int>(qtypes[p]);
    TORCH_CHECK(sp::q8_supported(qt), "specpilot: GGUF type ", qt, " has no int8 kernel");
    TORCH_CHECK(ns[p] > 0, "specpilot: n must be positive");
    const int64_t rb = q8_row_bytes(qt, k);
    TORCH_CHECK(!sp::q8_packed(qt) || ns[p] % 2 == 0, "specpilot: packed weights need an even n");
    TORCH_CHECK(blocks[p].device().is_cpu() && blocks[p].scalar_type() == at::kByte &&
                    blocks[p].is_contiguous() && blocks[p].numel() == ns[p] * rb,
                "specpilot: blocks must be a contiguous CPU uint8 tensor of ", ns[p] * rb,
                " bytes");
    paths.push_back(q8_path(isa_path, qt, m, k));
    sums = sums || needs_sums(paths.back(), qt);
    interleaved = interleaved || reads_interleaved(paths.back(), qt);
    packed = packed || sp::q8_packed(qt);
    total += ns[p];
  }
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == total &&
                    bias->is_contiguous(),
                "specpilot: bias must be a contiguous float32 tensor of ", total, " elements");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, total}, x.options());
  if (m == 0) return y;
  const Activations act(x, isa_path, sums, interleaved, packed ? 1 : 0);
  const sp::Q8Rows rows = act.rows();
  std::vector<sp::Q8GemmArgs> args;
  std::vector<int64_t> off(parts + 1, 0);
  for (size_t p = 0; p < parts; ++p) {
    const int qt = static_cast<int>(qtypes[p]);
    args.push_back(sp::Q8GemmArgs{qt, rows, blocks[p].data_ptr<uint8_t>(),
                                  q8_row_bytes(qt, k),
                                  bp == nullptr ? nullptr : bp + off[p],
                                  y.data_ptr<float>() + off[p], total,
                                  blocks[p].data_ptr<uint8_t>() + blocks[p].numel(),
                                  g_ahead.load(std::memory_order_relaxed)});
    off[p + 1] = off[p] + ns[p];
  }
  const int rt = row_tile > 0 ? static_cast<int>(row_tile) : isa_path >= 3 ? 16 : 8;
  const int ct = col_tile > 0 ? static_cast<int>(col_tile) : default_col_tile(m, rt, packed);
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 18) / std::max<int64_t>(1, m * k));
  at::parallel_for(0, total, grain, [&](int64_t c0, int64_t c1) {
    for (size_t p = 0; p < parts; ++p) {
      const int64_t lo = std::max(c0, off[p]) - off[p], hi = std::min(c1, off[p + 1]) - off[p];
      if (lo < hi) run_q8(args[p], paths[p], lo, hi, rt, ct);
    }
  });
  return y;
}

// The blocks of n rows of k-wide Q4_0 / Q4_1 / Q8_0 weights in the packed layout of the AVX-512
// path (gemm_q8.h), or back (unpack): a new tensor of the same size.
at::Tensor q8_pack(const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k, bool unpack) {
  const int qt = static_cast<int>(qtype);
  TORCH_CHECK(sp::q8_packable(qt), "specpilot: only Q4_0, Q4_1 and Q8_0 weights pack");
  TORCH_CHECK(n > 0 && n % 2 == 0 && k > 0 && k % 32 == 0,
              "specpilot: packing needs an even n and k a multiple of 32");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous() && blocks.numel() == n * q8_row_bytes(qt, k),
              "specpilot: blocks must be a contiguous CPU uint8 tensor of ",
              n * q8_row_bytes(qt, k), " bytes");
  at::Tensor out = at::empty_like(blocks);
  sp_q8_pack(blocks.data_ptr<uint8_t>(), qt, n, k, out.data_ptr<uint8_t>(), unpack);
  return out;
}

// Set the int8 GEMMs' prefetch distance to `columns` (0: the schedules' own) where columns >= 0;
// returns the setting before the call.
int64_t q8_prefetch(int64_t columns) {
  TORCH_CHECK(columns <= (int64_t{1} << 20), "specpilot: prefetch distance of ", columns,
              " columns is out of range");
  return columns < 0 ? g_ahead.load() : g_ahead.exchange(columns);
}

// Whether weights of type qtype pack for calls with this isa code: Q4_0 / Q4_1 / Q8_0 where the
// picked path is AVX-512 (not AMX, whose schedule reads the blocks as they are).
int64_t q8_packs(int64_t qtype, int64_t isa) {
  return sp::q8_packable(static_cast<int>(qtype)) && sp::pick_isa(isa) == 3 ? 1 : 0;
}

}  // namespace sp_ops

TORCH_LIBRARY_FRAGMENT(specpilot, m) {
  m.def("q8_pack(Tensor blocks, int qtype, int n, int k, bool unpack=False) -> Tensor");
  m.def("q8_packs(int qtype, int isa) -> int", &sp_ops::q8_packs);
  m.def("q8_prefetch(int columns=-1) -> int", &sp_ops::q8_prefetch);
  m.def("q8_quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def(
      "gguf_matmul_q8(Tensor x, Tensor blocks, int qtype, int n, int k, Tensor? bias=None, "
      "int isa=0, int row_tile=0, int col_tile=0) -> Tensor");
  m.def(
      "gguf_matmul_q8_multi(Tensor x, Tensor[] blocks, int[] qtypes, int[] ns, int k, "
      "Tensor? bias=None, int isa=0, int row_tile=0, int col_tile=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpilot, CPU, m) {
  m.impl("q8_quantize", &q8_quantize);
  m.impl("gguf_matmul_q8", &sp_ops::gguf_matmul_q8);
  m.impl("gguf_matmul_q8_multi", &sp_ops::gguf_matmul_q8_multi);
  m.impl("q8_pack", &sp_ops::q8_pack);
}
