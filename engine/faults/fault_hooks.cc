// The engine's fault hooks (docs/design.md section 19): each fault acts through one of a few
// named hooks (weight gather, amax group, state layout, checkpoint filter, optimizer restore,
// collectives) instead of branches on hot paths. This file holds the hook points (each folds over
// the hooks registered on it, from the correct behaviour), the names the generic faults' globs
// can match, and make_fault_hooks, which registers the enabled faults' hooks through the runs of
// engine/faults/fault_hooks_internal.h: one small registration per built-in fault, all behind the
// same FaultHooks interface, so adding a fault is a row in harness/faults/scenario_faults.cc plus
// one registration at the end of the last run (fault_hooks_parallel.cc).
#include "engine/faults/fault_hooks.h"

#include <fnmatch.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/checkpoint/state_keys.h"
#include "engine/faults/fault_hooks_internal.h"
#include "kernels/core/error.h"
#include "mesh/core/communicator.h"
#include "mesh/core/layout.h"

namespace meshproof::engine {

using kernels::Tensor;
using mesh::DimSet;
using mesh::Layout;

mesh::Padding FaultHooks::weight_gather_padding(const ParamSpec& p, int64_t step) const {
  mesh::Padding v = mesh::Padding::kCut;
  for (const auto& h : padding_) v = h(p, step, v);
  return v;
}

DimSet FaultHooks::amax_group(std::string_view linear, Fp8Role role, int64_t step,
                              DimSet group) const {
  for (const auto& h : amax_) group = h(linear, role, step, group);
  return group;
}

Layout FaultHooks::state_layout(const ParamSpec& p, const Layout& layout, int rank) const {
  Layout described = layout;
  for (const auto& h : state_layout_) described = h(p, layout, rank, std::move(described));
  return described;
}

bool FaultHooks::gradient_replicas(int64_t step) const {
  bool reduce = true;
  for (const auto& h : replicas_) reduce = h(step, reduce);
  return reduce;
}

void FaultHooks::backward_weight(const ParamSpec& p, int64_t step,
                                 kernels::QuantizedTensor& w) const {
  for (const auto& h : backward_) h(p, step, w);
}

bool FaultHooks::checkpoint_keeps(std::string_view key, int64_t step) const {
  for (const auto& h : save_)
    if (h.keeps && !h.keeps(key, step)) return false;
  return true;
}

Tensor FaultHooks::checkpoint_bytes(std::string_view key, int64_t step, Tensor host) const {
  for (const auto& h : save_)
    if (h.bytes) host = h.bytes(key, step, std::move(host));
  return host;
}

bool FaultHooks::restores(std::string_view key, int64_t step) const {
  for (const auto& h : restore_)
    if (!h(key, step)) return false;
  return true;
}

void FaultHooks::state(StatePoint point, int64_t step, ShardedState& state) const {
  for (const auto& h : state_) h(point, step, state);
}

bool match_glob(std::string_view glob, std::string_view text) {
  // The globs of `meshproof ckpt inspect --key` (fnmatch without flags), so a glob that lists the
  // keys of a checkpoint names the same keys in a fault.
  return ::fnmatch(std::string(glob).c_str(), std::string(text).c_str(), 0) == 0;
}

std::vector<FaultKey> fault_key_names(const Config& config, bool fp8_params) {
  std::vector<FaultKey> out;
  const std::vector<ParamSpec> specs = param_specs(config.model);
  for (const ParamSpec& p : specs) {
    out.push_back({keys::model(p.name), true});
    out.push_back({keys::exp_avg(p.name), true});
    out.push_back({keys::exp_avg_sq(p.name), true});
  }
  const RecipeKind rk = config.recipe.kind;
  if (rk == RecipeKind::kDelayed)
    for (const std::string& l : fault_linear_names(config))
      for (Fp8Role role : {Fp8Role::kInput, Fp8Role::kWeight, Fp8Role::kGradOutput})
        for (const char* what : {"scale", "amax_history"})
          out.push_back(
              {keys::fp8_delayed(l + "/" + std::string(fp8_role_name(role)), what), true});
  if (fp8_params)
    for (const ParamSpec& p : specs) {
      if (!p.quantized()) continue;
      out.push_back({keys::fp8_param(p.name, "rowwise_data"), false});
      if (rk != RecipeKind::kMxfp8) {
        out.push_back({keys::fp8_param(p.name, "scale_inv"), true});
        continue;
      }
      for (const char* part : {"rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"})
        out.push_back({keys::fp8_param(p.name, part), false});
    }
  for (const char* scalar : {keys::kOptimStep, keys::kDataCursor, keys::kRngOffset, keys::kLrStep})
    out.push_back({scalar, false});
  return out;
}

std::vector<std::string> fault_linear_names(const Config& config) {
  std::vector<std::string> out;
  for (const ParamSpec& p : param_specs(config.model))
    if (p.quantized()) out.push_back(p.linear);
  return out;
}

kernels::Nvfp4Options FaultHooks::nvfp4_options(std::string_view linear, Fp8Role role, int64_t step,
                                                kernels::Nvfp4Options o) const {
  for (const auto& h : nvfp4_) o = h(linear, role, step, o);
  return o;
}

int64_t FaultHooks::restored_scalar(std::string_view key, int64_t step, int64_t value) const {
  for (const auto& h : restored_scalar_) value = h(key, step, value);
  return value;
}

bool FaultHooks::accumulates_gradients(int64_t step) const {
  bool accumulate = true;
  for (const auto& h : accumulation_) accumulate = h(step, accumulate);
  return accumulate;
}

void FaultHooks::gathered_weight(const ParamSpec& p, int64_t step,
                                 kernels::QuantizedTensor& w) const {
  for (const auto& h : gathered_) h(p, step, w);
}

mesh::Box FaultHooks::load_box(std::string_view key, const Layout& layout, int rank,
                               int64_t step) const {
  mesh::Box box = layout.box(rank);
  for (const auto& h : load_box_) box = h(key, layout, rank, step, std::move(box));
  return box;
}

ScalePadding FaultHooks::block_scale_padding(const ParamSpec& p, int64_t step) const {
  ScalePadding padding;
  for (const auto& h : block_scale_padding_) padding = h(p, step, padding);
  return padding;
}

FaultHooks::CollectiveAction FaultHooks::collective(const CollectiveSite& site) const {
  CollectiveAction a;
  for (const auto& h : collective_) a = h(site, a);
  return a;
}

DimSet FaultHooks::extra_amax_group(std::string_view linear, int64_t step) const {
  DimSet extra;
  for (const auto& h : extra_amax_) extra = h(linear, step, extra);
  return extra;
}

mesh::CollectiveKind parse_fault_collective_kind(std::string_view name) {
  for (mesh::CollectiveKind k :
       {mesh::CollectiveKind::kAllGather, mesh::CollectiveKind::kReduceScatter,
        mesh::CollectiveKind::kAllReduce})
    if (mesh::collective_name(k) == name) return k;
  MP_FAIL_INPUT("unknown collective kind '{}' (all_gather, reduce_scatter, all_reduce)", name);
}

kernels::DType parse_fault_wire_dtype(std::string_view name) {
  if (name == "bf16") return kernels::DType::kBFloat16;
  if (name == "fp16") return kernels::DType::kFloat16;
  MP_FAIL_INPUT("unknown collective dtype '{}' (bf16, fp16)", name);
}

std::vector<std::string> fault_param_names(const Config& config) {
  std::vector<std::string> out;
  for (const ParamSpec& p : param_specs(config.model)) out.push_back(p.name);
  return out;
}

bool FaultHooks::rope_global_positions(int64_t step) const {
  bool global = true;
  for (const auto& h : rope_) global = h(step, global);
  return global;
}

bool FaultHooks::router_fp32(int64_t step) const {
  bool fp32 = true;
  for (const auto& h : router_) fp32 = h(step, fp32);
  return fp32;
}

FaultHooks make_fault_hooks(const FaultInjection& f) {
  FaultHooks h;
  // In this order (engine/faults/fault_hooks_internal.h): the hooks of one point fold in
  // registration order.
  fault_detail::add_first_builtin_faults(f, h);
  fault_detail::add_generic_faults(f, h);
  fault_detail::add_issue20_builtin_faults(f, h);
  fault_detail::add_parallel_faults(f, h);
  return h;
}

double FaultHooks::expert_grad_factor(int64_t step, int ep) const {
  double factor = 1.0;
  for (const auto& h : expert_grad_) factor = h(step, ep, factor);
  return factor;
}

int64_t FaultHooks::expert_split_padding(int64_t step) const {
  int64_t padding = 0;
  for (const auto& h : expert_split_padding_) padding = h(step, padding);
  return padding;
}

bool FaultHooks::pp_accumulates(int stage, int stages, int64_t step) const {
  bool accumulate = true;
  for (const auto& h : pp_accumulation_) accumulate = h(stage, stages, step, accumulate);
  return accumulate;
}

bool FaultHooks::pp_last_backward(int stage, int64_t step) const {
  bool reduce = true;
  for (const auto& h : pp_last_backward_) reduce = h(stage, step, reduce);
  return reduce;
}

bool FaultHooks::pp_tied_embedding_synced(int64_t step) const {
  bool exchange = true;
  for (const auto& h : pp_tied_sync_) exchange = h(step, exchange);
  return exchange;
}

}  // namespace meshproof::engine
