#include "engine/params.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "kernels/error.h"
#include "kernels/philox.h"

namespace meshproof::engine {

using kernels::Shape;
using kernels::Tensor;

std::vector<ParamSpec> param_specs(const ModelConfig& m) {
  const int64_t v = m.vocab, h = m.hidden, f = m.ffn, l = m.layers;
  const double std_ = 0.02;
  const double std_out = 0.02 / std::sqrt(2.0 * static_cast<double>(l));  // residual outputs
  const bool layernorm = m.norm == NormKind::kLayerNorm;
  std::vector<ParamSpec> s;
  auto normal = [&](std::string n, Shape shape, double sd) {
    s.push_back({std::move(n), std::move(shape), InitKind::kNormal, sd});
  };
  auto fill = [&](std::string n, Shape shape, InitKind k) {
    s.push_back({std::move(n), std::move(shape), k, 0.0});
  };
  auto norm = [&](const std::string& prefix) {
    fill(prefix + ".weight", {h}, InitKind::kOnes);
    if (layernorm) fill(prefix + ".bias", {h}, InitKind::kZeros);
  };
  normal("embed.tok", {v, h}, std_);
  normal("embed.pos", {m.max_positions, h}, std_);
  for (int64_t i = 0; i < l; ++i) {
    const std::string p = fmt::format("layers.{}.", i);
    norm(p + "ln1");
    normal(p + "attn.qkv.weight", {3 * h, h}, std_);
    fill(p + "attn.qkv.bias", {3 * h}, InitKind::kZeros);
    normal(p + "attn.proj.weight", {h, h}, std_out);
    fill(p + "attn.proj.bias", {h}, InitKind::kZeros);
    norm(p + "ln2");
    if (m.activation == Activation::kSwiGlu) {
      normal(p + "mlp.fc1_gate.weight", {f, h}, std_);
      fill(p + "mlp.fc1_gate.bias", {f}, InitKind::kZeros);
      normal(p + "mlp.fc1_up.weight", {f, h}, std_);
      fill(p + "mlp.fc1_up.bias", {f}, InitKind::kZeros);
    } else {
      normal(p + "mlp.fc1.weight", {f, h}, std_);
      fill(p + "mlp.fc1.bias", {f}, InitKind::kZeros);
    }
    normal(p + "mlp.fc2.weight", {h, f}, std_out);
    fill(p + "mlp.fc2.bias", {h}, InitKind::kZeros);
  }
  norm("final_ln");
  if (!m.tied_embeddings) normal("lm_head.weight", {v, h}, std_);
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

Tensor init_param_rows(const ParamSpec& spec, uint64_t seed, int64_t row_begin, int64_t row_end) {
  const int64_t rows = spec.shape[0];
  MP_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= rows,
           "init_param_rows: rows [{}, {}) outside {} of {}", row_begin, row_end, spec.shape.str(),
           spec.name);
  const int64_t row_elems = spec.shape.numel().value / std::max<int64_t>(rows, 1);
  std::vector<int64_t> dims = spec.shape.dims();
  dims[0] = row_end - row_begin;
  Tensor t = Tensor::empty(Shape(dims), kernels::DType::kFloat32, kernels::Device::cpu());
  float* p = t.data<float>();
  const int64_t n = t.numel().value;
  const uint64_t stream = kernels::philox_stream(spec.name);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t global = static_cast<uint64_t>(row_begin * row_elems + i);
    switch (spec.init) {
      case InitKind::kNormal:
        p[i] = static_cast<float>(spec.std * kernels::philox_normal(seed, stream, global));
        break;
      case InitKind::kOnes:
        p[i] = 1.0f;
        break;
      case InitKind::kZeros:
        p[i] = 0.0f;
        break;
    }
  }
  return t;
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
