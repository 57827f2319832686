// Torch custom ops of the row-wise ops (library `specpilot`, a fragment): checks, threads, ISA.
//
// Threads split the rows (at::parallel_for); a row is always computed whole by one thread, in
// the order of rowops.h, so neither the row count nor the thread count changes a row's bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "isa.h"
#include "ops_api.h"
#include "rowops.h"

#if defined(SP_NO_AVX2)
#define SP_AVX2_FN(f) nullptr
#else
#define SP_AVX2_FN(f) &f
#endif

namespace {

bool pick_avx2(int64_t isa) { return sp::use_avx2(isa); }

// Rows of `n` elements each thread takes at least (small calls stay on one thread).
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)); }

// A float32 CPU tensor as rows of its last dimension (any leading shape): its data when it is
// contiguous (no view is made: no dispatcher call), else a contiguous copy.
struct Rows {
  at::Tensor t;  // keeps a copy alive
  float* p;
  int64_t rows, n;
};

Rows as_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() >= 1,
              "specpilot: ", what, " must be a CPU float32 tensor");
  Rows r{t.is_contiguous() ? t : t.contiguous(), nullptr, 0, t.size(-1)};
  r.p = r.t.data_ptr<float>();
  r.rows = r.n > 0 ? r.t.numel() / r.n : 0;
  return r;
}

at::Tensor check_weight(const at::Tensor& w, int64_t n, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.numel() == n,
              "specpilot: ", what, " must be a CPU float32 tensor of ", n, " elements");
  return w.contiguous();
}

template <typename Args>
struct RowFn {
  using type = void (*)(const Args*, int64_t, int64_t);
};

// Rows [0, rows) of `width` elements each, split over threads, on the chosen ISA path.
template <typename Args>
void run_rows(typename RowFn<Args>::type scalar, typename RowFn<Args>::type avx2, const Args& a,
              int64_t rows, int64_t width, int64_t isa) {
  const bool use_avx2 = pick_avx2(isa);
  at::parallel_for(0, rows, row_grain(width), [&](int64_t r0, int64_t r1) {
    if (use_avx2 && avx2 != nullptr) return avx2(&a, r0, r1);
    scalar(&a, r0, r1);
  });
}

std::tuple<at::Tensor, at::Tensor> norm_impl(const at::Tensor& x_in,
                                             const c10::optional<at::Tensor>& res_in,
                                             const at::Tensor& w_in, double eps, bool offset,
                                             int64_t isa) {
  const Rows x = as_rows(x_in, "x");
  const at::Tensor w = check_weight(w_in, x.n, "the norm weight");
  at::Tensor y = at::empty(x_in.sizes(), x.t.options());
  at::Tensor h;
  SpNormArgs a{x.p, x.n, nullptr, 0, nullptr, w.data_ptr<float>(), y.data_ptr<float>(), x.n,
               static_cast<float>(eps), offset ? 1 : 0};
  Rows res{};
  if (res_in.has_value()) {
    TORCH_CHECK(res_in->sizes() == x_in.sizes(), "specpilot: residual shape ", res_in->sizes(),
                " does not match x ", x_in.sizes());
    res = as_rows(*res_in, "the residual");
    h = at::empty(x_in.sizes(), x.t.options());
    a.res = res.p;
    a.res_stride = res.n;
    a.h = h.data_ptr<float>();
  }
  if (x.rows > 0) run_rows(&sp_norm_scalar, SP_AVX2_FN(sp_norm_avx2), a, x.rows, x.n, isa);
  return {h, y};
}

}  // namespace

namespace sp_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool offset,
                    int64_t isa) {
  return std::get<1>(norm_impl(x, c10::nullopt, w, eps, offset, isa));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& w, double eps, bool offset,
                                                int64_t isa) {
  return norm_impl(x, residual, w, eps, offset, isa);
}

}  // namespace sp_ops

