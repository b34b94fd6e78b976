// The hooks of the user-defined generic faults (docs/design.md section 23): checkpoint keys
// dropped or rounded through a narrower dtype when saved, state tensors frozen at their loaded
// values or perturbed by ulps or a relative factor, and the amax of matching linears reduced over
// given dims. One run of make_fault_hooks (engine/faults/fault_hooks_internal.h), apart from the
// built-in faults: each acts on whatever its parameters' globs name (match_glob), not at one
// bug's site, with the host-side state edits only these faults make.
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "engine/checkpoint/sharded_state.h"
#include "engine/faults/fault_hooks.h"
#include "engine/faults/fault_hooks_internal.h"
#include "engine/faults/faults.h"
#include "engine/model/recipe.h"
#include "kernels/core/error.h"
#include "kernels/core/formats.h"
#include "kernels/core/tensor.h"
#include "mesh/core/device_mesh.h"

namespace meshproof::engine {

using kernels::Tensor;
using mesh::DimSet;

namespace {

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

}  // namespace

namespace fault_detail {

void add_generic_faults(const FaultInjection& f, FaultHooks& h) {
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
}

}  // namespace fault_detail

}  // namespace meshproof::engine
