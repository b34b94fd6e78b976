#include "engine/session/session_trace.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "engine/checkpoint/state_keys.h"
#include "engine/parallel/mesh_groups.h"
#include "kernels/core/error.h"
#include "kernels/core/formats.h"
#include "mesh/core/padded_gather.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::Tensor;
using mesh::Box;
using mesh::DimSet;

namespace {

// `t` as fp32 values on the host: fp32 as it is; FP8 codes and e8m0 scales decoded to the value
// each code stands for (not dequantized by a scale), so two runs' FP8 bytes compare element by
// element.
Tensor host_fp32(const Tensor& t) {
  const Tensor h = t.on(kernels::Device::cpu());
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

// The whole global tensor of a sharded entry, on every member of the world (collective).
Tensor gather_whole(mesh::RankComms& comms, const mesh::Layout& layout, const Tensor& local) {
  mesh::Communicator& world = comms.group(groups::kWorld);
  return mesh::gather_padded(world, mesh::member_boxes(world, layout), local,
                             Box::whole(layout.global_shape()));
}

// A stage's FP8 entries in the order a step uses them, each with the model index of the
// quantized parameter it belongs to (SIZE_MAX: an fp8/ entry of no parameter, after them in
// state order). The plan's parameters are in model order, so with one stage this is the step
// order; with stages, the stages' lists merged by model index are the one-stage order.
std::vector<std::pair<const StateEntry*, size_t>> fp8_entries_in_step_order(
    const ShardPlan& plan, const ShardedState& state) {
  std::map<std::string, const StateEntry*> by_key;
  for (const StateEntry& e : state.entries)
    if (keys::is_fp8(e.key)) by_key[e.key] = &e;
  std::vector<std::pair<const StateEntry*, size_t>> out;
  const auto take = [&](const std::string& key, size_t index) {
    const auto it = by_key.find(key);
    if (it == by_key.end()) return;
    out.emplace_back(it->second, index);
    by_key.erase(it);
  };
  for (const ShardedParam& p : plan.params()) {
    if (!p.spec.quantized()) continue;
    for (const char* role : {"input", "weight", "grad_output"})
      for (const char* what : {"scale", "amax_history"})
        take(keys::fp8_delayed(fmt::format("{}/{}", p.spec.linear, role), what), p.model_index);
    const std::string weight = keys::fp8_param(p.spec.name, "");
    for (const StateEntry& e : state.entries)
      if (e.key.starts_with(weight)) take(e.key, p.model_index);
  }
  for (const StateEntry& e : state.entries) take(e.key, std::numeric_limits<size_t>::max());
  return out;
}

// One FP8 entry's gathered global fp32 values with its step-order position.
struct Fp8Global {
  std::string key;
  size_t index = 0;  // model index of its parameter (SIZE_MAX: none)
  Tensor values;     // global, fp32, host
};

// `entries` of pipeline stage `root` on every rank of `pp` (collective over the pp group): the
// count, then per entry its key, model index and shape, then its values. The members of a pp
// group hold the same place of every stage, so each stage's gathered tensors travel once.
void broadcast_stage_entries(mesh::Communicator& pp, int root, std::vector<Fp8Global>& entries) {
  const bool mine = pp.rank() == root;
  Tensor count = Tensor::from_vector<int64_t>({1}, {static_cast<int64_t>(entries.size())});
  pp.broadcast(count, root);
  if (!mine) entries.assign(static_cast<size_t>(count.data<int64_t>()[0]), Fp8Global{});
  for (Fp8Global& g : entries) {
    // [key length, model index (-1: none), rank, dims...]: FP8 state tensors have at most 2 dims
    // (scales, amax histories, weights); 8 leaves room.
    constexpr int kMaxDims = 8;
    std::vector<int64_t> head(3 + kMaxDims, 0);
    if (mine) {
      MP_CHECK(g.values.shape().rank() <= kMaxDims, "trace: FP8 state tensor {} has shape {}",
               g.key, g.values.shape().str());
      head[0] = static_cast<int64_t>(g.key.size());
      head[1] = g.index == std::numeric_limits<size_t>::max() ? -1 : static_cast<int64_t>(g.index);
      head[2] = g.values.shape().rank();
      for (int d = 0; d < g.values.shape().rank(); ++d) head[3 + d] = g.values.shape()[d];
    }
    Tensor h = Tensor::from_vector<int64_t>({static_cast<int64_t>(head.size())}, head);
    pp.broadcast(h, root);
    head = h.to_vector<int64_t>();
    Tensor name = Tensor::zeros({head[0]}, DType::kUInt8, kernels::Device::cpu());
    if (mine) std::memcpy(name.raw_data(), g.key.data(), g.key.size());
    pp.broadcast(name, root);
    if (!mine) {
      g.key.assign(static_cast<const char*>(name.raw_data()), static_cast<size_t>(head[0]));
      g.index = head[1] < 0 ? std::numeric_limits<size_t>::max() : static_cast<size_t>(head[1]);
      std::vector<int64_t> dims(head.begin() + 3, head.begin() + 3 + head[2]);
      g.values = Tensor::empty(kernels::Shape(dims), DType::kFloat32, kernels::Device::cpu());
    }
    if (g.values.numel().value > 0) pp.broadcast(g.values, root);
  }
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
  // Gathered on the shards' device (one collective), then copied to the host for the digests
  // and exports that read it.
  for (const ShardedParam& p : plan.params())
    out[p.spec.name] =
        gather_whole(comms, p.layout, grad ? p.grad : p.master).on(kernels::Device::cpu());
  return out;
}

std::vector<TensorDigest> fp8_state_digests(const ShardPlan& plan, const ShardedState& state,
                                            mesh::RankComms& comms, const std::string& prefix) {
  std::vector<Fp8Global> mine;
  for (const auto& [e, index] : fp8_entries_in_step_order(plan, state))
    mine.push_back({e->key, index, gather_whole(comms, e->layout, host_fp32(e->local))});
  mesh::Communicator& pp = comms.group(groups::kPp);
  std::vector<Fp8Global> all;
  if (pp.size() == 1) {
    all = std::move(mine);
  } else {
    // Each stage's entries on every rank, then in the one-stage order: by the model index of
    // their parameter (each quantized parameter lives on one stage), the entries of no
    // parameter last in stage order.
    for (int s = 0; s < pp.size(); ++s) {
      std::vector<Fp8Global> part = s == pp.rank() ? mine : std::vector<Fp8Global>{};
      broadcast_stage_entries(pp, s, part);
      for (Fp8Global& g : part) all.push_back(std::move(g));
    }
    std::stable_sort(all.begin(), all.end(),
                     [](const Fp8Global& a, const Fp8Global& b) { return a.index < b.index; });
  }
  std::vector<TensorDigest> d;
  for (const Fp8Global& g : all) d.push_back(digest(prefix + g.key, g.values));
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
