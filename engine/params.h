// The model's logical parameters (docs/design.md section 3): names, global shapes and init, and a
// name-keyed tensor map used for weights, gradients and optimizer state alike. The names are the
// checkpoint and export keys; later sharding code hands the layer code gathered tensors from the
// same map structure.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/config.h"
#include "kernels/tensor.h"

namespace meshproof::engine {

enum class InitKind : uint8_t { kNormal, kOnes, kZeros };

struct ParamSpec {
  std::string name;      // e.g. "layers.0.attn.qkv.weight"
  kernels::Shape shape;  // global (unsharded) shape
  InitKind init = InitKind::kZeros;
  double std = 0.0;                                        // for kNormal
  bool weight_decay() const { return shape.rank() >= 2; }  // AdamW decays ndim >= 2 only
};

// All parameters in canonical order: embed.tok, embed.pos, layers.{i}.*, final_ln.*, lm_head.
// SwiGLU replaces mlp.fc1.* by mlp.fc1_gate.* and mlp.fc1_up.*; RMSNorm drops the norm biases;
// tied embeddings drop lm_head.weight.
std::vector<ParamSpec> param_specs(const ModelConfig& model);

// Tensors keyed by parameter name, iterated in canonical (insertion) order.
class TensorMap {
 public:
  void insert(const std::string& name, kernels::Tensor t);
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Removes `name` (absent: no-op); references to other entries stay valid.
  void erase(const std::string& name);
  kernels::Tensor& at(const std::string& name);
  const kernels::Tensor& at(const std::string& name) const;
  const std::vector<std::string>& names() const { return names_; }
  void zero_all();

 private:
  std::vector<std::string> names_;
  std::map<std::string, kernels::Tensor> tensors_;
};

// Rows [row_begin, row_end) of parameter `spec` as float32: element with global flat index g gets
// std * philox_normal(seed, philox_stream(name), g) for normal init. Any shard can be materialised
// alone and equals the same rows of the full tensor.
kernels::Tensor init_param_rows(const ParamSpec& spec, uint64_t seed, int64_t row_begin,
                                int64_t row_end);
// Every parameter, whole, in float32 on the CPU.
TensorMap init_params(const ModelConfig& model, uint64_t seed);
// Zero tensors with the parameters' shapes (gradients, optimizer moments), float32.
TensorMap zeros_like_params(const ModelConfig& model);

}  // namespace meshproof::engine
