// The engine's fault hooks (docs/design.md section 19): each fault acts through one of a few
// named hooks (weight gather, amax group, state layout, checkpoint filter, optimizer restore,
// collectives) instead of branches on hot paths. Over 600 lines on purpose: one small function
// per built-in fault, all behind the same FaultHooks interface, so adding a fault is a row in
// harness/scenario/scenario_faults.cc plus one function here.
#include "engine/faults/fault_hooks.h"

#include <fnmatch.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <utility>

#include "engine/checkpoint/state_keys.h"
#include "kernels/core/error.h"
#include "kernels/core/formats.h"

namespace meshproof::engine {

using kernels::Tensor;
using mesh::DimSet;
using mesh::Layout;
using mesh::MeshDim;
using mesh::Placement;

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

namespace {

// stale_columnwise_copy: from faults.from_step on, backward (dgrad) uses the columnwise copy of
// the weight quantized before the previous optimizer step instead of this step's. The weight is
// gathered once or twice per step (reshard_after_forward): the copy of the previous step is the
// one recorded at the first gather of that step. Copies are recorded from step 0 on, whatever
// from_step, so that the first active step has a previous copy.
class StaleColumnwise {
 public:
  StaleColumnwise(FaultInjection f) : f_(std::move(f)) {}
  void operator()(const ParamSpec& p, int64_t step, kernels::QuantizedTensor& w) {
    const int64_t layer = f_.stale_columnwise_layer;
    const bool this_layer = layer < 0 || p.unit == layer;
    Copies& c = copies_[p.linear];
    if (c.step != step) {
      if (c.step >= 0) {
        c.previous = c.current;
        c.has_previous = true;
      }
      c.current = {w.columnwise_data, w.columnwise_scale_inv};
      c.step = step;
    }
    if (this_layer && f_.active(step) && c.has_previous) {
      w.columnwise_data = c.previous.first;
      w.columnwise_scale_inv = c.previous.second;
    }
  }

 private:
  struct Copies {
    int64_t step = -1;                  // step of `current`
    std::pair<Tensor, Tensor> current;  // data, scale_inv
    std::pair<Tensor, Tensor> previous;
    bool has_previous = false;
  };
  FaultInjection f_;
  std::map<std::string, Copies> copies_;  // by linear
};

// stale_fp8_weight_after_update: from faults.from_step on, every gather of an FP8 weight hands
// the GEMMs the whole gathered copy (rowwise and columnwise data and scales) of the previous
// step's first gather, the weight as it was before the last optimizer update. Copies are
// recorded from step 0 on, as StaleColumnwise's; a fresh session (a resumed run) has none, so
// its first step computes with the current weight.
class StaleFp8Weight {
 public:
  StaleFp8Weight(FaultInjection f) : f_(std::move(f)) {}
  void operator()(const ParamSpec& p, int64_t step, kernels::QuantizedTensor& w) {
    Copies& c = copies_[p.linear];
    if (c.step != step) {
      if (c.step >= 0) {
        c.previous = c.current;
        c.has_previous = true;
      }
      c.current = w;
      c.step = step;
    }
    if (f_.active(step) && c.has_previous) w = c.previous;
  }

