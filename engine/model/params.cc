#include "engine/model/params.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <thread>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/random/philox.h"
#include "mesh/local/rank_fibers.h"

namespace meshproof::engine {

using kernels::Shape;
using kernels::Tensor;
using mesh::Box;

namespace {

// The linear layers of a transformer block (docs/design.md section 20). A new linear layer is
// one row here plus its math in engine/model/model_layer.cc or model_mlp.cc.
constexpr LinearLayer kBlockLinears[] = {
    {.name = "attn.qkv",
     .kind = LinearKind::kColumnParallel,
     .out_dim = ModelDim::kQkv,
     .in_dim = ModelDim::kHidden,
     .norm_before = "ln1"},
    {.name = "attn.proj",
     .kind = LinearKind::kRowParallel,
     .out_dim = ModelDim::kHidden,
     .in_dim = ModelDim::kHidden,
     .residual_out = true},
    {.name = "mlp.fc1",
     .kind = LinearKind::kColumnParallel,
     .out_dim = ModelDim::kFfn,
     .in_dim = ModelDim::kHidden,
     .norm_before = "ln2",
     .use = LinearUse::kUngated},
    {.name = "mlp.fc1_gate",
     .kind = LinearKind::kColumnParallel,
     .out_dim = ModelDim::kFfn,
     .in_dim = ModelDim::kHidden,
     .norm_before = "ln2",
     .use = LinearUse::kGated},
    {.name = "mlp.fc1_up",
     .kind = LinearKind::kColumnParallel,
     .out_dim = ModelDim::kFfn,
     .in_dim = ModelDim::kHidden,
     .use = LinearUse::kGated},
    {.name = "mlp.fc2",
     .kind = LinearKind::kRowParallel,
     .out_dim = ModelDim::kHidden,
     .in_dim = ModelDim::kFfn,
     .residual_out = true},
};

}  // namespace

std::vector<LinearLayer> block_linears(Activation activation) {
  const bool gated = activation == Activation::kSwiGlu;
  std::vector<LinearLayer> out;
  for (const LinearLayer& l : kBlockLinears)
    if (l.use == LinearUse::kAlways || (l.use == LinearUse::kGated) == gated) out.push_back(l);
  return out;
}

int64_t model_dim(const ModelConfig& m, ModelDim dim) {
  switch (dim) {
    case ModelDim::kHidden:
      return m.hidden;
    case ModelDim::kFfn:
      return m.ffn;
    case ModelDim::kQkv:
      // Rows grouped by KV head: A/KV query heads, then k, then v (d rows each) per group.
      return (m.heads + 2 * kv_heads_of(m)) * (m.hidden / std::max<int64_t>(m.heads, 1));
  }
  return 0;
}

std::string_view model_dim_name(ModelDim dim) {
  switch (dim) {
    case ModelDim::kHidden:
      return "hidden";
    case ModelDim::kFfn:
      return "ffn";
    case ModelDim::kQkv:
      return "qkv";
  }
  return "?";
}

std::string_view linear_kind_name(LinearKind k) {
  return k == LinearKind::kColumnParallel ? "column_parallel" : "row_parallel";
}

std::vector<ParamSpec> param_specs(const ModelConfig& m) {
  const int64_t v = m.vocab, h = m.hidden, l = m.layers;
  const double std_ = 0.02;
  const double std_out = 0.02 / std::sqrt(2.0 * static_cast<double>(l));  // residual outputs
  const bool layernorm = m.norm == NormKind::kLayerNorm;
  std::vector<ParamSpec> s;
  auto add = [&](std::string n, Shape shape, InitKind k, double sd, int64_t unit) -> ParamSpec& {
    ParamSpec p;
    p.name = std::move(n);
    p.shape = shape;
    p.init = k;
    p.std = sd;
    p.unit = unit;
    return s.emplace_back(std::move(p));
  };
  auto norm = [&](const std::string& prefix, int64_t unit, ModelEnd end = ModelEnd::kInput) {
    add(prefix + ".weight", {h}, InitKind::kOnes, 0.0, unit).end = end;
    if (layernorm) add(prefix + ".bias", {h}, InitKind::kZeros, 0.0, unit).end = end;
  };
  // Vocabulary-parallel embedding and LM head: rows split over tp like a column-parallel weight.
  const TpStyle vocab_tp = m.vocab_parallel ? TpStyle::kColumn : TpStyle::kReplicated;
  ParamSpec& tok = add("embed.tok", {v, h}, InitKind::kNormal, std_, kRootUnit);
  tok.vocab_rows = true;
  tok.tp = vocab_tp;
  tok.tied_head = m.tied_embeddings;
  if (m.position == PositionKind::kLearned)
    add("embed.pos", {m.max_positions, h}, InitKind::kNormal, std_, kRootUnit);
  // One linear `lin` (a row of block_linears) under the name `name` in layer i; init_stream ""
  // draws from the parameter's own name. A column-parallel bias splits with the weight's rows; a
  // row-parallel bias is added after the output all-reduce, whole on every tp rank.
  auto linear = [&](const LinearLayer& lin, const std::string& name, int64_t i,
                    const std::string& init_stream) {
    const int64_t out = lin.out_mult * model_dim(m, lin.out_dim);
    const int64_t in = model_dim(m, lin.in_dim);
    const bool column = lin.kind == LinearKind::kColumnParallel;
    ParamSpec& w =
        add(name + ".weight", {out, in}, InitKind::kNormal, lin.residual_out ? std_out : std_, i);
    w.tp = column ? TpStyle::kColumn : TpStyle::kRow;
    w.linear = name;
    w.linear_kind = lin.kind;
    w.init_stream = init_stream;
    if (m.bias)
      add(name + ".bias", {out}, InitKind::kZeros, 0.0, i).tp =
          column ? TpStyle::kColumn : TpStyle::kReplicated;
  };
  // The MoE block of layer i (docs/design.md section 27): router, experts, shared expert.
  auto moe_block = [&](int64_t i) {
    const std::string p = fmt::format("layers.{}.moe.", i);
    add(p + "router.weight", {m.moe.experts, h}, InitKind::kNormal, std_, i).fp32_compute = true;
    const std::vector<LinearLayer> lins = block_linears(m.activation);
    for (int64_t e = 0; e < m.moe.experts; ++e) {
      for (const LinearLayer& lin : lins) {
        if (!lin.name.starts_with("mlp.")) continue;
        const std::string dense = fmt::format("layers.{}.{}.weight", i, lin.name);
        // Expert 0 is the dense MLP's stream; the others streams derived from it.
        linear(lin, fmt::format("{}experts.{}.{}", p, e, lin.name.substr(4)), i,
               e == 0 ? dense : fmt::format("{}/expert{}", dense, e));
      }
    }
    if (m.moe.shared_expert)
      for (const LinearLayer& lin : lins)
        if (lin.name.starts_with("mlp."))
          linear(lin, p + "shared." + std::string(lin.name.substr(4)), i, "");
  };
  for (int64_t i = 0; i < l; ++i) {
    const std::string p = fmt::format("layers.{}.", i);
    for (const LinearLayer& lin : block_linears(m.activation)) {
      if (!lin.norm_before.empty()) norm(p + std::string(lin.norm_before), i);
      if (is_moe_layer(m, i) && lin.name.starts_with("mlp.")) {
        if (!lin.norm_before.empty()) moe_block(i);  // once, after ln2
        continue;
      }
      linear(lin, p + std::string(lin.name), i, "");
    }
  }
  norm("final_ln", kRootUnit, ModelEnd::kOutput);
  if (!m.tied_embeddings) {
    ParamSpec& head = add("lm_head.weight", {v, h}, InitKind::kNormal, std_, kRootUnit);
    head.end = ModelEnd::kOutput;
    head.vocab_rows = true;
    head.tp = vocab_tp;
  }
  return s;
}

void TensorMap::insert(const std::string& name, Tensor t) {
  MP_CHECK(!contains(name), "TensorMap: duplicate key '{}'", name);
  names_.push_back(name);
  tensors_.emplace(name, std::move(t));
}

Tensor& TensorMap::at(const std::string& name) {
  auto it = tensors_.find(name);
  MP_CHECK(it != tensors_.end(), "TensorMap: no tensor named '{}'", name);
  return it->second;
}

const Tensor& TensorMap::at(const std::string& name) const {
  auto it = tensors_.find(name);
  MP_CHECK(it != tensors_.end(), "TensorMap: no tensor named '{}'", name);
  return it->second;
}

void TensorMap::erase(const std::string& name) {
  if (tensors_.erase(name) == 0) return;
  names_.erase(std::find(names_.begin(), names_.end(), name));
}

void TensorMap::zero_all() {
  for (const auto& n : names_) at(n).zero_();
}

namespace {

// Draws runs [first, last) of `box` (runs along its last dim, each run's global flat indices
// consecutive) into p, which points at run `first`.
void init_runs(const ParamSpec& spec, uint64_t seed, uint64_t stream, const mesh::Box& box,
               int64_t run, int64_t first, int64_t last, float* p) {
  const kernels::Shape& g = spec.shape;
  const int rank = g.rank();
  // The first run's outer index (an odometer over the outer dims, innermost fastest).
  std::vector<int64_t> at(static_cast<size_t>(std::max(rank - 1, 0)), 0);
  for (int64_t d = rank - 2, r = first; d >= 0; --d) {
    const int64_t extent = box.extent[static_cast<size_t>(d)].value;
    at[static_cast<size_t>(d)] = r % extent;
    r /= extent;
  }
  for (int64_t r = first; r < last; ++r, p += run) {
    int64_t base = 0;  // the run's first global flat index
    for (int d = 0; d < rank; ++d) {
      const int64_t i = box.offset[static_cast<size_t>(d)].value +
                        (d + 1 < rank ? at[static_cast<size_t>(d)] : 0);
      base = base * g[d] + i;
    }
    switch (spec.init) {
      case InitKind::kNormal:
        for (int64_t i = 0; i < run; ++i)
          p[i] = static_cast<float>(
              spec.std * kernels::philox_normal(seed, stream, static_cast<uint64_t>(base + i)));
        break;
      case InitKind::kOnes:
        std::fill(p, p + run, 1.0f);
        break;
      case InitKind::kZeros:
        std::fill(p, p + run, 0.0f);
        break;
    }
    for (int d = rank - 2; d >= 0; --d) {
      if (++at[static_cast<size_t>(d)] < box.extent[static_cast<size_t>(d)].value) break;
      at[static_cast<size_t>(d)] = 0;
    }
  }
}

// Elements per drawing thread. A normal draw costs about 52 ns on one core of the development VM
// (Philox, log, cos; 2026-11-29), so a box below this (every model of the test suite and the
// scenario library) stays on the calling thread, and a real-size model's does not spend minutes
// at start-up: issue 16's 4-layer hidden-4096 model is 0.9 G elements, 47 s on one core.
constexpr int64_t kInitElementsPerThread = int64_t{1} << 22;

}  // namespace

int init_threads(int64_t elements, int cpus) {
  const int64_t by_size = std::max<int64_t>(1, elements / kInitElementsPerThread);
  return static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(by_size, cpus), 1, 64));
}

