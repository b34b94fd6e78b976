// Quantization recipes applied to the GEMMs of the four linear layers (qkv, proj, fc1 [gate/up],
// fc2), docs/design.md section 4. For each linear "layers.{i}.<linear>" three tensors are
// quantized:
//   input X and weight W in the forward (rowwise for fprop, columnwise kept for wgrad/dgrad),
//   output gradient dY in the backward (rowwise for dgrad, columnwise for wgrad).
// Formats (recipe.fp8_format): HYBRID (X, W e4m3; dY e5m2) or E4M3 (every tensor e4m3); default
// HYBRID for delayed/current, E4M3 for mxfp8 (its only format) and block.
// Scale options: current and block scales use recipe.eps (amax clamped below by eps) and
// recipe.power_2_scale (default off for current, on for block).
// Fast accumulation: fprop on, dgrad/wgrad off (delayed, current); off everywhere otherwise.
//
// Every amax reduction goes through the `reduce_amax` hook with the linear's name and the tensor's
// role (identity on one rank; the sharded executor MAX-reduces over that tensor's amax group,
// engine/parallel/amax_groups.h). Delayed scaling updates the input/weight states after
// each forward pass and the gradient states after each backward pass. During activation recompute
// the forward tensors are re-quantized with the scales the forward pass used and record nothing,
// so recompute reproduces the forward's bytes.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "engine/config/config.h"
#include "kernels/gemm/gemm.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/quantize.h"

namespace meshproof::engine {

enum class Fp8Role : uint8_t { kInput, kWeight, kGradOutput };

// Where a quantized tensor sits in the unsharded tensor of the global batch: NVFP4's stochastic
// rounding of gradients draws element (m, k)'s number from its global index
// (row0 + m) * ld + col0 + k at `step`, so the draws do not depend on the mesh or micro-batching.
// ld = 0: the local tensor's width.
struct TensorPlace {
  int64_t step = 0;
  int64_t row0 = 0;
  int64_t col0 = 0;
  int64_t ld = 0;
};

// "input", "weight", "grad_output" (the suffix of the delayed-scaling state keys).
std::string_view fp8_role_name(Fp8Role r);

class Fp8Recipe {
 public:
  // MAX-reduces amax[0..n) in place (host floats) for the tensor of `linear` (e.g.
  // "layers.0.attn.qkv") in `role`.
  using AmaxHook =
      std::function<void(const std::string& linear, Fp8Role role, float* amax, int64_t n)>;
  // `seed`: the Philox key of NVFP4's stochastic rounding (the run's Config::seed).
  Fp8Recipe(const RecipeConfig& config, AmaxHook reduce_amax, uint64_t seed = 0);

  // True for delayed, current, mxfp8 and block; false for fp32/bf16 (GEMMs unquantized).
  bool enabled() const { return enabled_; }
  // Quantizes `x` (float32/bf16) for linear `linear` (e.g. "layers.0.attn.qkv") in `role`.
  // nvfp4 (docs/design.md section 25): weights in 16x16 tiles; inputs and output gradients in
  // 1x16 blocks with the RHT on their columnwise (wgrad) copies; output gradients stochastically
  // rounded at `place` with the key (config seed, step, tensor id = low 32 bits of
  // philox_stream("<linear>/grad_output")). Both global amaxes go through the reduce hook.
  kernels::QuantizedTensor quantize(const std::string& linear, Fp8Role role,
                                    const kernels::Tensor& x, kernels::Usage usage,
                                    const TensorPlace& place = {});
  kernels::GemmOptions options(kernels::GemmRole role, bool accumulate = false) const;
  kernels::DType format(Fp8Role role) const;

  // FP8 all-gather (engine/parallel/fp8_all_gather.h): the sharded executor hands in weights it
  // already quantized shard-wise and gathered; quantize(linear, kWeight, ...) returns them instead
  // of quantizing again. `local_amax` (float32 [1], the shard's amax) is recorded for delayed
  // scaling, whose end_forward MAX-reduces it into the weight's amax.
  void set_prequantized_weight(const std::string& linear, kernels::QuantizedTensor q,
                               kernels::Tensor local_amax);
  void clear_prequantized_weights() { prequantized_.clear(); }
  void clear_prequantized_weight(const std::string& linear) { prequantized_.erase(linear); }

