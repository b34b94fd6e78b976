#include "engine/parallel/fp8_weights.h"

#include <fmt/format.h>

#include <algorithm>

#include "engine/checkpoint/state_keys.h"
#include "engine/parallel/mesh_groups.h"
#include "engine/parallel/rank_scalars.h"
#include "kernels/core/error.h"
#include "kernels/ops/cast.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/quantize.h"
#include "mesh/core/padded_gather.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::Shape;
using kernels::Tensor;
using mesh::DimSet;
using mesh::Layout;
using mesh::Placement;

namespace {

// The same quantized tensor with every buffer on `device` (a copy where it is elsewhere), NVFP4's
// columnwise global amax included (the device decode reads it).
kernels::QuantizedTensor quantized_on(kernels::QuantizedTensor q, kernels::Device device) {
  for (Tensor* t : {&q.rowwise_data, &q.rowwise_scale_inv, &q.columnwise_data,
                    &q.columnwise_scale_inv, &q.amax, &q.scale, &q.columnwise_amax})
    if (t->defined()) *t = t->on(device);
  return q;
}

int64_t fp8_bytes(const Fp8Shard& f) {
  int64_t n = 0;
  for (const Tensor* t :
       {&f.q.rowwise_data, &f.q.rowwise_scale_inv, &f.q.columnwise_data, &f.q.columnwise_scale_inv})
    if (t->defined()) n += t->nbytes().value;
  return n;
}

}  // namespace

void RunNotes::add(const std::string& note) {
  if (std::find(list.begin(), list.end(), note) == list.end()) list.push_back(note);
}

Fp8WeightStore::Fp8WeightStore(const RunOptions& options, bool gathers_fp8, ShardPlan& plan,
                               mesh::RankComms& comms, Fp8Recipe& recipe, const FaultHooks& faults,
                               AmaxDims amax_dims, kernels::Device device, RunNotes& notes,
                               ShardedState& state)
    : options_(options),
      config_(options.config),
      gathers_fp8_(gathers_fp8),
      fp8_params_(options.fsdp.fp8_params),
      plan_(plan),
      comms_(comms),
      recipe_(recipe),
      faults_(faults),
      amax_dims_(std::move(amax_dims)),
      device_(device),
      notes_(notes) {
  if (fp8_params_) make_primary_weights(state);
}

void Fp8WeightStore::clear_step() {
  step_shards_.clear();
  step_hp_.clear();
}

int64_t Fp8WeightStore::primary_bytes(size_t i) const {
  const auto it = primary_.find(i);
  return it == primary_.end() ? 0 : fp8_bytes(it->second);
}

// Weight scales of current scaling follow the recipe's eps and power-of-2 option, as in
// Fp8Recipe::quantize.
CurrentScaleOptions Fp8WeightStore::current_scale_options() const {
  return {.eps = static_cast<float>(config_.recipe.eps), .pow2 = power_2_scale_of(config_.recipe)};
}

Fp8Shard Fp8WeightStore::quantize_local(const ShardedParam& p, const Tensor& local) {
  // The shard is quantized where `local` lives: next to the master shard, on the rank's device
  // when the state is device-resident, for every recipe (NVFP4's tile helpers run on the device
  // too: docs/design.md, "Host-device traffic per step"). The delayed scale comes
  // along. A copy of the delayed scale: the recipe updates its state in place after the
  // forward, while the shard keeps the scale it was quantized with (q.scale, allgather_parity's
  // reference for the backward re-gather).
  Tensor scale;
  if (config_.recipe.kind == RecipeKind::kDelayed)
    scale = recipe_.delayed_states().at(p.spec.linear + "/weight").scale.to(local.device());
  // Current scaling and NVFP4 MAX-reduce the shard's amax over the weight's amax group.
  const DimSet amax_dims = amax_dims_(p.spec.linear, Fp8Role::kWeight);
  const bool reduce = faults_
                          .collective({.kind = mesh::CollectiveKind::kAllReduce,
                                       .group = amax_dims,
                                       .tensor = p.spec.name,
                                       .step = step_})
                          .run;
  const mesh::CollectiveRecorder::Subject subject(recorder_, p.spec.name);
  return quantize_shard(comms_.group(groups::kDpShard), comms_.group(amax_dims), p.layout, local,
                        p.compute, config_.recipe.kind, scale.defined() ? &scale : nullptr, reduce,
                        current_scale_options(), nvfp4_options(p));
}

