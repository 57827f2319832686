// Torch ops `specpilot::attention`, `specpilot::rope_attention` (RoPE + cache write + attention
// of one layer in one call) and `specpilot::fixed_exp`: checks, threads, ISA dispatch.
//
// ISA: the path sp::pick_isa gives, AVX-512 (attention_avx512.cpp) under isa 3 and 4 where the
// build has it (no SP_NO_AVX512), else AVX2, else portable; every path gives the same bits.
// Threads split the output rows (b, h, t), taken in (b, t, h) order (at::parallel_for over them)
// in chunks of whole kv groups (a group's K/V is then read by one thread at a given (b, t): split
// inside one, both threads read its K/V; at SmolLM2's one-row step, 9 heads in 3 groups, that was
// 4 group reads for 3);
// the keys of a row are never split, so a thread count changes only which thread computes a row,
// never how. rope_attention runs the rope_qk row kernels (rowops.h) and the attention kernels on
// the same arguments the separate ops would get, so its bits are theirs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "isa.h"
#include "ops_api.h"
#include "rowops.h"

namespace {

at::Tensor last_contiguous(const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

void check_kv(const at::Tensor& x, const char* name, int64_t b, int64_t hd, int64_t kv_len) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 4,
              "specpilot: ", name, " must be a CPU float32 tensor (B, Hk, len, head_dim)");
  TORCH_CHECK(x.size(0) == b && x.size(3) == hd && x.size(2) >= kv_len && x.stride(3) == 1,
              "specpilot: ", name, " has shape ", x.sizes(), ", expected (", b, ", Hk, >= ",
              kv_len, ", ", hd, ") with a contiguous last dimension");
}

// The attention kernels of path `path` (sp::pick_isa) over rows (b, h, t) of `a`, split over
// threads.
void run_attention(const sp::AttnArgs& a, int path) {
  const int64_t rows = a.B * a.H * a.T, kv_len = a.kv_len, hd = a.hd;
  if (rows == 0) return;
  // threads take whole kv groups (the heads of one group at one (b, t) are consecutive rows)
  const int64_t group = a.H / a.Hk;
  const int64_t grain = std::max<int64_t>(
      1, (int64_t{1} << 16) / std::max<int64_t>(1, kv_len * hd * group));
  at::parallel_for(0, rows / group, grain, [&](int64_t g0, int64_t g1) {
    const int64_t r0 = g0 * group, r1 = g1 * group;
    // 4 rows' scores, then (AVX-512) 4 rows of packed q / (portable) one row's sums; the visible
    // slots, with room for the AVX-512 scores' padding
    std::vector<float> work(static_cast<size_t>(4 * (kv_len + 16) + 4 * hd));
    std::vector<int32_t> idx(static_cast<size_t>(kv_len + 16));
    if (path >= 2) {
#if !defined(SP_NO_AVX2)
#if !defined(SP_NO_AVX512)
      if (path >= 3) return sp_attention_avx512(&a, r0, r1, work.data(), idx.data());
#endif
      sp_attention_avx2(&a, r0, r1, work.data(), idx.data());
#endif
    } else {
      sp_attention_scalar(&a, r0, r1, work.data(), idx.data());
    }
  });
}

// The mask argument: bool (B or 1, T, kv_len), expanded to B rows; sets a's mask fields.
at::Tensor set_mask(sp::AttnArgs& a, const c10::optional<at::Tensor>& mask_in) {
  if (!mask_in.has_value()) return at::Tensor();
  const at::Tensor& m = *mask_in;
  const int64_t B = a.B, T = a.T, kv_len = a.kv_len;
  TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 3 && m.size(1) == T &&
                  m.size(2) == kv_len && (m.size(0) == B || m.size(0) == 1),
              "specpilot: mask must be bool (B or 1, ", T, ", ", kv_len, "), got ", m.sizes());
  at::Tensor mask = last_contiguous(m.expand({B, T, kv_len}));
  a.mask = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  a.m_sb = mask.stride(0);
  a.m_st = mask.stride(1);
  return mask;
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
  const int path = sp::pick_isa(isa);
  at::Tensor out = at::empty({B, T, H, hd}, q.options()).transpose(1, 2);  // (B, H, T, hd)
  sp::AttnArgs a{q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2),
                 k.data_ptr<float>(), k.stride(0), k.stride(1), k.stride(2),
                 v.data_ptr<float>(), v.stride(0), v.stride(1), v.stride(2),
                 nullptr, 0, 0,
                 out.data_ptr<float>(), out.stride(0), out.stride(1), out.stride(2),
                 B, H, T, Hk, hd, kv_len, static_cast<float>(scale)};
  const at::Tensor mask = set_mask(a, mask_in);
  run_attention(a, path);
  return out;
}

