#include "ckpt_test_state.h"

#include <cstring>
#include <functional>
#include <random>

#include "engine/checkpoint/state_keys.h"

namespace meshproof::engine::testing {

using kernels::DType;
using kernels::Shape;
using mesh::MeshDim;
using mesh::Placement;

const std::vector<SyntheticKey>& synthetic_keys() {
  // Shapes chosen uneven for every mesh of the matrix (13 rows over 4 or 8 shards, 3 rows over
  // 4 ranks leaves empty boxes, 10 columns over tp 2 ... ).
  static const std::vector<SyntheticKey> keys = {
      {"model/layers.0.attn.qkv.weight", Shape{13, 8}, DType::kFloat32, "fsdp_col"},
      {"model/layers.0.attn.proj.weight", Shape{7, 10}, DType::kFloat32, "fsdp_row"},
      {"model/layers.0.attn.qkv.bias", Shape{3}, DType::kFloat32, "fsdp_col"},
      {"model/final_ln.weight", Shape{5}, DType::kFloat32, "fsdp"},
      {"optim/layers.0.attn.qkv.weight/exp_avg", Shape{13, 8}, DType::kFloat32, "fsdp_col"},
      {"optim/layers.0.attn.qkv.weight/exp_avg_sq", Shape{13, 8}, DType::kFloat32, "fsdp_col"},
      {"fp8/layers.0.attn.qkv/input/scale", Shape{1}, DType::kFloat32, "replicated"},
      {"fp8/layers.0.attn.qkv/input/amax_history", Shape{16}, DType::kFloat32, "replicated"},
      {"fp8_params/layers.0.attn.qkv.weight/data", Shape{13, 8}, DType::kE4M3, "fsdp_col"},
      {"fp8_params/layers.0.attn.qkv.weight/scale_inv", Shape{1}, DType::kFloat32, "replicated"},
      {"model/embed.tok_bf16_copy", Shape{9, 4}, DType::kBFloat16, "fsdp"},
      {"rng/philox_state", Shape{2}, DType::kInt64, "replicated"},
      {"fp8/layers.0.mlp.fc1/weight/scale_bytes", Shape{64}, DType::kE8M0, "tp"},
  };
  return keys;
}

mesh::Layout synthetic_layout(const SyntheticKey& k, const mesh::DeviceMesh& m) {
  const int tp = m.size(MeshDim::kTp);
  std::vector<Placement> p(3, Placement::replicate());
  if (k.role == "fsdp_col") {
    p[1] = tp > 1 ? Placement::strided_shard(0, tp) : Placement::shard(0);
    p[2] = Placement::shard(0);
  } else if (k.role == "fsdp_row") {
    p[1] = Placement::shard(0);
    p[2] = Placement::shard(1);
  } else if (k.role == "fsdp") {
    p[1] = Placement::shard(0);
  } else if (k.role == "tp") {
    p[2] = Placement::shard(0);
  }
  return mesh::Layout(m, k.shape, p);
}

kernels::Tensor synthetic_global(const SyntheticKey& k, uint64_t seed) {
  std::mt19937_64 gen(seed * 1000003u + std::hash<std::string>{}(k.key));
  kernels::Tensor t = kernels::Tensor::empty(k.shape, k.dtype, kernels::Device::cpu());
  if (k.dtype == DType::kFloat32) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel().value; ++i) p[i] = normal(gen);
  } else {
    auto* p = static_cast<uint8_t*>(t.raw_data());
    for (int64_t i = 0; i < t.nbytes().value; ++i) p[i] = static_cast<uint8_t>(gen());
  }
  return t;
}

std::map<std::string, int64_t> synthetic_scalars(uint64_t seed) {
  return {{keys::kDataCursor, static_cast<int64_t>(100 + seed)},
          {keys::kOptimStep, static_cast<int64_t>(10 + seed)},
          {keys::kLrStep, static_cast<int64_t>(10 + seed)},
          {keys::kRngOffset, static_cast<int64_t>(1) << 40}};
}

ShardedState make_state(const mesh::DeviceMesh& m, int rank, uint64_t seed) {
  ShardedState s;
  for (const SyntheticKey& k : synthetic_keys()) {
    mesh::Layout layout = synthetic_layout(k, m);
    kernels::Tensor local = mesh::shard(synthetic_global(k, seed), layout, rank);
    s.entries.push_back(StateEntry{k.key, layout, local});
  }
  s.scalars = synthetic_scalars(seed);
  return s;
}

}  // namespace meshproof::engine::testing