// NVFP4 weights: the options the recipe quantizes (linear, weight) with at this step (the fault
// hooks included), both copies; the recipe-free default for the other recipes (unused there).
kernels::Nvfp4Options Fp8WeightStore::nvfp4_options(const ShardedParam& p) const {
  if (config_.recipe.kind != RecipeKind::kNvfp4) return nvfp4_weight_options();
  return recipe_.nvfp4_options(p.spec.linear, Fp8Role::kWeight,
                               {.rowwise = true, .columnwise = true});
}

// The local shard of GEMM weight i quantized for the FP8 all-gather: the FP8 primary weight, or
// the bf16 compute copy of the master shard quantized at its first gather of the step.
const Fp8Shard& Fp8WeightStore::local_shard(size_t i) {
  if (fp8_params_) return primary_.at(i);
  auto it = step_shards_.find(i);
  if (it != step_shards_.end()) return it->second;
  const ShardedParam& p = plan_.params()[i];
  Tensor local = kernels::cast_to(p.master, DType::kBFloat16);
  Fp8Shard q = quantize_local(p, local);
  step_hp_[i] = std::move(local);
  return step_shards_.emplace(i, std::move(q)).first->second;
}

Fp8GatherResult Fp8WeightStore::gather_high_precision(const ShardedParam& p, const Fp8Shard& local,
                                                      const Tensor& hp,
                                                      const FaultHooks::CollectiveAction& act) {
  mesh::Communicator& shard = comms_.group(groups::kDpShard);
  Tensor full;
  if (!act.run) {
    full = Tensor::zeros(p.compute.shape(), hp.dtype(), hp.device());
    const mesh::Box& mine = p.layout.box(comms_.rank());
    mesh::copy_region(hp, mine, full, p.compute, mine.intersect(p.compute));
  } else {
    const Tensor wire = act.dtype ? kernels::cast_to(hp, *act.dtype) : hp;
    full = mesh::gather_padded(shard, mesh::member_boxes(shard, p.layout), wire, p.compute);
  }
  const kernels::Usage both{.rowwise = true, .columnwise = true};
  Fp8GatherResult g;
  switch (config_.recipe.kind) {
    case RecipeKind::kCurrent:
    case RecipeKind::kDelayed:
      g.weight = kernels::quantize_per_tensor(full, local.q.scale, DType::kE4M3, both, local.q.mode,
                                              local.q.amax);
      break;
    case RecipeKind::kNvfp4:
      // The gathered values quantized as one rank would (their own global amax).
      g.weight = kernels::quantize_nvfp4(full, nvfp4_options(p), both, "gathered weight");
      break;
    default:
      g.weight = kernels::quantize_mxfp8(full, DType::kE4M3, both);
      break;
  }
  return g;
}

int64_t Fp8WeightStore::gather(size_t i, int64_t step) {
  step_ = step;
  const ShardedParam& p = plan_.params()[i];
  const Fp8Shard& local = local_shard(i);
  // The shard's high-precision values: the fp32 master of an FP8 primary weight, else the bf16
  // compute copy that was quantized.
  const Tensor hp = fp8_params_                     ? p.master
                    : local.high_precision_fallback ? local.high_precision
                                                    : step_hp_.at(i);
  const FaultHooks::CollectiveAction act =
      faults_.collective({.kind = mesh::CollectiveKind::kAllGather,
                          .group = groups::kDpShard,
                          .tensor = p.spec.name,
                          .step = step,
                          .fp8 = !local.high_precision_fallback});
  Fp8GatherResult g;
  {
    const mesh::CollectiveRecorder::Subject subject(recorder_, p.spec.name);
    g = act.run && !act.dtype
            ? gather_shard(comms_.group(groups::kDpShard), p.layout, local, p.compute,
                           config_.recipe.kind, faults_.block_scale_padding(p.spec, step))
            : gather_high_precision(p, local, hp, act);
  }
  faults_.gathered_weight(p.spec, step, g.weight);
  if (options_.allgather_parity)
    record_parity(p, step, hp,
                  config_.recipe.kind == RecipeKind::kDelayed ? &local.q.scale : nullptr, g.weight);
  if (g.high_precision_fallback) notes_.add(g.note);
  const int64_t bytes =
      g.weight.rowwise_data.nbytes().value + g.weight.columnwise_data.nbytes().value;
  faults_.backward_weight(p.spec, step, g.weight);
  // The amax of the shard's high-precision values (recorded by delayed scaling).
  const Tensor amax = kernels::compute_amax(hp);
  recipe_.set_prequantized_weight(p.spec.linear, quantized_on(std::move(g.weight), device_),
                                  amax.on(device_));
  return bytes;
}