void check_cache(const at::Tensor& c, const char* name, int64_t n_k, int64_t hd) {
  TORCH_CHECK(c.device().is_cpu() && c.scalar_type() == at::kFloat && c.dim() == 4 &&
                  c.size(1) == n_k && c.size(3) == hd && c.stride(3) == 1,
              "specpilot: ", name, " must be a CPU float32 cache (B, ", n_k, ", len, ", hd,
              ") with a contiguous last dimension, got ", c.sizes());
}

// The cache slot of each of the B * T rows: slot0 + t, slots[t] or slots[b, t].
std::vector<int64_t> row_slots(const c10::optional<at::Tensor>& slots_in, int64_t slot0,
                               int64_t B, int64_t T, int64_t len) {
  std::vector<int64_t> out(static_cast<size_t>(B * T));
  if (!slots_in.has_value()) {
    TORCH_CHECK(slot0 >= 0 && slot0 + T <= len, "specpilot: slots ", slot0, "..", slot0 + T,
                " exceed the cache's ", len);
    for (int64_t r = 0; r < B * T; ++r) out[r] = slot0 + r % T;
    return out;
  }
  const at::Tensor s = slots_in->to(at::kLong).contiguous();
  TORCH_CHECK(s.device().is_cpu() && ((s.dim() == 1 && s.size(0) == T) ||
                                      (s.dim() == 2 && s.size(0) == B && s.size(1) == T)),
              "specpilot: slots must be (", T, ") or (", B, ", ", T, "), got ", s.sizes());
  const int64_t* p = s.data_ptr<int64_t>();
  for (int64_t r = 0; r < B * T; ++r) {
    const int64_t v = s.dim() == 1 ? p[r % T] : p[r];
    TORCH_CHECK(v >= 0 && v < len, "specpilot: slot ", v, " outside the cache's ", len);
    out[r] = v;
  }
  return out;
}

// One layer's RoPE + cache write + attention: rope_qk on the q and k heads of `qkv` (rows of
// (n_q + 2 n_k) * hd: the fused projection's q, k, v heads; batch * T rows), the rotated k heads
// and the v heads copied to cache rows cache_row + b at each row's slot (rows in order: a slot
// two rows share keeps the later row's), then attention of the q heads over slots [0, kv_len).
// Returns qkv's leading shape x (n_q * hd).
}  // namespace