 private:
  struct Copies {
    int64_t step = -1;  // step of `current`
    kernels::QuantizedTensor current;
    kernels::QuantizedTensor previous;
    bool has_previous = false;
  };
  FaultInjection f_;
  std::map<std::string, Copies> copies_;  // by linear
};

// Whether optimizer_state_not_restored skips `key` (tensor or scalar).
bool optimizer_part_skips(const std::string& part, std::string_view key) {
  if (!keys::is_optim(key)) return false;
  if (part == "all") return true;
  if (part == keys::kExpAvg) return key.ends_with(std::string("/").append(keys::kExpAvg));
  if (part == keys::kExpAvgSq) return key.ends_with(std::string("/").append(keys::kExpAvgSq));
  if (part == "step") return key == keys::kOptimStep;
  MP_FAIL_INPUT(
      "fault optimizer_state_not_restored: unknown part '{}' (all, exp_avg, exp_avg_sq, "
      "step)",
      part);
}

// Rounds every element of fp32 `host` through `dtype` (bf16 or fp16, round to nearest even).
Tensor round_through(const Tensor& host, const std::string& dtype) {
  Tensor t = host.clone();
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel().value; ++i) {
    if (dtype == "bf16")
      p[i] = kernels::fmt8::bf16_to_float(kernels::fmt8::float_to_bf16(p[i]));
    else if (dtype == "fp16")
      p[i] = kernels::fmt8::fp16_to_float(kernels::fmt8::float_to_fp16(p[i]));
    else
      MP_FAIL_INPUT("fault checkpoint_key_dtype: unknown dtype '{}' (bf16, fp16)", dtype);
  }
  return t;
}

// Applies `change` to a host copy of the fp32 tensor `t` and writes it back (the state may
// live on a GPU).
template <typename F>
void edit_fp32(Tensor& t, F change) {
  Tensor h = t.on(kernels::Device::cpu());
  float* p = h.data<float>();
  for (int64_t i = 0; i < h.numel().value; ++i) p[i] = change(p[i]);
  if (!t.device().is_cpu()) t.copy_from(h);
}

// freeze_state: the matching fp32 tensors as the last load left them; after every optimizer
// update of an active step they are written back, so the run trains on with them frozen.
class FrozenState {
 public:
  FrozenState(FaultInjection f) : f_(std::move(f)) {}
  void operator()(FaultHooks::StatePoint point, int64_t step, ShardedState& state) {
    if (point == FaultHooks::StatePoint::kLoaded) {
      frozen_.clear();
      for (const StateEntry& e : state.entries)
        if (e.local.dtype() == kernels::DType::kFloat32 && match_glob(f_.freeze_state, e.key))
          frozen_.emplace(e.key, e.local.to(kernels::Device::cpu()));
      return;
    }
    if (point != FaultHooks::StatePoint::kAfterUpdate || !f_.active(step)) return;
    for (StateEntry& e : state.entries) {
      const auto it = frozen_.find(e.key);
      if (it != frozen_.end()) e.local.copy_from(it->second);
    }
  }

 private:
  FaultInjection f_;
  std::map<std::string, Tensor> frozen_;  // by key: the loaded values (host)
};

// perturb: every element of the matching fp32 tensors, at the start of step perturb_step.
void perturb_state(const FaultInjection& f, int64_t step, ShardedState& state) {
  if (step != f.perturb_step || !f.active(step)) return;
  for (StateEntry& e : state.entries) {
    if (e.local.dtype() != kernels::DType::kFloat32 || !match_glob(f.perturb_tensor, e.key))
      continue;
    if (f.perturb_ulp != 0) {
      const float to = f.perturb_ulp > 0 ? std::numeric_limits<float>::infinity()
                                         : -std::numeric_limits<float>::infinity();
      const int64_t n = f.perturb_ulp > 0 ? f.perturb_ulp : -f.perturb_ulp;
      edit_fp32(e.local, [&](float x) {
        for (int64_t k = 0; k < n; ++k) x = std::nextafter(x, to);
        return x;
      });
    } else {
      const double factor = 1.0 + f.perturb_rel;
      edit_fp32(e.local, [&](float x) { return static_cast<float>(x * factor); });
    }
  }
}

// scale_inv_gathered_bf16: a float32 scale_inv buffer rounded through bf16 (RNE), as a copy.
Tensor scale_inv_through_bf16(const Tensor& s) {
  if (!s.defined() || s.dtype() != kernels::DType::kFloat32) return s;
  Tensor t = s.to(kernels::Device::cpu()).clone();
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel().value; ++i)
    p[i] = kernels::fmt8::bf16_to_float(kernels::fmt8::float_to_bf16(p[i]));
  return t.on(s.device());
}

// vocab_uneven_resume_rows: the checkpoint keys of the vocabulary-row parameters (their masters
// and AdamW moments).
bool vocab_row_key(std::string_view key) {
  for (const char* p : {"embed.tok", "lm_head.weight"})
    if (key == keys::model(p) || key == keys::exp_avg(p) || key == keys::exp_avg_sq(p)) return true;
  return false;
}