namespace {

at::Tensor rope_qk(const at::Tensor& q_in, const at::Tensor& k_in, int64_t k_offset,
                   const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t n_q, int64_t n_k,
                   int64_t hd, const c10::optional<at::Tensor>& q_w_in,
                   const c10::optional<at::Tensor>& k_w_in, double eps, bool offset,
                   int64_t isa) {
  TORCH_CHECK(hd > 0 && hd % 2 == 0 && hd <= 1024, "specpilot: head_dim must be even, <= 1024");
  const Rows q = as_rows(q_in, "q");
  const Rows k = as_rows(k_in, "k");
  const int64_t rows = q.rows;
  TORCH_CHECK(k.rows == rows, "specpilot: q and k must have the same number of rows");
  TORCH_CHECK(q.n >= n_q * hd && k_offset >= 0 && k.n >= k_offset + n_k * hd,
              "specpilot: rows too short for ", n_q, " q and ", n_k, " k heads of ", hd);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == rows * hd && sin.numel() == rows * hd,
              "specpilot: cos and sin must be float32 with ", rows, " x ", hd, " elements");
  at::Tensor qw, kw;
  if (q_w_in.has_value()) qw = check_weight(*q_w_in, hd, "the q norm weight");
  if (k_w_in.has_value()) kw = check_weight(*k_w_in, hd, "the k norm weight");
  at::Tensor y = at::empty({rows, n_q + n_k, hd}, q.t.options());
  const SpRopeArgs a{q.p, q.n, k.p + k_offset, k.n, cos.data_ptr<float>(), sin.data_ptr<float>(),
                     qw.defined() ? qw.data_ptr<float>() : nullptr,
                     kw.defined() ? kw.data_ptr<float>() : nullptr, static_cast<float>(eps),
                     offset ? 1 : 0, n_q, n_k, hd, y.data_ptr<float>()};
  const int64_t width = (n_q + n_k) * hd;
  if (rows > 0) run_rows(&sp_rope_scalar, SP_AVX2_FN(sp_rope_avx2), a, rows, width, isa);
  return y;
}

}  // namespace

namespace sp_ops {

at::Tensor glu(const at::Tensor& gate_in, const c10::optional<at::Tensor>& up_in, int64_t kind,
               int64_t isa) {
  TORCH_CHECK(kind == sp_row::kSilu || kind == sp_row::kGeluTanh,
              "specpilot: glu kind must be 0 (SiLU) or 1 (GELU-tanh)");
  const Rows g = as_rows(gate_in, "gate");
  int64_t n = g.n;
  Rows u{};
  const float* up = nullptr;
  int64_t up_stride = g.n;
  if (up_in.has_value()) {
    TORCH_CHECK(up_in->sizes() == gate_in.sizes(), "specpilot: up shape ", up_in->sizes(),
                " does not match gate ", gate_in.sizes());
    u = as_rows(*up_in, "up");
    up = u.p;
  } else {
    TORCH_CHECK(n % 2 == 0, "specpilot: a fused gate_up row must have an even length");
    n /= 2;
    up = g.p + n;
  }
  std::vector<int64_t> shape(gate_in.sizes().begin(), gate_in.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, g.t.options());
  const SpGluArgs a{g.p, g.n, up, up_stride, y.data_ptr<float>(), n, static_cast<int>(kind)};
  if (g.rows > 0) run_rows(&sp_glu_scalar, SP_AVX2_FN(sp_glu_avx2), a, g.rows, n, isa);
  return y;
}

}  // namespace sp_ops

TORCH_LIBRARY_FRAGMENT(specpilot, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool offset=False, int isa=0) -> Tensor");
  m.def(
      "add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps, bool offset=False, "
      "int isa=0) -> (Tensor, Tensor)");
  m.def(
      "rope_qk(Tensor q, Tensor k, int k_offset, Tensor cos, Tensor sin, int n_q, int n_k, "
      "int head_dim, Tensor? q_norm=None, Tensor? k_norm=None, float eps=1e-6, "
      "bool offset=False, int isa=0) -> Tensor");
  m.def("glu(Tensor gate, Tensor? up=None, int kind=0, int isa=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpilot, CPU, m) {
  m.impl("rms_norm", &sp_ops::rms_norm);
  m.impl("add_rms_norm", &sp_ops::add_rms_norm);
  m.impl("rope_qk", &rope_qk);
  m.impl("glu", &sp_ops::glu);
}
