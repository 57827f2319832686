// Torch custom ops over GGUF blocks (namespace `specpilot`): checks, threads, ISA dispatch.
//
// Threads split the output columns (at::parallel_for over units of sp::kColumnUnit columns);
// k is never split, so a thread count changes only which thread computes a column, never how.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "formats.h"
#include "gemm_q8.h"
#include "isa.h"
#include "ops_api.h"

namespace {

int64_t row_bytes(int64_t qtype, int64_t k) {
  const int be = sp::block_elems(static_cast<int>(qtype));
  TORCH_CHECK(be > 0, "specpilot: unsupported GGUF block type ", qtype);
  TORCH_CHECK(k > 0 && k % be == 0, "specpilot: k=", k, " is not a multiple of the block size ",
              be, " of type ", qtype);
  return k / be * sp::block_bytes(static_cast<int>(qtype));
}

void check_blocks(const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous(),
              "specpilot: blocks must be a contiguous CPU uint8 tensor");
  TORCH_CHECK(n > 0, "specpilot: n must be positive");
  TORCH_CHECK(blocks.numel() == n * row_bytes(qtype, k), "specpilot: blocks hold ",
              blocks.numel(), " bytes, a ", n, "x", k, " tensor of type ", qtype, " needs ",
              n * row_bytes(qtype, k));
}

sp::GemmArgs make_args(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t n,
                       int64_t k, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  check_blocks(blocks, qtype, n, k);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.size(1) == k,
              "specpilot: x must be a CPU float32 tensor of shape (m, ", k, ")");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "specpilot: bias must be a contiguous float32 tensor of ", n, " elements");
    bp = bias->data_ptr<float>();
  }
  return sp::GemmArgs{static_cast<int>(qtype), x.data_ptr<float>(), x.size(0), k,
                      blocks.data_ptr<uint8_t>(), row_bytes(qtype, k), bp,
                      y.data_ptr<float>(), n};
}

// Column units per task: at least ~2^16 multiply-adds (tens of microseconds), so a small
// linear stays on one thread instead of paying a fork-join for little work.
int64_t grain_units(int64_t m, int64_t k) {
  const int64_t per_unit = std::max<int64_t>(1, m * k * sp::kColumnUnit);
  return std::max<int64_t>(1, (int64_t{1} << 16) / per_unit);
}

// The default tiles: 1 x 4, 2 x 4, 3 x 4 for one to three rows; from 4 rows 4 x 3 (decoded panels,
// except four rows of a 32-element block type, which run the direct register tile).
// (AVX-512: row tile 8 from 5 rows, two columns per zmm accumulator.)
int default_row_tile(int64_t row_tile, int64_t m, int path) {
  if (row_tile > 0) return static_cast<int>(row_tile);
  return m == 1 ? 1 : (path >= 3 && m >= 5 ? 8 : 4);
}
int default_col_tile(int64_t col_tile, int64_t m) {
  return col_tile > 0 ? static_cast<int>(col_tile) : (m <= 3 ? 4 : 3);
}

void run_columns(const sp::GemmArgs& a, int path, int64_t n0, int64_t n1, int rt, int ct) {
  if (path >= 2) {
#if !defined(SP_NO_AVX2)
#if !defined(SP_NO_AVX512)
    if (path >= 3) return sp_gemm_avx512(&a, n0, n1, rt, ct);
#endif
    sp_gemm_avx2(&a, n0, n1, rt, ct);
#endif
  } else {
    sp_gemm_scalar(&a, n0, n1, 8);
  }
}

}  // namespace

namespace sp_ops {

at::Tensor gguf_matmul(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t n,
                       int64_t k, const c10::optional<at::Tensor>& bias, int64_t isa,
                       int64_t row_tile, int64_t col_tile) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const sp::GemmArgs a = make_args(x, blocks, qtype, n, k, bias, y);
  if (a.m == 0) return y;
  const int path = sp::pick_isa(isa);
  const int rt = default_row_tile(row_tile, a.m, path), ct = default_col_tile(col_tile, a.m);
  const int64_t unit = sp::kColumnUnit;
  const int64_t units = (n + unit - 1) / unit;
  at::parallel_for(0, units, grain_units(a.m, k), [&](int64_t u0, int64_t u1) {
    run_columns(a, path, u0 * unit, std::min(n, u1 * unit), rt, ct);
  });
  return y;
}

// Several linears of one x in one call: part p (blocks[p], type qtypes[p], ns[p] rows of W)
// writes the columns [off_p, off_p + ns[p]) of y (m, sum ns), off_p the sum of the ns before
// it. One at::parallel_for runs over the union of the parts' column units; a part's columns are
// computed by the same kernel calls as a gguf_matmul of that part alone (its GemmArgs with y
// moved to the part's first column and the row stride of y, a.n, set to sum ns), so the bits
// are those of the separate calls concatenated. bias: sum ns elements, or None for all parts.