  // Fault injection (engine/faults/fault_hooks.h nvfp4_options): may change the options each NVFP4
  // quantization of (linear, role) uses. Unset: the recipe's options.
  using Nvfp4Hook = std::function<kernels::Nvfp4Options(const std::string& linear, Fp8Role role,
                                                        kernels::Nvfp4Options)>;
  void set_nvfp4_hook(Nvfp4Hook h) { nvfp4_hook_ = std::move(h); }
  // MAX-reduces `amax` (float32, n elements, on the host or a device) in place, where it lives:
  // set by a training session so that a device amax is reduced on the device (a collective on the
  // device buffer, none for a group of one) instead of through a host copy. When set it replaces
  // the AmaxHook for every reduction.
  using AmaxTensorHook =
      std::function<void(const std::string& linear, Fp8Role role, kernels::Tensor& amax)>;
  void set_amax_tensor_hook(AmaxTensorHook h) { reduce_amax_tensor_ = std::move(h); }
  // The options an NVFP4 quantization of (linear, role) with `usage` at `place` uses: 16x16 tiles
  // for weights, the RHT on a columnwise copy of the others, stochastic rounding of output
  // gradients, then the fault hook. quantize() uses them; the FP4 all-gather quantizes weight
  // shards with them (engine/parallel/fp8_all_gather.h).
  kernels::Nvfp4Options nvfp4_options(const std::string& linear, Fp8Role role, kernels::Usage usage,
                                      const TensorPlace& place = {}) const;

  void end_forward();   // delayed: reduce + update input/weight states
  void end_backward();  // delayed: reduce + update gradient states
  void set_recompute(bool on) { recompute_ = on; }
  // Delayed: the scale each forward tensor was quantized with in the latest forward, which a
  // recompute quantizes with again. Pipeline stages (docs/design.md section 33) run other
  // micro-batches' forwards between a micro-batch's forward and its backward: the stage takes
  // the map after each forward and puts it back before that micro-batch's backward. The map's
  // tensors are never written in place (each forward stores fresh copies).
  std::map<std::string, kernels::Tensor> forward_scales() const { return forward_scales_; }
  void set_forward_scales(std::map<std::string, kernels::Tensor> s) {
    forward_scales_ = std::move(s);
  }

  // Delayed-scaling state per "<linear>/<input|weight|grad_output>" (checkpoint state).
  std::map<std::string, kernels::DelayedScalingState>& delayed_states() { return states_; }

  // A copy of the state a forward pass changes (the delayed-scaling scales and amax histories,
  // the scales the forward tensors used), for the MoE routing pre-pass (docs/design.md
  // "Tensor-parallel experts"), which runs the micro-batches' forwards once before the step's
  // real passes and puts the state back with restore(), so the real passes see it unchanged.
  struct Snapshot {
    std::map<std::string, kernels::DelayedScalingState> states;
    std::map<std::string, kernels::Tensor> forward_scales;
  };
  Snapshot snapshot() const;
  // Writes the snapshot's values into the state tensors in place (the checkpoint state shares
  // them), removes states created since, and puts the forward scales back.
  void restore(const Snapshot& s);

 private:
  void update(bool forward_roles);
  // MAX-reduces the first n floats of `amax` (host or device) through the executor's hook.
  void reduce(const std::string& linear, Fp8Role role, kernels::Tensor& amax, int64_t n);

  RecipeConfig config_;
  AmaxHook reduce_amax_;
  AmaxTensorHook reduce_amax_tensor_;
  uint64_t seed_ = 0;
  Nvfp4Hook nvfp4_hook_;
  bool enabled_ = false;
  bool recompute_ = false;
  std::map<std::string, kernels::DelayedScalingState> states_;
  std::map<std::string, kernels::Tensor> forward_scales_;  // scale each forward tensor used
  struct Prequantized {
    kernels::QuantizedTensor q;
    kernels::Tensor local_amax;
  };
  std::map<std::string, Prequantized> prequantized_;  // by linear name
};

}  // namespace meshproof::engine