// The box the buggy loader reads for `rank`: where exactly one mesh dim shards the rows with a
// plain Shard(0) (FSDP's dp_shard chunks of the vocabulary) over n ranks and n does not divide
// the V rows, the rank's first row is k * floor(V / n) (k: its coordinate on that dim) instead
// of torch.chunk's k * ceil(V / n); the extent stays the rank's own. Rows of the next chunk are
// read twice and the last (n - 1) * (ceil - floor) rows of V never.
mesh::Box floor_offset_box(const Layout& layout, int rank, mesh::Box box) {
  int dims = 0;
  MeshDim row_dim = MeshDim::kDpShard;
  for (MeshDim d : mesh::kAllMeshDims) {
    const Placement& pl = layout.placement(d);
    if (pl.is_shard() && pl.dim == 0 && layout.mesh().size(d) > 1) {
      ++dims;
      row_dim = d;
    }
  }
  if (dims != 1 || layout.placement(row_dim).kind != Placement::Kind::kShard || box.empty())
    return box;
  const int64_t rows = layout.global_shape()[0], n = layout.mesh().size(row_dim);
  if (rows % n == 0) return box;
  box.offset[0] = kernels::Elements(layout.mesh().coord(rank, row_dim) * (rows / n));
  return box;
}

}  // namespace

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
  // uneven_shard_padding_leak: the vocabulary-sized weights (embed.tok, lm_head.weight) keep the
  // zero rows that pad uneven dp_shard chunks, so the logits gain zero classes.
  if (f.uneven_shard_padding_leak)
    h.on_weight_gather_padding([f](const ParamSpec& p, int64_t step, mesh::Padding v) {
      return p.vocab_rows && f.active(step) ? mesh::Padding::kKeep : v;
    });
  // amax_not_reduced: while active every tensor's group is empty (no reduction): each rank
  // scales by its own piece.
  if (f.amax_not_reduced)
    h.on_amax_group([f](std::string_view, Fp8Role, int64_t step, DimSet g) {
      return f.active(step) ? DimSet{} : g;
    });
  // tp_fsdp_left_to_right: the shards are the strided ones but the state describes them as
  // Shard(0) over dp_shard then tp (left to right), so a checkpoint puts their rows at the wrong
  // global offsets (visible when it is loaded on another mesh). Where the left-to-right box has
  // another shape than the real one the real layout is kept (the save would fail otherwise).
  if (f.tp_fsdp_left_to_right)
    h.on_state_layout([](const ParamSpec& p, const Layout& layout, int rank, Layout described) {
      if (layout.placement(MeshDim::kDpShard).kind != Placement::Kind::kStridedShard)
        return described;
      std::vector<Placement> pl = layout.placements();
      pl[static_cast<size_t>(MeshDim::kDpShard)] = Placement::shard(0);
      Layout l2r(layout.mesh(), p.shape, pl);
      return l2r.box(rank).shape() == layout.box(rank).shape() ? l2r : described;
    });
  // hsdp_replicas_not_reduced: gradients not all-reduced over dp_replicate (replicas drift).
  if (f.hsdp_replicas_not_reduced)
    h.on_gradient_replicas([f](int64_t step, bool reduce) { return reduce && !f.active(step); });
  // stale_columnwise_copy needs the executor to hold the quantized weights, so it also takes the
  // FP8 all-gather path (bitwise equal to the high-precision gather, see tests).
  if (f.stale_columnwise_copy) {
    auto stale = std::make_shared<StaleColumnwise>(f);
    h.on_backward_weight([stale](const ParamSpec& p, int64_t step,
                                 kernels::QuantizedTensor& w) { (*stale)(p, step, w); },
                         true);
  }
  // fp8_state_dropped_from_checkpoint: FP8 scales / amax histories (every fp8/ key) left out of
  // the checkpoint; a load of such a checkpoint keeps the live values for them.
  if (f.fp8_state_dropped_from_checkpoint)
    h.on_checkpoint_save(
        {.keeps = [f](std::string_view key,
                      int64_t step) { return !(f.active(step) && keys::is_fp8(key)); },
         .bytes = nullptr});
  // scale_inv_saved_bf16: fp32 scales and scale_invs rounded through bf16 (RNE) when saved.
  if (f.scale_inv_saved_bf16)
    h.on_checkpoint_save(
        {.keeps = nullptr, .bytes = [f](std::string_view key, int64_t step, Tensor host) {
           if (!f.active(step) || host.dtype() != kernels::DType::kFloat32 ||
               !(key.ends_with("/scale") || key.ends_with("/scale_inv")))
             return host;
           Tensor t = host.clone();
           float* p = t.data<float>();
           for (int64_t i = 0; i < t.numel().value; ++i)
             p[i] = kernels::fmt8::bf16_to_float(kernels::fmt8::float_to_bf16(p[i]));
           return t;
         }});
  // data_cursor_not_restored: the resumed run replays batches from step 0.
  if (f.data_cursor_not_restored)
    h.on_checkpoint_restore([f](std::string_view key, int64_t step) {
      return !(f.active(step) && key == keys::kDataCursor);
    });
  // optimizer_state_not_restored: the optimizer state part (all, exp_avg, exp_avg_sq, step).
  if (f.optimizer_state_not_restored)
    h.on_checkpoint_restore([f](std::string_view key, int64_t step) {
      return !(f.active(step) && optimizer_part_skips(f.optimizer_state_part, key));
    });

  // ---- user-defined generic faults (docs/design.md section 23)
  // drop_checkpoint_key: matching keys (tensors and scalars) left out of the checkpoint.
  if (!f.drop_checkpoint_key.empty())
    h.on_checkpoint_save({.keeps =
                              [f](std::string_view key, int64_t step) {
                                return !(f.active(step) && match_glob(f.drop_checkpoint_key, key));
                              },
                          .bytes = nullptr});
  // checkpoint_key_dtype: matching fp32 tensors rounded through the dtype when saved.
  if (!f.checkpoint_key_dtype.empty())
    h.on_checkpoint_save(
        {.keeps = nullptr, .bytes = [f](std::string_view key, int64_t step, Tensor host) {
           if (!f.active(step) || host.dtype() != kernels::DType::kFloat32 ||
               !match_glob(f.checkpoint_key_dtype, key))
             return host;
           return round_through(host, f.checkpoint_dtype);
         }});
  if (!f.freeze_state.empty()) {
    auto frozen = std::make_shared<FrozenState>(f);
    h.on_state([frozen](FaultHooks::StatePoint point, int64_t step, ShardedState& state) {
      (*frozen)(point, step, state);
    });
  }
  if (!f.perturb_tensor.empty())
    h.on_state([f](FaultHooks::StatePoint point, int64_t step, ShardedState& state) {
      if (point == FaultHooks::StatePoint::kStepBegin) perturb_state(f, step, state);
    });
  // amax_group: the matching linears' amax of one role reduced over the given dims.
  if (!f.amax_group_linear.empty()) {
    const DimSet dims = f.amax_group_dims == "none" ? DimSet{} : DimSet::parse(f.amax_group_dims);
    h.on_amax_group([f, dims](std::string_view linear, Fp8Role role, int64_t step, DimSet g) {
      const bool hit = f.active(step) && fp8_role_name(role) == f.amax_group_role &&
                       match_glob(f.amax_group_linear, linear);
      return hit ? dims : g;
    });
  }
  // ---- built-in catalog faults added with issue #20
  if (f.stale_fp8_weight_after_update) {
    auto stale = std::make_shared<StaleFp8Weight>(f);
    h.on_backward_weight([stale](const ParamSpec& p, int64_t step,
                                 kernels::QuantizedTensor& w) { (*stale)(p, step, w); },
                         true);
  }
  // rope_positions_local_under_sp: every sequence shard's tokens rotated as if it started at
  // position 0.
  if (f.rope_positions_local_under_sp)
    h.on_rope_positions([f](int64_t step, bool global) { return global && !f.active(step); });
  // swiglu_gate_up_swizzled_in_checkpoint: the saved shard of every model/...mlp.fc1_gate.weight
  // and .fc1_up.weight holds its rows' second half first (the shard's two halves exchanged).
  if (f.swiglu_gate_up_swizzled_in_checkpoint)
    h.on_checkpoint_save(
        {.keeps = nullptr, .bytes = [f](std::string_view key, int64_t step, Tensor host) {
           if (!f.active(step) || !key.starts_with(keys::kModel) ||
               !(key.ends_with("mlp.fc1_gate.weight") || key.ends_with("mlp.fc1_up.weight")) ||
               host.shape().rank() < 1 || host.shape()[0] < 2)
             return host;
           const int64_t rows = host.shape()[0], half = rows / 2;
           Tensor t = host.clone();
           t.slice_rows(0, rows - half).copy_from(host.slice_rows(half, rows));
           t.slice_rows(rows - half, rows).copy_from(host.slice_rows(0, half));
           return t;
         }});
  if (f.nvfp4_rht_on_one_operand) {
    // The input's columnwise copy loses its RHT; the output gradient's keeps it.
    h.on_nvfp4_options([f](std::string_view, Fp8Role role, int64_t step, kernels::Nvfp4Options o) {
      if (f.active(step) && role == Fp8Role::kInput) o.rht = false;
      return o;
    });
  }
  if (f.nvfp4_block_scale_pow2) {
    h.on_nvfp4_options([f](std::string_view, Fp8Role, int64_t step, kernels::Nvfp4Options o) {
      if (f.active(step)) o.pow2_block_scales = true;
      return o;
    });
  }
  // amax_history_restored_from_init: the delayed-scaling amax histories keep the fresh engine's
  // init values (zeros) on load; the scales are restored.
  if (f.amax_history_restored_from_init)
    h.on_checkpoint_restore([f](std::string_view key, int64_t step) {
      return !(f.active(step) && keys::is_fp8(key) && key.ends_with("/amax_history"));
    });
  // optimizer_step_advanced_before_load: a synthetic step before the load advanced the step
  // counter, and the load keeps the advance.
  if (f.optimizer_step_advanced_before_load)
    h.on_restored_scalar([f](std::string_view key, int64_t step, int64_t value) {
      return f.active(step) && key == keys::kOptimStep ? value + 1 : value;
    });
  // grad_accum_last_micro_batch_only: each micro-batch's gradients replace the accumulated ones.
  if (f.grad_accum_last_micro_batch_only)
    h.on_gradient_accumulation(
        [f](int64_t step, bool accumulate) { return accumulate && !f.active(step); });
  // ---- catalog entries (issue #20)
  // scale_inv_gathered_bf16: the per-tensor scale_inv of every FP8 all-gathered weight arrives
  // rounded through bf16; the FP8 bytes are the correctly scaled ones.
  if (f.scale_inv_gathered_bf16)
    h.on_gathered_weight([f](const ParamSpec&, int64_t step, kernels::QuantizedTensor& w) {
      const bool per_tensor = w.mode == kernels::ScalingMode::kCurrentTensor ||
                              w.mode == kernels::ScalingMode::kDelayedTensor;
      if (!f.active(step) || !per_tensor) return;
      w.rowwise_scale_inv = scale_inv_through_bf16(w.rowwise_scale_inv);
      w.columnwise_scale_inv = scale_inv_through_bf16(w.columnwise_scale_inv);
    });
  // vocab_uneven_resume_rows: the loader reads the vocabulary-row tensors at floor-sized chunk
  // offsets.
  if (f.vocab_uneven_resume_rows)
    h.on_load_box([f](std::string_view key, const Layout& layout, int rank, int64_t step,
                      mesh::Box box) {
      return f.active(step) && vocab_row_key(key) ? floor_offset_box(layout, rank, std::move(box))
                                                  : box;
    });
  // block_scale_padding_reshard: every member's MXFP8 block scales keep TransformerEngine's
  // swizzle padding (rowwise rows to 128, columnwise rows to 4) through the all-gather.
  if (f.block_scale_padding_reshard)
    h.on_block_scale_padding([f](const ParamSpec&, int64_t step, ScalePadding padding) {
      return f.active(step) ? ScalePadding{.rowwise_rows = 128, .columnwise_rows = 4} : padding;
    });
  // router_not_fp32: the MoE router GEMM runs on bf16 operands with a bf16 output.
  if (f.router_not_fp32)
    h.on_router_precision([f](int64_t step, bool fp32) { return fp32 && !f.active(step); });
  // nvfp4_global_amax_not_reduced: the weights' amax group is empty while active, so under the
  // FP4 all-gather (the only NVFP4 weight quantization that reduces over a group: the gathered
  // weights reach the recipe prequantized) each rank takes its shard's global amax for the
  // second-level scale. Activations and gradients keep their groups.
  if (f.nvfp4_global_amax_not_reduced)
    h.on_amax_group([f](std::string_view, Fp8Role role, int64_t step, DimSet g) {
      return f.active(step) && role == Fp8Role::kWeight ? DimSet{} : g;
    });
  // tp_weight_amax_all_reduced: every weight amax is MAX-reduced over tp once more.
  if (f.tp_weight_amax_all_reduced)
    h.on_extra_amax_group([f](std::string_view, int64_t step, DimSet extra) {
      return f.active(step) ? DimSet{MeshDim::kTp} : extra;
    });
  // fp8_all_gather_in_bf16: the FP8 all-gather of every quantized weight moves bf16 values (the
  // engine then quantizes the gathered weight).
  if (f.fp8_all_gather_in_bf16)
    h.on_collective([f](const FaultHooks::CollectiveSite& site, FaultHooks::CollectiveAction a) {
      if (f.active(site.step) && site.fp8) a.dtype = kernels::DType::kBFloat16;
      return a;
    });
  // skip_collective: matching collectives are not issued.
  if (!f.skip_collective_tensor.empty()) {
    const mesh::CollectiveKind kind = parse_fault_collective_kind(f.skip_collective_kind);
    const DimSet group = DimSet::parse(f.skip_collective_group);
    h.on_collective(
        [f, kind, group](const FaultHooks::CollectiveSite& site, FaultHooks::CollectiveAction a) {
          if (f.active(site.step) && site.kind == kind && site.group == group &&
              match_glob(f.skip_collective_tensor, site.tensor))
            a.run = false;
          return a;
        });
  }
  // collective_dtype: matching all-gathers move their values through the dtype.
  if (!f.collective_dtype_tensor.empty()) {
    const mesh::CollectiveKind kind = parse_fault_collective_kind(f.collective_dtype_kind);
    const kernels::DType dtype = parse_fault_wire_dtype(f.collective_dtype_dtype);
    h.on_collective(
        [f, kind, dtype](const FaultHooks::CollectiveSite& site, FaultHooks::CollectiveAction a) {
          if (f.active(site.step) && site.kind == kind &&
              match_glob(f.collective_dtype_tensor, site.tensor))
            a.dtype = dtype;
          return a;
        });
  }
  // expert_grad_scaled_by_ep: the owner's expert weight gradients x ep (no effect at ep = 1).
  if (f.expert_grad_scaled_by_ep)
    h.on_expert_grad_factor(
        [f](int64_t step, int ep, double factor) { return f.active(step) ? factor * ep : factor; });
  // moe_final_backward_skips_experts: the gradient reductions of the expert parameters are not
  // issued (with deferred sync they run once, after the last micro-batch's backward).
  if (f.moe_final_backward_skips_experts)
    h.on_collective([f](const FaultHooks::CollectiveSite& site, FaultHooks::CollectiveAction a) {
      const bool reduction = (site.kind == mesh::CollectiveKind::kReduceScatter &&
                              site.group == DimSet{MeshDim::kDpShard}) ||
                             (site.kind == mesh::CollectiveKind::kAllReduce &&
                              site.group == DimSet{MeshDim::kDpReplicate});
      if (f.active(site.step) && reduction &&
          site.tensor.find(".moe.experts.") != std::string_view::npos)
        a.run = false;
      return a;
    });
  // expert_split_padding_too_small: the experts' wgrad inputs come from one grouped columnwise
  // quantization with every expert's rows padded to 16 (GptModel::moe_forward).
  if (f.expert_split_padding_too_small)
    h.on_expert_split_padding([f](int64_t step, int64_t padding) {
      return f.active(step) ? f.expert_split_padding_rows : padding;
    });
  // pp_last_backward_sync_skipped: the first stage's last backward does not reduce.
  if (f.pp_last_backward_sync_skipped)
    h.on_pp_last_backward([f](int stage, int64_t step, bool reduce) {
      return reduce && !(f.active(step) && stage == 0);
    });
  // pp_microbatch_grads_overwritten: the last stage overwrites its gradient accumulators.
  if (f.pp_microbatch_grads_overwritten)
    h.on_pp_accumulation([f](int stage, int stages, int64_t step, bool accumulate) {
      return accumulate && !(f.active(step) && stage == stages - 1);
    });
  // pp_tied_embedding_grad_not_synced: the end stages do not exchange the tied gradient parts.
  if (f.pp_tied_embedding_grad_not_synced)
    h.on_pp_tied_sync([f](int64_t step, bool exchange) { return exchange && !f.active(step); });
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
