#include "engine/model/recipe.h"

#include "kernels/core/error.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/random/philox.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::QuantizedTensor;
using kernels::Tensor;

std::string_view fp8_role_name(Fp8Role r) {
  switch (r) {
    case Fp8Role::kInput:
      return "input";
    case Fp8Role::kWeight:
      return "weight";
    case Fp8Role::kGradOutput:
      return "grad_output";
  }
  return "?";
}

// The tensor hook reduces where the amax lives (a session's communicators take device buffers);
// the float hook works on host floats, so amaxes computed on a GPU travel through a host copy and
// back.
void Fp8Recipe::reduce(const std::string& linear, Fp8Role role, Tensor& amax, int64_t n) {
  if (reduce_amax_tensor_) {
    MP_CHECK(amax.dtype() == DType::kFloat32 && 0 <= n && n <= amax.numel().value,
             "Fp8Recipe::reduce: the first {} amaxes of {}", n, amax.describe());
    Tensor first = amax.view({amax.numel().value}).slice_rows(0, n);
    reduce_amax_tensor_(linear, role, first);
    return;
  }
  if (amax.device().is_cpu()) {
    reduce_amax_(linear, role, amax.data<float>(), n);
    return;
  }
  Tensor host = amax.to(kernels::Device::cpu());
  reduce_amax_(linear, role, host.data<float>(), n);
  amax.copy_from(host);
}

Fp8Recipe::Fp8Recipe(const RecipeConfig& config, AmaxHook reduce_amax, uint64_t seed)
    : config_(config),
      reduce_amax_(std::move(reduce_amax)),
      seed_(seed),
      enabled_(config.kind != RecipeKind::kFp32 && config.kind != RecipeKind::kBf16) {}

DType Fp8Recipe::format(Fp8Role role) const {
  // TE recipe.Format: HYBRID is E4M3 forward and E5M2 for gradients, E4M3 is E4M3 everywhere.
  const bool hybrid = fp8_format_of(config_) == Fp8Format::kHybrid;
  return hybrid && role == Fp8Role::kGradOutput ? DType::kE5M2 : DType::kE4M3;
}

kernels::GemmOptions Fp8Recipe::options(kernels::GemmRole role, bool accumulate) const {
  const bool per_tensor =
      config_.kind == RecipeKind::kDelayed || config_.kind == RecipeKind::kCurrent;
  return {.accumulate = accumulate,
          .fast_accumulation = per_tensor && role == kernels::GemmRole::kFprop};
}

QuantizedTensor Fp8Recipe::quantize(const std::string& linear, Fp8Role role, const Tensor& x,
                                    kernels::Usage usage, const TensorPlace& place) {
  MP_CHECK(enabled_, "Fp8Recipe::quantize called for recipe {}", recipe_name(config_.kind));
  const DType fmt = format(role);
  const std::string key = fmt::format("{}/{}", linear, fp8_role_name(role));
  if (role == Fp8Role::kWeight) {
    const auto pre = prequantized_.find(linear);
    if (pre != prequantized_.end()) {
      if (config_.kind == RecipeKind::kDelayed && !recompute_) {
        kernels::DelayedScalingState& st = states_.at(key);
        kernels::record_amax(st, pre->second.local_amax);
        forward_scales_[key] = st.scale.clone();
      }
      return pre->second.q;
    }
  }
  switch (config_.kind) {
    case RecipeKind::kCurrent: {
      // amax -> MAX-reduce over the amax group -> scale, as three separate steps.
      Tensor amax = kernels::compute_amax(x);
      reduce(linear, role, amax, 1);
      const Tensor scale = kernels::compute_current_scale(
          amax, fmt, static_cast<float>(config_.eps), power_2_scale_of(config_));
      return kernels::quantize_per_tensor(x, scale, fmt, usage,
                                          kernels::ScalingMode::kCurrentTensor, amax);
    }
    case RecipeKind::kDelayed: {
      auto it = states_.find(key);
      if (it == states_.end()) {
        it = states_
                 .emplace(key,
                          kernels::make_delayed_scaling_state(config_.amax_history_len, x.device()))
                 .first;
      }
      Tensor amax = kernels::compute_amax(x);
      if (recompute_ && role != Fp8Role::kGradOutput) {
        const auto used = forward_scales_.find(key);
        MP_CHECK(used != forward_scales_.end(), "recompute of {} before its forward", key);
        return kernels::quantize_per_tensor(x, used->second, fmt, usage,
                                            kernels::ScalingMode::kDelayedTensor, amax);
      }
      kernels::record_amax(it->second, amax);
      if (role != Fp8Role::kGradOutput) forward_scales_[key] = it->second.scale.clone();
      return kernels::quantize_per_tensor(x, it->second.scale, fmt, usage,
                                          kernels::ScalingMode::kDelayedTensor, amax);
    }
    case RecipeKind::kMxfp8:
      return kernels::quantize_mxfp8(x, fmt, usage);
    case RecipeKind::kBlock:
      return kernels::quantize_block(x,
                                     role == Fp8Role::kWeight ? kernels::ScalingMode::kBlock128x128
                                                              : kernels::ScalingMode::kBlock1x128,
                                     fmt, usage, power_2_scale_of(config_),
                                     static_cast<float>(config_.eps));
    case RecipeKind::kNvfp4: {
      const kernels::Nvfp4Options o = nvfp4_options(linear, role, usage, place);
      // Both global amaxes (rowwise, columnwise after the RHT) MAX-reduced over the amax group
      // before any block is quantized.
      Tensor amax = kernels::nvfp4_global_amax(x, o.rht, key);
      reduce(linear, role, amax, 2);
      return kernels::quantize_nvfp4(x, o, usage, amax, key);
    }
    case RecipeKind::kFp32:
    case RecipeKind::kBf16:
      break;
  }
  MP_FAIL("Fp8Recipe: unreachable recipe {}", recipe_name(config_.kind));
}