namespace sp_ops {

at::Tensor rope_attention(const at::Tensor& qkv_in, const at::Tensor& cos_in,
                          const at::Tensor& sin_in, const c10::optional<at::Tensor>& q_w_in,
                          const c10::optional<at::Tensor>& k_w_in, double eps, bool offset,
                          const at::Tensor& k_cache, const at::Tensor& v_cache,
                          int64_t cache_row, int64_t batch,
                          const c10::optional<at::Tensor>& slots_in, int64_t slot0,
                          int64_t kv_len, const c10::optional<at::Tensor>& mask_in, double scale,
                          int64_t n_q, int64_t n_k, int64_t hd, int64_t isa) {
  const int64_t heads = n_q + n_k, width = (heads + n_k) * hd;
  TORCH_CHECK(hd > 0 && hd % 2 == 0 && hd <= 1024, "specpilot: head_dim must be even, <= 1024");
  TORCH_CHECK(n_k > 0 && n_q % n_k == 0, "specpilot: ", n_q, " query heads do not group over ",
              n_k, " kv heads");
  TORCH_CHECK(qkv_in.device().is_cpu() && qkv_in.scalar_type() == at::kFloat &&
                  qkv_in.dim() >= 1 && qkv_in.size(-1) == width,
              "specpilot: qkv must be CPU float32 rows of ", width, " elements");
  const at::Tensor qkv = qkv_in.contiguous();
  const int64_t rows = qkv.numel() / width;
  TORCH_CHECK(batch > 0 && rows % batch == 0, "specpilot: ", rows, " rows are not ", batch,
              " batch rows");
  const int64_t T = rows / batch;
  check_cache(k_cache, "k_cache", n_k, hd);
  check_cache(v_cache, "v_cache", n_k, hd);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "specpilot: k_cache and v_cache must have one shape and layout");
  const int64_t len = k_cache.size(2);
  TORCH_CHECK(cache_row >= 0 && cache_row + batch <= k_cache.size(0) && kv_len >= 0 &&
                  kv_len <= len,
              "specpilot: cache rows ", cache_row, "+", batch, " or kv_len ", kv_len,
              " outside the cache ", k_cache.sizes());
  const std::vector<int64_t> slot = row_slots(slots_in, slot0, batch, T, len);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == rows * hd && sin.numel() == rows * hd,
              "specpilot: cos and sin must be float32 with ", rows, " x ", hd, " elements");
  at::Tensor qw, kw;
  if (q_w_in.has_value()) qw = q_w_in->contiguous();
  if (k_w_in.has_value()) kw = k_w_in->contiguous();
  TORCH_CHECK((!qw.defined() || (qw.scalar_type() == at::kFloat && qw.numel() == hd)) &&
                  (!kw.defined() || (kw.scalar_type() == at::kFloat && kw.numel() == hd)),
              "specpilot: the q / k norm weights must be float32 of ", hd, " elements");
  const float* p = qkv.data_ptr<float>();
  at::Tensor y = at::empty({rows, heads, hd}, qkv.options());
  const SpRopeArgs ra{p, width, p + n_q * hd, width, cos.data_ptr<float>(),
                      sin.data_ptr<float>(), qw.defined() ? qw.data_ptr<float>() : nullptr,
                      kw.defined() ? kw.data_ptr<float>() : nullptr, static_cast<float>(eps),
                      offset ? 1 : 0, n_q, n_k, hd, y.data_ptr<float>()};
  const int path = sp::pick_isa(isa);
  const bool avx2 = path >= 2;
  if (rows > 0) {
    const int64_t grain = std::max<int64_t>(1, 16384 / (heads * hd));  // as rope_qk
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
#if !defined(SP_NO_AVX2)
      if (avx2) return sp_rope_avx2(&ra, r0, r1);
#endif
      sp_rope_scalar(&ra, r0, r1);
    });
  }
  float* kc = k_cache.data_ptr<float>() + cache_row * k_cache.stride(0);
  float* vc = v_cache.data_ptr<float>() + cache_row * v_cache.stride(0);
  const int64_t sb = k_cache.stride(0), sh = k_cache.stride(1), sn = k_cache.stride(2);
  const float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {  // serial, in row order
    const int64_t base = (r / T) * sb + slot[r] * sn;
    for (int64_t i = 0; i < n_k; ++i) {
      std::memcpy(kc + base + i * sh, yp + (r * heads + n_q + i) * hd, hd * sizeof(float));
      std::memcpy(vc + base + i * sh, p + r * width + (heads + i) * hd, hd * sizeof(float));
    }
  }
  std::vector<int64_t> shape(qkv_in.sizes().begin(), qkv_in.sizes().end());
  shape.back() = n_q * hd;
  at::Tensor out = at::empty(shape, qkv.options());
  sp::AttnArgs a{yp, T * heads * hd, hd, heads * hd,
                 kc, sb, sh, sn,
                 vc, sb, sh, sn,
                 nullptr, 0, 0,
                 out.data_ptr<float>(), T * n_q * hd, hd, n_q * hd,
                 batch, n_q, T, n_k, hd, kv_len, static_cast<float>(scale)};
  const at::Tensor mask = set_mask(a, mask_in);
  run_attention(a, path);
  return out;
}

}  // namespace sp_ops

namespace {

at::Tensor fixed_exp(const at::Tensor& x_in, int64_t isa) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat,
              "specpilot: fixed_exp takes a CPU float32 tensor");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int path = sp::pick_isa(isa);
  if (path >= 2) {
#if !defined(SP_NO_AVX2)
#if !defined(SP_NO_AVX512)
    if (path >= 3) {
      sp_exp_avx512(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
      return y;
    }
#endif
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
  m.def(
      "rope_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, "
      "float eps, bool offset, Tensor(a!) k_cache, Tensor(b!) v_cache, int cache_row, "
      "int batch, Tensor? slots, int slot0, int kv_len, Tensor? mask, float scale, int n_q, "
      "int n_k, int head_dim, int isa=0) -> Tensor");
  m.def("fixed_exp(Tensor x, int isa=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpilot, CPU, m) {
  m.impl("attention", &attention);
  m.impl("rope_attention", &sp_ops::rope_attention);
  m.impl("fixed_exp", &fixed_exp);
}