Tensor init_param_box(const ParamSpec& spec, uint64_t seed, const mesh::Box& box) {
  // usable_cpus() is the calling thread's affinity: a virtual rank pinned to one CPU (more ranks
  // than CPUs) draws alone.
  return init_param_box(spec, seed, box, init_threads(box.numel().value, mesh::usable_cpus()));
}

Tensor init_param_box(const ParamSpec& spec, uint64_t seed, const mesh::Box& box, int threads) {
  const kernels::Shape& g = spec.shape;
  MP_CHECK(threads >= 1, "init_param_box: {} threads for {}", threads, spec.name);
  MP_CHECK(box.rank() == g.rank() && Box::whole(g).contains(box),
           "init_param_box: box {} outside {} of {}", box.str(), g.str(), spec.name);
  Tensor t = Tensor::empty(box.shape(), kernels::DType::kFloat32, kernels::Device::cpu());
  if (box.empty()) return t;
  float* p = t.data<float>();
  const int rank = g.rank();
  // A rank-0 parameter is one element; otherwise the box is walked as runs along its last dim.
  const int64_t run = rank == 0 ? 1 : box.extent[static_cast<size_t>(rank - 1)].value;
  const int64_t runs = box.numel().value / run;
  const uint64_t stream =
      kernels::philox_stream(spec.init_stream.empty() ? spec.name : spec.init_stream);
  // Each element is a function of (seed, stream, its global index) alone, so contiguous shares
  // of the runs drawn by several threads give the same bits as one thread.
  threads = static_cast<int>(std::min<int64_t>(threads, runs));
  if (threads <= 1) {
    init_runs(spec, seed, stream, box, run, 0, runs, p);
    return t;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  const auto share = [&](int w) { return runs * w / threads; };
  for (int w = 1; w < threads; ++w)
    pool.emplace_back(init_runs, std::cref(spec), seed, stream, std::cref(box), run, share(w),
                      share(w + 1), p + share(w) * run);
  init_runs(spec, seed, stream, box, run, 0, share(1), p);
  for (std::thread& th : pool) th.join();
  return t;
}

Tensor init_param_rows(const ParamSpec& spec, uint64_t seed, int64_t row_begin, int64_t row_end) {
  MP_CHECK(
      spec.shape.rank() > 0 && 0 <= row_begin && row_begin <= row_end && row_end <= spec.shape[0],
      "init_param_rows: rows [{}, {}) outside {} of {}", row_begin, row_end, spec.shape.str(),
      spec.name);
  Box rows = Box::whole(spec.shape);
  rows.offset[0] = kernels::Elements(row_begin);
  rows.extent[0] = kernels::Elements(row_end - row_begin);
  return init_param_box(spec, seed, rows);
}

TensorMap init_params(const ModelConfig& model, uint64_t seed) {
  TensorMap out;
  for (const ParamSpec& s : param_specs(model)) {
    out.insert(s.name, init_param_rows(s, seed, 0, s.shape[0]));
  }
  return out;
}

TensorMap zeros_like_params(const ModelConfig& model) {
  TensorMap out;
  for (const ParamSpec& s : param_specs(model)) {
    out.insert(s.name, Tensor::zeros(s.shape, kernels::DType::kFloat32, kernels::Device::cpu()));
  }
  return out;
}

}  // namespace meshproof::engine