kernels::Nvfp4Options Fp8Recipe::nvfp4_options(const std::string& linear, Fp8Role role,
                                               kernels::Usage usage,
                                               const TensorPlace& place) const {
  kernels::Nvfp4Options o;
  o.tile16x16 = role == Fp8Role::kWeight;
  o.rht = role != Fp8Role::kWeight && usage.columnwise;
  if (role == Fp8Role::kGradOutput) {
    const std::string key = fmt::format("{}/{}", linear, fp8_role_name(role));
    o.rounding = {.stochastic = true,
                  .seed = seed_,
                  .step = static_cast<uint64_t>(place.step),
                  .tensor_id = static_cast<uint32_t>(kernels::philox_stream(key)),
                  .row0 = place.row0,
                  .col0 = place.col0,
                  .ld = place.ld};
  }
  if (nvfp4_hook_) o = nvfp4_hook_(linear, role, o);
  return o;
}

void Fp8Recipe::update(bool forward_roles) {
  if (config_.kind != RecipeKind::kDelayed) return;
  const kernels::AmaxAlgo algo = config_.amax_compute_algo;
  for (auto& [key, state] : states_) {
    // Keys are "<linear>/<role>".
    const size_t slash = key.rfind('/');
    MP_CHECK(slash != std::string::npos, "delayed-scaling state key '{}' has no role", key);
    const std::string linear = key.substr(0, slash);
    const std::string_view suffix = std::string_view(key).substr(slash + 1);
    Fp8Role role = Fp8Role::kInput;
    bool known = false;
    for (Fp8Role r : {Fp8Role::kInput, Fp8Role::kWeight, Fp8Role::kGradOutput})
      if (suffix == fp8_role_name(r)) {
        role = r;
        known = true;
      }
    MP_CHECK(known, "delayed-scaling state key '{}': unknown role", key);
    const bool is_grad = role == Fp8Role::kGradOutput;
    if (is_grad == forward_roles) continue;
    // The current slot is history[0]: MAX-reduce it over the amax group, then update.
    Tensor current_slot = state.amax_history.slice_rows(0, 1);  // shares the history's storage
    reduce(linear, role, current_slot, 1);
    kernels::update_delayed_scaling(state, algo, static_cast<int>(config_.margin),
                                    kernels::fp8_max(format(role)));
  }
}

void Fp8Recipe::set_prequantized_weight(const std::string& linear, QuantizedTensor q,
                                        Tensor local_amax) {
  prequantized_[linear] = {std::move(q), std::move(local_amax)};
}

Fp8Recipe::Snapshot Fp8Recipe::snapshot() const {
  Snapshot s;
  for (const auto& [key, st] : states_)
    s.states.emplace(key, kernels::DelayedScalingState{st.scale.clone(), st.amax_history.clone()});
  for (const auto& [key, t] : forward_scales_) s.forward_scales.emplace(key, t.clone());
  return s;
}

void Fp8Recipe::restore(const Snapshot& s) {
  // A state the forward created (the single-rank Trainer creates them at first use) is removed:
  // the real pass creates it again, as it would have without the pre-pass.
  std::erase_if(states_, [&s](const auto& kv) { return !s.states.contains(kv.first); });
  MP_CHECK(s.states.size() == states_.size(),
           "Fp8Recipe::restore: a snapshot of {} delayed-scaling states for {}", s.states.size(),
           states_.size());
  for (auto& [key, st] : states_) {
    const kernels::DelayedScalingState& saved = s.states.at(key);
    st.scale.copy_from(saved.scale);
    st.amax_history.copy_from(saved.amax_history);
  }
  forward_scales_.clear();
  for (const auto& [key, t] : s.forward_scales) forward_scales_.emplace(key, t.clone());
}

void Fp8Recipe::end_forward() { update(true); }
void Fp8Recipe::end_backward() { update(false); }

}  // namespace meshproof::engine
