#include "engine/session_trace.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cmath>

#include "engine/mesh_groups.h"
#include "engine/state_keys.h"
#include "kernels/error.h"
#include "kernels/formats.h"
#include "mesh/padded_gather.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::Tensor;
using mesh::Box;
using mesh::DimSet;
using mesh::MeshDim;

namespace {

// `t` as fp32 values on the host: fp32 as it is; FP8 codes and e8m0 scales decoded to the value
// each code stands for (not dequantized by a scale), so two runs' FP8 bytes compare element by
// element.
Tensor host_fp32(const Tensor& t) {
  const Tensor h = t.device().is_cpu() ? t : t.to(kernels::Device::cpu());
  if (h.dtype() == DType::kFloat32) return h;
  Tensor out = Tensor::empty(h.shape(), DType::kFloat32, kernels::Device::cpu());
  float* o = out.data<float>();
  const int64_t n = h.numel().value;
  const auto* b = static_cast<const uint8_t*>(h.raw_data());
  switch (h.dtype()) {
    case DType::kE4M3:
      for (int64_t i = 0; i < n; ++i) o[i] = kernels::fmt8::e4m3_to_float(b[i]);
      break;
    case DType::kE5M2:
      for (int64_t i = 0; i < n; ++i) o[i] = kernels::fmt8::e5m2_to_float(b[i]);
      break;
    case DType::kE8M0:
      for (int64_t i = 0; i < n; ++i) o[i] = kernels::fmt8::e8m0_to_float(b[i]);
      break;
    default:
      MP_FAIL("trace: FP8 state tensor of dtype {} {} has no fp32 reading",
              kernels::dtype_name(h.dtype()), h.shape().str());
  }
  return out;
}

// Gathered on the shards' device (one collective), then copied to the host for the digests
// and exports that read it.
Tensor host_copy(const Tensor& t) { return t.device().is_cpu() ? t : t.to(kernels::Device::cpu()); }

// The whole global tensor of a sharded entry, on every member of the world (collective).
Tensor gather_whole(mesh::RankComms& comms, const mesh::Layout& layout, const Tensor& local) {
  mesh::Communicator& world = comms.group(groups::kWorld);
  return mesh::gather_padded(world, mesh::member_boxes(world, layout), local,
                             Box::whole(layout.global_shape()));
}

std::vector<const StateEntry*> fp8_entries_in_step_order(const ShardPlan& plan,
                                                         const ShardedState& state) {
  std::map<std::string, const StateEntry*> by_key;
  for (const StateEntry& e : state.entries)
    if (keys::is_fp8(e.key)) by_key[e.key] = &e;
  std::vector<const StateEntry*> out;
  const auto take = [&](const std::string& key) {
    const auto it = by_key.find(key);
    if (it == by_key.end()) return;
    out.push_back(it->second);
    by_key.erase(it);
  };
  for (const ShardedParam& p : plan.params()) {
    if (!p.spec.quantized()) continue;
    for (const char* role : {"input", "weight", "grad_output"})
      for (const char* what : {"scale", "amax_history"})
        take(keys::fp8_delayed(fmt::format("{}/{}", p.spec.linear, role), what));
    const std::string weight = keys::fp8_param(p.spec.name, "");
    for (const StateEntry& e : state.entries)
      if (e.key.starts_with(weight)) take(e.key);
  }
  for (const StateEntry& e : state.entries) take(e.key);
  return out;
}

}  // namespace

TensorDigest digest(const std::string& name, const Tensor& t) {
  TensorDigest d;
  d.name = name;
  d.shape = t.shape();
  d.hash = XXH64(t.raw_data(), static_cast<size_t>(t.nbytes().value), 0);
  const float* x = t.data<float>();
  d.values.assign(x, x + t.numel().value);
  for (int64_t i = 0; i < t.numel().value; ++i) {
    d.sum += x[i];
    d.l2 += static_cast<double>(x[i]) * x[i];
  }
  d.l2 = std::sqrt(d.l2);
  return d;
}

std::map<std::string, Tensor> gather_global(const ShardPlan& plan, mesh::RankComms& comms,
                                            bool grad) {
  std::map<std::string, Tensor> out;
  for (const ShardedParam& p : plan.params())
    out[p.spec.name] = host_copy(gather_whole(comms, p.layout, grad ? p.grad : p.master));
  return out;
}

std::vector<TensorDigest> fp8_state_digests(const ShardPlan& plan, const ShardedState& state,
                                            mesh::RankComms& comms, const std::string& prefix) {
  std::vector<TensorDigest> d;
  for (const StateEntry* e : fp8_entries_in_step_order(plan, state))
    d.push_back(digest(prefix + e->key, gather_whole(comms, e->layout, host_fp32(e->local))));
  return d;
}

const std::vector<DimSet>& all_mesh_groups() {
  static const std::vector<DimSet> groups = [] {
    std::vector<DimSet> g;
    for (unsigned bits = 1; bits < (1u << mesh::kNumMeshDims); ++bits)
      g.push_back(DimSet::from_bits(bits));
    return g;
  }();
  return groups;
}

std::map<std::string, double> collective_seconds(mesh::RankComms& comms) {
  std::map<std::string, double> s;
  for (DimSet d : all_mesh_groups()) {
    mesh::Communicator& c = comms.group(d);
    for (int k = 0; k < mesh::kNumCollectiveKinds; ++k) {
      const auto kind = static_cast<mesh::CollectiveKind>(k);
      s[std::string(mesh::collective_name(kind))] += c.stats(kind).seconds;
    }
  }
  return s;
}

double all_collective_seconds(mesh::RankComms& comms) {
  double total = 0;
  for (const auto& [kind, seconds] : collective_seconds(comms)) total += seconds;
  return total;
}

}  // namespace meshproof::engine
