// Torch op `specpilot::lean_run`: the decoder layers and the final norm of the lean native
// forward (specpilot/kernels/step.py) in one op call, through a plan read once
// (torch.classes.specpilot.LeanPlan), so that a forward passes only its call inputs.
//
// The Python loop of step.run costs ~240 op dispatches and their Python glue per forward (a
// few us each: 1.3-2 ms of a 9-18 ms SmolLM2 step). Here the same op functions are called in the
// same order on the same arguments (ops_api.h: each is the registered op's own function), so every
// output has the bits of step.run's: no reduction is added, moved or split.
//
// The plan's lists (built once per model by specpilot/kernels/stack.py, `pack`), then each
// call's inputs:
//   tensors   the weights (GGUF blocks, biases, norms, q/k norms);
//   caches    the K/V caches (written: each layer's new keys and values);
//   ints      [n_layers, gemma, isa, attn_isa, n_q, n_k, head_dim, glu_kind, final_norm], then
//             per layer: qkv, o_proj (linears), fused (1: gate_up, else gate and up), the MLP
//             linears, down, the norm count and indices, q_norm, k_norm (-1: none), the k and v
//             caches (indices into caches), sliding; a linear is [parts, k, bias (-1: none), isa,
//             row tile and column tile of one-row calls, of multi-row calls, then per part
//             (blocks, qtype, n, int8, the part's own bias)]: parts of one profile run as one
//             fused call, parts of mixed profiles each alone, concatenated (GGUFMultiLinear);
//   floats    [eps, then each layer's attention scale];
//   call      [cos, sin, mask of the full-attention layers, the same of the sliding layers (None
//             when the model has none), slots (None: contiguous from slot0), the real rows of a
//             packed call in the padded layout (None: not packed)];
//   call_ints [slot0, kv_len, batch, cache_row, rows of the padded layout];
//   want      layer inputs to return (index n_layers: the normed final state);
//   clock     None, or float64 (6,) seconds added per kernel class of the cost model, in the
//             order of specpilot.profiling.KERNEL_CLASSES (qkv, attention, o_proj, gate_up,
//             down, lm_head), grouped as step.run's profiler ranges group them: qkv the input
//             norm (fused with the last residual add) and the projection, attention
//             rope_attention, gate_up the residual add + norm and the gated activation, lm_head
//             the final norm; the pad and unpad of a packed call count in none. Two clock reads
//             a section (~40 ns): the cost model times the forward that runs.
// A packed call (step.Packing) runs every op on the real rows but the attention, which runs on
// the padded layout (pad rows zero), as step._attend does.
// Returns [the normed final state, then the wanted states in the order of want].
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "ops_api.h"

namespace {

struct Reader {
  at::IntArrayRef v;
  size_t i = 0;
  int64_t next() {
    TORCH_CHECK(i < v.size(), "specpilot: lean_run plan is truncated");
    return v[i++];
  }
};

struct Linear {
  std::vector<at::Tensor> blocks;
  std::vector<int64_t> qtypes, ns;
  std::vector<bool> int8;
  std::vector<c10::optional<at::Tensor>> biases;
  int64_t k = 0, isa = 0, tiles[4] = {0, 0, 0, 0};
  c10::optional<at::Tensor> bias;

  at::Tensor part(const at::Tensor& x, size_t p, const c10::optional<at::Tensor>& b, int64_t rt,
                  int64_t ct) const {
    return int8[p] ? sp_ops::gguf_matmul_q8(x, blocks[p], qtypes[p], ns[p], k, b, isa, rt, ct)
                   : sp_ops::gguf_matmul(x, blocks[p], qtypes[p], ns[p], k, b, isa, rt, ct);
  }