// allgather_parity: the FP8 all-gathered weight against quantize(gather(shard)) on every rank
// (fp8_all_gather_parity, same inputs). Rank 0 (launcher mpi: every process) keeps one record
// per weight and step with the byte counts summed over all ranks, so that a rank whose copy
// differs cannot hide, and the largest error; scale_inv values are the keeping rank's.
void Fp8WeightStore::record_parity(const ShardedParam& p, int64_t step, const Tensor& local,
                                   const Tensor* scale, const kernels::QuantizedTensor& gathered) {
  // The reference's amax group is the default weight group, whatever the run's table says: the
  // reference is the single-rank quantization.
  const DimSet ref_group =
      default_amax_group({p.spec.linear_kind, Fp8Role::kWeight}, options_.mesh);
  AllGatherParity r = fp8_all_gather_parity(comms_.group(groups::kDpShard), comms_.group(ref_group),
                                            p.layout, local, p.compute, config_.recipe.kind, scale,
                                            gathered, current_scale_options(), nvfp4_options(p));
  const std::vector<double> all = gather_doubles(
      comms_.group(groups::kWorld),
      {static_cast<double>(r.bytes), static_cast<double>(r.mismatched_bytes), r.max_abs_error});
  r.step = step;
  r.tensor = p.spec.name;
  r.bytes = r.mismatched_bytes = 0;
  for (size_t i = 0; i < all.size(); i += 3) {
    r.bytes += static_cast<int64_t>(all[i]);
    r.mismatched_bytes += static_cast<int64_t>(all[i + 1]);
    r.max_abs_error = std::max(r.max_abs_error, all[i + 2]);
  }
  // The first rank of each pipeline stage (with one stage: rank 0) keeps its stage's records.
  if (comms_.group(groups::kWorld).rank() == 0 || options_.launcher == "mpi") {
    parity_.push_back(std::move(r));
    parity_index_.push_back(p.model_index);
  }
  notes_.add(
      "allgather_parity: the reference high-precision gathers are counted in the collective "
      "figures");
}

std::vector<AllGatherParity> Fp8WeightStore::parity() {
  mesh::Communicator& pp = comms_.group(groups::kPp);
  if (pp.size() == 1) return parity_;
  // Each record as 7 doubles (exact: steps, indices and byte counts are far below 2^53), every
  // member's list padded to the longest; the members of a pp group hold the same place of every
  // stage, so rank 0's group holds every stage's first rank.
  constexpr size_t kFields = 7;
  const std::vector<double> counts = gather_doubles(pp, {static_cast<double>(parity_.size())});
  const auto longest = static_cast<size_t>(*std::max_element(counts.begin(), counts.end()));
  std::vector<double> mine(longest * kFields, 0.0);
  for (size_t i = 0; i < parity_.size(); ++i) {
    const AllGatherParity& r = parity_[i];
    const double fields[kFields] = {static_cast<double>(r.step),
                                    static_cast<double>(parity_index_[i]),
                                    static_cast<double>(r.bytes),
                                    static_cast<double>(r.mismatched_bytes),
                                    r.max_abs_error,
                                    r.scale_inv,
                                    r.reference_scale_inv};
    std::copy(fields, fields + kFields, mine.begin() + static_cast<std::ptrdiff_t>(i * kFields));
  }
  const std::vector<double> all = gather_doubles(pp, mine);
  const std::vector<ParamSpec> specs = param_specs(config_.model);
  std::vector<std::pair<size_t, AllGatherParity>> merged;
  for (int s = 0; s < pp.size(); ++s) {
    for (size_t i = 0; i < static_cast<size_t>(counts[static_cast<size_t>(s)]); ++i) {
      const double* f = all.data() + (static_cast<size_t>(s) * longest + i) * kFields;
      AllGatherParity r;
      r.step = static_cast<int64_t>(f[0]);
      const auto index = static_cast<size_t>(f[1]);
      r.tensor = specs.at(index).name;
      r.bytes = static_cast<int64_t>(f[2]);
      r.mismatched_bytes = static_cast<int64_t>(f[3]);
      r.max_abs_error = f[4];
      r.scale_inv = f[5];
      r.reference_scale_inv = f[6];
      merged.emplace_back(index, std::move(r));
    }
  }
  // One stage gathers every weight of a step in its first micro-batch's forward in model order
  // before any second gather, and every gather of a weight within a step compares the same
  // inputs; so this order puts first the record the one-stage list puts first, and the check's
  // verdict and message are the one-stage run's.
  std::stable_sort(merged.begin(), merged.end(), [](const auto& a, const auto& b) {
    return std::pair(a.second.step, a.first) < std::pair(b.second.step, b.first);
  });
  std::vector<AllGatherParity> out;
  for (auto& m : merged) out.push_back(std::move(m.second));
  return out;
}

