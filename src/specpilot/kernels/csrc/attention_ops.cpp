// Torch ops `specpilot::attention` and `specpilot::fixed_exp`: checks, threads, ISA dispatch.
//
// Threads split the output rows (b, h, t), taken in (b, t, h) order (at::parallel_for over them);
// the keys of a row are never split, so a thread count changes only which thread computes a row,
// never how.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "isa.h"

namespace {

using sp::use_avx2;

at::Tensor last_contiguous(const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

void check_kv(const at::Tensor& x, const char* name, int64_t b, int64_t hd, int64_t kv_len) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 4,
              "specpilot: ", name, " must be a CPU float32 tensor (B, Hk, len, head_dim)");
  TORCH_CHECK(x.size(0) == b && x.size(3) == hd && x.size(2) >= kv_len && x.stride(3) == 1,
              "specpilot: ", name, " has shape ", x.sizes(), ", expected (", b, ", Hk, >= ",
              kv_len, ", ", hd, ") with a contiguous last dimension");
}

at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                     int64_t kv_len, const c10::optional<at::Tensor>& mask_in, double scale,
                     int64_t isa) {
  TORCH_CHECK(q_in.device().is_cpu() && q_in.scalar_type() == at::kFloat && q_in.dim() == 4,
              "specpilot: q must be a CPU float32 tensor (B, H, T, head_dim)");
  const at::Tensor q = last_contiguous(q_in);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3);
  TORCH_CHECK(kv_len >= 0, "specpilot: kv_len must be >= 0");
  check_kv(k, "k", B, hd, kv_len);
  check_kv(v, "v", B, hd, kv_len);
  const int64_t Hk = k.size(1);
  TORCH_CHECK(v.size(1) == Hk && Hk > 0 && H % Hk == 0, "specpilot: ", H,
              " query heads do not group over ", Hk, " kv heads");
  const bool avx2 = use_avx2(isa);
  at::Tensor out = at::empty({B, T, H, hd}, q.options()).transpose(1, 2);  // (B, H, T, hd)
  at::Tensor mask;
  sp::AttnArgs a{q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2),
                 k.data_ptr<float>(), k.stride(0), k.stride(1), k.stride(2),
                 v.data_ptr<float>(), v.stride(0), v.stride(1), v.stride(2),
                 nullptr, 0, 0,
                 out.data_ptr<float>(), out.stride(0), out.stride(1), out.stride(2),
                 B, H, T, Hk, hd, kv_len, static_cast<float>(scale)};
  if (mask_in.has_value()) {
    const at::Tensor& m = *mask_in;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 3 && m.size(1) == T &&
                    m.size(2) == kv_len && (m.size(0) == B || m.size(0) == 1),
                "specpilot: mask must be bool (B or 1, ", T, ", ", kv_len, "), got ",
                m.sizes());
    mask = last_contiguous(m.expand({B, T, kv_len}));
    a.mask = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
    a.m_sb = mask.stride(0);
    a.m_st = mask.stride(1);
  }
  const int64_t rows = B * H * T;
  if (rows == 0) return out;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, kv_len * hd));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> work(static_cast<size_t>(4 * (kv_len + 16) + hd));  // 4 rows' scores
    std::vector<int32_t> idx(static_cast<size_t>(kv_len + 8));
    if (avx2) {
#if !defined(SP_NO_AVX2)
      sp_attention_avx2(&a, r0, r1, work.data(), idx.data());
#endif
    } else {
      sp_attention_scalar(&a, r0, r1, work.data(), idx.data());
    }
  });
  return out;
}

at::Tensor fixed_exp(const at::Tensor& x_in, int64_t isa) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat,
              "specpilot: fixed_exp takes a CPU float32 tensor");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  if (use_avx2(isa)) {
#if !defined(SP_NO_AVX2)
    sp_exp_avx2(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
#endif
  } else {
    sp_exp_scalar(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpilot, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, int kv_len, Tensor? mask, float scale, "
      "int isa=0) -> Tensor");
  m.def("fixed_exp(Tensor x, int isa=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpilot, CPU, m) {
  m.impl("attention", &attention);
  m.impl("fixed_exp", &fixed_exp);
}