  at::Tensor operator()(const at::Tensor& x) const {
    const bool many = x.size(0) > 1;
    const int64_t rt = tiles[many ? 2 : 0], ct = tiles[many ? 3 : 1];
    if (blocks.size() == 1) return part(x, 0, bias, rt, ct);
    if (std::all_of(int8.begin(), int8.end(), [&](bool q) { return q == int8[0]; })) {
      return int8[0] ? sp_ops::gguf_matmul_q8_multi(x, blocks, qtypes, ns, k, bias, isa, rt, ct)
                     : sp_ops::gguf_matmul_multi(x, blocks, qtypes, ns, k, bias, isa, rt, ct);
    }
    // parts in different profiles (a block type without an int8 kernel): each part's own call,
    // concatenated, as GGUFMultiLinear does
    std::vector<at::Tensor> ys;
    for (size_t p = 0; p < blocks.size(); ++p) ys.push_back(part(x, p, biases[p], rt, ct));
    return at::cat(ys, -1);
  }
};

c10::optional<at::Tensor> opt(at::TensorList t, int64_t idx) {
  if (idx < 0) return c10::nullopt;
  return t[idx];
}

Linear read_linear(Reader& r, at::TensorList t) {
  Linear l;
  const int64_t parts = r.next();
  TORCH_CHECK(parts >= 1, "specpilot: lean_run linear without parts");
  l.k = r.next();
  l.bias = opt(t, r.next());
  l.isa = r.next();
  for (int64_t& tile : l.tiles) tile = r.next();
  for (int64_t p = 0; p < parts; ++p) {
    l.blocks.push_back(t[r.next()]);
    l.qtypes.push_back(r.next());
    l.ns.push_back(r.next());
    l.int8.push_back(r.next() != 0);
    l.biases.push_back(opt(t, r.next()));
  }
  return l;
}

// Seconds per kernel class (the clock argument), or nothing when none is given.
enum Cls { kQkv = 0, kAttention, kOProj, kGateUp, kDown, kLmHead, kClasses };

struct Clock {
  double* acc = nullptr;
  std::chrono::steady_clock::time_point t;
  explicit Clock(const c10::optional<at::Tensor>& c) {
    if (!c.has_value()) return;
    TORCH_CHECK(c->scalar_type() == at::kDouble && c->numel() == kClasses && c->is_contiguous(),
                "specpilot: lean_run clock must be a contiguous float64 tensor of ", kClasses);
    acc = c->data_ptr<double>();
    t = std::chrono::steady_clock::now();
  }
  // The time since the last lap (or mark) goes to class c.
  void lap(Cls c) {
    if (acc == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    acc[c] += std::chrono::duration<double>(now - t).count();
    t = now;
  }
  // The time since the last lap goes to no class (glue).
  void mark() {
    if (acc != nullptr) t = std::chrono::steady_clock::now();
  }
};

struct Layer {
  Linear qkv, o, gate_up, up, down;
  bool fused = true, sliding = false;
  std::vector<at::Tensor> norms;
  c10::optional<at::Tensor> q_norm, k_norm;
  at::Tensor k_cache, v_cache;
};

// A model's layers read off the flat plan (the arguments' layout above), once per plan.
struct Plan {
  int64_t n = 0, isa = 0, attn_isa = 0, n_q = 0, n_k = 0, hd = 0, kind = 0;
  bool gemma = false;
  at::Tensor final_norm;
  std::vector<Layer> layers;
  std::vector<double> floats;
};

Plan read_plan(at::TensorList t, at::TensorList caches, at::IntArrayRef ints,
               at::ArrayRef<double> floats) {
  Reader r{ints};
  Plan p;
  p.n = r.next();
  p.gemma = r.next() != 0;
  p.isa = r.next();
  p.attn_isa = r.next();
  p.n_q = r.next();
  p.n_k = r.next();
  p.hd = r.next();
  p.kind = r.next();
  p.final_norm = t[r.next()];
  p.layers.resize(static_cast<size_t>(p.n));
  for (Layer& lay : p.layers) {
    lay.qkv = read_linear(r, t);
    lay.o = read_linear(r, t);
    lay.fused = r.next() != 0;
    lay.gate_up = read_linear(r, t);
    if (!lay.fused) lay.up = read_linear(r, t);
    lay.down = read_linear(r, t);
    const int64_t norms = r.next();
    TORCH_CHECK(norms == (p.gemma ? 4 : 2),
                "specpilot: lean_run layer norms do not match the architecture");
    for (int64_t j = 0; j < norms; ++j) lay.norms.push_back(t[r.next()]);
    lay.q_norm = opt(t, r.next());
    lay.k_norm = opt(t, r.next());
    lay.k_cache = caches[r.next()];
    lay.v_cache = caches[r.next()];
    lay.sliding = r.next() != 0;
  }
  TORCH_CHECK(r.i == ints.size(), "specpilot: lean_run plan has trailing entries");
  TORCH_CHECK(static_cast<int64_t>(floats.size()) == 1 + p.n,
              "specpilot: lean_run needs eps and one scale per layer");
  p.floats.assign(floats.begin(), floats.end());
  return p;
}

std::vector<at::Tensor> run_plan(const Plan& p, const at::Tensor& x_in,
                                 const c10::List<c10::optional<at::Tensor>>& call,
                                 at::IntArrayRef call_ints, at::IntArrayRef want,
                                 const c10::optional<at::Tensor>& clock) {
  const int64_t n = p.n, isa = p.isa, attn_isa = p.attn_isa, n_q = p.n_q, n_k = p.n_k,
                hd = p.hd, kind = p.kind;
  const bool gemma = p.gemma;
  const at::Tensor& final_norm = p.final_norm;
  const std::vector<Layer>& layers = p.layers;
  const std::vector<double>& floats = p.floats;
  TORCH_CHECK(call.size() == 8 && call_ints.size() == 5,
              "specpilot: lean_run call inputs are 8 tensors and 5 integers");
  const double eps = floats[0];
  const c10::optional<at::Tensor> slots = call.get(6);
  const int64_t slot0 = call_ints[0], kv_len = call_ints[1], batch = call_ints[2],
                cache_row = call_ints[3], padded = call_ints[4];
  const c10::optional<at::Tensor> pack = call.get(7);
  const bool local = call.get(3).has_value();
  const auto wanted = [&](int64_t i) {
    return std::find(want.begin(), want.end(), i) != want.end();
  };
  std::vector<std::pair<int64_t, at::Tensor>> hidden;

  Clock clk(clock);
  at::Tensor x = x_in;
  at::Tensor a = sp_ops::rms_norm(x, layers[0].norms[0], eps, gemma, isa);
  for (int64_t i = 0; i < n; ++i) {
    const Layer& lay = layers[static_cast<size_t>(i)];
    if (wanted(i)) hidden.emplace_back(i, x);
    const size_t tab = lay.sliding && local ? 3 : 0;
    at::Tensor qkv = lay.qkv(a);
    clk.lap(kQkv);
    if (pack.has_value()) {  // attention on the padded layout: pad rows are zeros
      at::Tensor full = at::zeros({padded, qkv.size(1)}, qkv.options());
      full.index_put_({*pack}, qkv);
      qkv = full;
      clk.mark();
    }
    at::Tensor o = sp_ops::rope_attention(
        qkv, *call.get(tab), *call.get(tab + 1), lay.q_norm, lay.k_norm, eps, gemma, lay.k_cache,
        lay.v_cache, cache_row, batch, slots, slot0, kv_len, call.get(tab + 2),
        floats[static_cast<size_t>(i) + 1], n_q, n_k, hd, attn_isa);
    clk.lap(kAttention);
    if (pack.has_value()) {
      o = o.index_select(0, *pack);
      clk.mark();
    }
    o = lay.o(o);
    clk.lap(kOProj);
    const at::Tensor& next_norm =
        i + 1 < n ? layers[static_cast<size_t>(i) + 1].norms[0] : final_norm;
    const Cls next_cls = i + 1 < n ? kQkv : kLmHead;
    const auto act = [&](const at::Tensor& in) {
      if (lay.fused) return sp_ops::glu(lay.gate_up(in), c10::nullopt, kind, isa);
      return sp_ops::glu(lay.gate_up(in), lay.up(in), kind, isa);
    };
    if (gemma) {
      const at::Tensor h = x + sp_ops::rms_norm(o, lay.norms[1], eps, true, isa);
      a = act(sp_ops::rms_norm(h, lay.norms[2], eps, true, isa));
      clk.lap(kGateUp);
      x = h + sp_ops::rms_norm(lay.down(a), lay.norms[3], eps, true, isa);
      clk.lap(kDown);
      a = sp_ops::rms_norm(x, next_norm, eps, true, isa);
      clk.lap(next_cls);
      continue;
    }
    at::Tensor h;
    std::tie(h, a) = sp_ops::add_rms_norm(o, x, lay.norms[1], eps, false, isa);
    a = act(a);
    clk.lap(kGateUp);
    const at::Tensor d = lay.down(a);
    clk.lap(kDown);
    std::tie(x, a) = sp_ops::add_rms_norm(d, h, next_norm, eps, false, isa);
    clk.lap(next_cls);
  }
  if (wanted(n)) hidden.emplace_back(n, a);
  std::vector<at::Tensor> out{a};
  for (int64_t w : want) {
    for (const auto& [i, h] : hidden) {
      if (i == w) out.push_back(h);
    }
  }
  return out;
}

}  // namespace

// The plan read once and held (torch.classes.specpilot.LeanPlan): a forward through it
// (specpilot::lean_run) converts only its call inputs from Python, not the ~300 weight and cache
// tensors of the plan (~0.1 ms of a 4 ms SmolLM2 step).
struct LeanPlan : torch::CustomClassHolder {
  Plan plan;
  LeanPlan(std::vector<at::Tensor> tensors, std::vector<at::Tensor> caches,
           std::vector<int64_t> ints, std::vector<double> floats)
      : plan(read_plan(tensors, caches, ints, floats)) {}
};

namespace {

std::vector<at::Tensor> lean_run(const c10::intrusive_ptr<LeanPlan>& plan, const at::Tensor& x,
                                 const c10::List<c10::optional<at::Tensor>>& call,
                                 at::IntArrayRef call_ints, at::IntArrayRef want,
                                 const c10::optional<at::Tensor>& clock) {
  return run_plan(plan->plan, x, call, call_ints, want, clock);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpilot, m) {
  m.class_<LeanPlan>("LeanPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>,
                       std::vector<double>>());
  m.def(
      "lean_run(__torch__.torch.classes.specpilot.LeanPlan plan, Tensor x, Tensor?[] call, "
      "int[] call_ints, int[] want, Tensor(b!)? clock=None) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(specpilot, CPU, m) { m.impl("lean_run", &lean_run); }