// Quantizes every GEMM weight's master shard into its FP8 primary weight and adds the FP8 bytes
// and scales to the checkpoint state (a resumed run computes with the loaded FP8 weights, as
// TransformerEngine's Float8Tensor parameters do).
void Fp8WeightStore::make_primary_weights(ShardedState& state) {
  const mesh::DeviceMesh& mesh = comms_.mesh();
  const int rank = comms_.rank();
  for (size_t i = 0; i < plan_.params().size(); ++i) {
    const ShardedParam& p = plan_.params()[i];
    if (!p.spec.quantized()) continue;
    Fp8Shard& f = primary_[i] = quantize_local(p, p.master);
    MP_CHECK_INPUT(!f.high_precision_fallback,
                   "fsdp.fp8_params: weight {} {} cannot be held as mxfp8 shards on mesh {}: "
                   "every dp_shard shard needs a multiple of 32 rows ({})",
                   p.spec.name, p.spec.shape.str(), mesh.str(), f.note);
    const Layout& described = p.described;
    const std::string& name = p.spec.name;
    state.entries.push_back({keys::fp8_param(name, "rowwise_data"), described, f.q.rowwise_data});
    if (config_.recipe.kind != RecipeKind::kMxfp8) {
      const std::vector<Placement> rep(3, Placement::replicate());
      state.entries.push_back(
          {keys::fp8_param(name, "scale_inv"), Layout(mesh, Shape{1}, rep), f.q.rowwise_scale_inv});
      continue;
    }
    // MXFP8: the e8m0 scales and the columnwise copy follow the weight's row placements.
    const int64_t rows = p.spec.shape[0], cols = p.spec.shape[1];
    const auto add = [&](const std::string& part, const Shape& global, const Tensor& t) {
      Layout l(mesh, global, described.placements());
      MP_CHECK_INPUT(l.box(rank).shape() == t.shape(),
                     "fsdp.fp8_params: {} of {}: shard {} does not match its layout box {} on "
                     "mesh {}",
                     part, name, t.shape().str(), l.box(rank).str(), mesh.str());
      state.entries.push_back({keys::fp8_param(name, part), l, t});
    };
    add("rowwise_scale_inv", Shape{rows, cols / 32}, f.q.rowwise_scale_inv);
    add("columnwise_data", Shape{rows, cols}, f.q.columnwise_data);
    add("columnwise_scale_inv", Shape{rows / 32, cols}, f.q.columnwise_scale_inv);
  }
}

void Fp8WeightStore::requantize(int64_t step) {
  step_ = step;
  for (auto& [i, f] : primary_) {
    Fp8Shard fresh = quantize_local(plan_.params()[i], plan_.params()[i].master);
    for (auto [dst, src] : {std::pair{&f.q.rowwise_data, &fresh.q.rowwise_data},
                            std::pair{&f.q.rowwise_scale_inv, &fresh.q.rowwise_scale_inv},
                            std::pair{&f.q.columnwise_data, &fresh.q.columnwise_data},
                            std::pair{&f.q.columnwise_scale_inv, &fresh.q.columnwise_scale_inv}})
      if (dst->defined()) dst->copy_from(*src);
    f.q.amax = fresh.q.amax;
    f.q.scale = fresh.q.scale;
  }
}

}  // namespace meshproof::engine
