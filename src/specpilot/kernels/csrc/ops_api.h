// The op functions of ops.cpp, ops_q8.cpp, attention_ops.cpp and rowops_ops.cpp (namespace
// sp_ops, each registered as the `specpilot` op of its name), callable from another op unit of
// the same library without the dispatcher (forward_ops.cpp): a call is the op's own function.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace sp_ops {

at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t n,
                       int64_t k, const c10::optional<at::Tensor>& bias, int64_t isa,
                       int64_t row_tile, int64_t col_tile);
at::Tensor gguf_matmul_multi(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef qtypes,
                             at::IntArrayRef ns, int64_t k, const c10::optional<at::Tensor>& bias,
                             int64_t isa, int64_t row_tile, int64_t col_tile);
at::Tensor gguf_matmul_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                          int64_t n, int64_t k, const c10::optional<at::Tensor>& bias,
                          int64_t isa, int64_t row_tile, int64_t col_tile);
at::Tensor gguf_matmul_q8_multi(const at::Tensor& x, at::TensorList blocks,
                                at::IntArrayRef qtypes, at::IntArrayRef ns, int64_t k,
                                const c10::optional<at::Tensor>& bias, int64_t isa,
                                int64_t row_tile, int64_t col_tile);
at::Tensor rope_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const c10::optional<at::Tensor>& q_w,
                          const c10::optional<at::Tensor>& k_w, double eps, bool offset,
                          const at::Tensor& k_cache, const at::Tensor& v_cache,
                          int64_t cache_row, int64_t batch,
                          const c10::optional<at::Tensor>& slots, int64_t slot0,
                          int64_t kv_len, const c10::optional<at::Tensor>& mask, double scale,
                          int64_t n_q, int64_t n_k, int64_t hd, int64_t isa);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool offset,
                    int64_t isa);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& w, double eps, bool offset,
                                                int64_t isa);
at::Tensor glu(const at::Tensor& gate, const c10::optional<at::Tensor>& up, int64_t kind,
               int64_t isa);

}  // namespace sp_ops