at::Tensor gguf_matmul_multi(const at::Tensor& x_in, at::TensorList blocks, at::IntArrayRef qtypes,
                             at::IntArrayRef ns, int64_t k, const c10::optional<at::Tensor>& bias,
                             int64_t isa, int64_t row_tile, int64_t col_tile) {
  const size_t parts = blocks.size();
  TORCH_CHECK(parts > 0 && qtypes.size() == parts && ns.size() == parts,
              "specpilot: gguf_matmul_multi needs one type and one n per block tensor");
  const at::Tensor x = x_in.contiguous();
  int64_t total = 0;
  for (const int64_t n : ns) {
    TORCH_CHECK(n > 0, "specpilot: n must be positive");
    total += n;
  }
  at::Tensor y = at::empty({x.size(0), total}, x.options());
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == total &&
                    bias->is_contiguous(),
                "specpilot: bias must be a contiguous float32 tensor of ", total, " elements");
    bp = bias->data_ptr<float>();
  }
  const int64_t unit = sp::kColumnUnit;
  std::vector<sp::GemmArgs> args;
  std::vector<int64_t> first(parts + 1, 0);  // first[p]: the first union unit of part p
  int64_t off = 0;
  for (size_t p = 0; p < parts; ++p) {
    args.push_back(make_args(x, blocks[p], qtypes[p], ns[p], k, c10::nullopt, y));
    args[p].y += off;
    args[p].n = total;
    args[p].bias = bp == nullptr ? nullptr : bp + off;
    first[p + 1] = first[p] + (ns[p] + unit - 1) / unit;
    off += ns[p];
  }
  const int64_t m = x.size(0);
  if (m == 0) return y;
  const int path = sp::pick_isa(isa);
  const int rt = default_row_tile(row_tile, m, path), ct = default_col_tile(col_tile, m);
  at::parallel_for(0, first[parts], grain_units(m, k), [&](int64_t u0, int64_t u1) {
    for (size_t p = 0; p < parts; ++p) {
      const int64_t lo = std::max(u0, first[p]), hi = std::min(u1, first[p + 1]);
      if (lo >= hi) continue;
      run_columns(args[p], path, (lo - first[p]) * unit,
                  std::min(ns[p], (hi - first[p]) * unit), rt, ct);
    }
  });
  return y;
}

}  // namespace sp_ops

namespace {

at::Tensor gguf_matmul_reference(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype,
                                 int64_t n, int64_t k, const c10::optional<at::Tensor>& bias,
                                 int64_t lanes) {
  TORCH_CHECK(lanes == 2 || lanes == 4 || lanes == 8, "specpilot: lanes must be 2, 4 or 8");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const sp::GemmArgs a = make_args(x, blocks, qtype, n, k, bias, y);
  sp_gemm_scalar(&a, 0, n, static_cast<int>(lanes));
  return y;
}

// Rows of blocks (qtype flagged sp::kQ8Packed: in the int8 GEMM's packed layout, each row read
// from its pair of columns unpacked into a scratch copy, once for consecutive rows of a pair).
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t qtype_in, int64_t n, int64_t k,
                           const at::Tensor& rows_in) {
  const bool packed = sp::q8_packed(static_cast<int>(qtype_in));
  const int64_t qtype = sp::q8_base_type(static_cast<int>(qtype_in));
  TORCH_CHECK(!packed || (sp::q8_packable(static_cast<int>(qtype)) && n % 2 == 0),
              "specpilot: packed blocks of type ", qtype, " with n=", n);
  check_blocks(blocks, qtype, n, k);
  const at::Tensor rows = rows_in.to(at::kLong).contiguous();
  at::Tensor out = at::empty({rows.numel(), k}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* idx = rows.data_ptr<int64_t>();
  const int64_t rb = row_bytes(qtype, k);
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  std::vector<uint8_t> pair(packed ? 2 * rb : 0);
  int64_t unpacked = -1;  // the pair in `pair`
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < n, "specpilot: row index ", idx[i], " out of range");
    const uint8_t* row = base + idx[i] * rb;
    if (packed) {
      if (idx[i] / 2 != unpacked) {
        unpacked = idx[i] / 2;
        sp_q8_pack(base + 2 * unpacked * rb, static_cast<int>(qtype), 2, k, pair.data(), true);
      }
      row = pair.data() + (idx[i] & 1) * rb;
    }
    float* dst = o + i * k;
    if (sp::is_dense(static_cast<int>(qtype))) {
      sp::decode_dense(static_cast<int>(qtype), row, 0, static_cast<int>(k), dst);
    } else {
      for (int64_t s = 0; s < k / 32; ++s) sp::decode32(static_cast<int>(qtype), row, s, dst + 32 * s);
    }
  }
  return out;
}

int64_t isa_available(int64_t isa) { return isa != 0 && sp::isa_runs(isa) ? 1 : 0; }

// How many distinct threads run the tasks of an at::parallel_for over `tasks` units of grain 1
// in this library: 1 when it was built without OpenMP (the loop then runs inline).
int64_t parallel_width(int64_t tasks) {
  std::vector<int> seen(static_cast<size_t>(std::max<int>(1, at::get_num_threads())), 0);
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t >= 0 && t < static_cast<int>(seen.size())) seen[static_cast<size_t>(t)] = 1;
  });
  int64_t n = 0;
  for (int s : seen) n += s;
  return n;
}

}  // namespace

TORCH_LIBRARY(specpilot, m) {
  m.def(
      "gguf_matmul(Tensor x, Tensor blocks, int qtype, int n, int k, Tensor? bias=None, "
      "int isa=0, int row_tile=0, int col_tile=0) -> Tensor");
  m.def(
      "gguf_matmul_multi(Tensor x, Tensor[] blocks, int[] qtypes, int[] ns, int k, "
      "Tensor? bias=None, int isa=0, int row_tile=0, int col_tile=0) -> Tensor");
  m.def(
      "gguf_matmul_reference(Tensor x, Tensor blocks, int qtype, int n, int k, "
      "Tensor? bias=None, int lanes=8) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int qtype, int n, int k, Tensor rows) -> Tensor");
  m.def("isa_available(int isa) -> int", &isa_available);
  m.def("parallel_width(int tasks) -> int", &parallel_width);
}

TORCH_LIBRARY_IMPL(specpilot, CPU, m) {
  m.impl("gguf_matmul", &sp_ops::gguf_matmul);
  m.impl("gguf_matmul_multi", &sp_ops::gguf_matmul_multi);
  m.impl("gguf_matmul_reference", &gguf_matmul_reference);
  m.impl("gguf_dequantize", &gguf_dequantize);
}
