// One rank's share of a run (engine/session/session.h), assembled from parts with one job each
// (docs/design.md section 20): the shard plan (engine/parallel/shard_plan.h: layouts, shards, state
// entries), the FP8 weight store (engine/parallel/fp8_weights.h), the FSDP unit executor
// (engine/parallel/fsdp_units.h), the sharded optimizer step (engine/optim/optimizer.h), tracing
// and timing (engine/session/session_trace.h) and the fault hooks (engine/faults/fault_hooks.h).
// The launcher (run_on_ranks, run_training) is engine/session/launcher.cc. This file wires the
// parts and runs a step.
#include "engine/session/session.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>

#include "engine/checkpoint/state_keys.h"
#include "engine/config/run_rules.h"
#include "engine/faults/fault_hooks.h"
#include "engine/model/data.h"
#include "engine/model/model.h"
#include "engine/model/params.h"
#include "engine/model/recipe.h"
#include "engine/optim/optimizer.h"
#include "engine/parallel/fp8_weights.h"
#include "engine/parallel/fsdp_units.h"
#include "engine/parallel/mesh_groups.h"
#include "engine/parallel/rank_scalars.h"
#include "engine/parallel/shard_plan.h"
#include "engine/pipeline/pipeline.h"
#include "engine/session/session_trace.h"
#include "kernels/core/error.h"
#include "kernels/quantize/quantize.h"

namespace meshproof::engine {

using kernels::Tensor;
using mesh::DimSet;
using mesh::Layout;
using mesh::MeshDim;
using mesh::Placement;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// check_run before the session's members exist: the model, the data table and the shards
// allocate in their constructors.
const RunOptions& checked(const RunOptions& options) {
  require_valid_run(options);
  return options;
}

// The communicators' mesh, which must be the one the options ask for.
const mesh::DeviceMesh& checked_mesh(const mesh::RankComms& comms, const RunOptions& options) {
  MP_CHECK_INPUT(comms.mesh() == options.mesh.device_mesh(),
                 "session: communicators are for mesh {}, options ask {}", comms.mesh().str(),
                 options.mesh.device_mesh().str());
  return comms.mesh();
}

}  // namespace

struct TrainingSession::Impl {
  RunOptions options;
  const Config& config;
  // Where the model computes (options.backend), and where the shard plan's fp32 masters, AdamW
  // moments and reduced gradients live: the weight gathers, the gradient reduce-scatters and
  // all-reduces and the optimizer run on device buffers (docs/design.md, "Device-resident
  // training state").
  kernels::Device device;
  mesh::RankComms& comms;
  mesh::DeviceMesh mesh;
  int rank;
  FaultHooks faults;
  GptModel model;
  MarkovSource data;
  Fp8Recipe recipe;
  ShardPlan plan;
  ShardedState state;
  RunNotes notes;
  std::optional<Fp8WeightStore> fp8;
  std::optional<FsdpUnitExecutor> units;
  int64_t step = 0;    // optimizer steps taken
  int64_t cursor = 0;  // next global batch
  StepTime time;
  // mesh.pp > 1: the last step's pipeline times (docs/design.md section 38).
  PipelineStepTime pp_time;
  MemoryBreakdown mem;
  // RunOptions::trace: the forward's FP8 state of the last step, taken at the step's start,
  // before the forward reads the delayed scales and the FP8 primary weights.
  std::vector<TensorDigest> fp8_trace_before;
  // RunOptions::record_collectives: the rank's collectives attributed to a parameter, per step
  // (mesh/core/collective_recorder.h); attached to the rank's communicators while the session
  // lives.
  std::optional<mesh::CollectiveRecorder> recorder;

  ~Impl() {
    if (recorder) mesh::attach_recorder(comms, nullptr);
  }

  Impl(const RunOptions& o, mesh::RankComms& c)
      : options(checked(o)),
        config(options.config),
        // The rank's own device: cuda:0 for virtual ranks, the process's GPU under mpi.
        device(options.backend.is_cuda() ? kernels::current_context().device
                                         : kernels::Device::cpu()),
        comms(c),
        mesh(checked_mesh(c, options)),
        rank(c.rank()),
        faults(make_fault_hooks(options.faults)),
        model(options.config),
        data(config.model.vocab, config.data, config.training.batch, config.training.seq_len,
             device),
        // The amaxes are reduced by the tensor hook set below (on their own buffers); the float
        // hook is the recipe's host fallback, which a session never reaches.
        recipe(
            config.recipe,
            [](const std::string& linear, Fp8Role role, float*, int64_t) {
              MP_FAIL("session: amax of {}/{} reduced through the host hook", linear,
                      fp8_role_name(role));
            },
            config.seed),
        plan(config, c.mesh(), c.rank(), faults, device) {
    recipe.set_amax_tensor_hook([this](const std::string& linear, Fp8Role role, Tensor& amax) {
      reduce_amax(linear, role, amax);
    });
    const RecipeKind rk = config.recipe.kind;
    // FP8 primary weights are gathered as FP8 (there is no high-precision compute copy); a fault
    // hook on the backward weight needs the quantized weights too. NVFP4 weights travel as FP4
    // (docs/design.md section 28).
    const bool fp8_gather = (options.fsdp.fp8_all_gather || faults.needs_quantized_weights() ||
                             options.fsdp.fp8_params) &&
                            (rk == RecipeKind::kCurrent || rk == RecipeKind::kDelayed ||
                             rk == RecipeKind::kMxfp8 || rk == RecipeKind::kNvfp4);
    if (options.fsdp.fp8_all_gather && !fp8_gather)
      notes.add(fmt::format(
          "fsdp.fp8_all_gather has no effect with recipe {}: weights are gathered in high "
          "precision",
          recipe_name(rk)));
    if (faults.has_nvfp4_hooks())
      recipe.set_nvfp4_hook(
          [this](const std::string& linear, Fp8Role role, kernels::Nvfp4Options o) {
            return faults.nvfp4_options(linear, role, step, o);
          });
    plan.add_state_entries(state);
    // Delayed-scaling states exist from the start (the recipe would create them at the first
    // quantization) so that the state entries cover them before step 0 and a checkpoint loaded
    // before the first step writes into the live tensors. They are replicated: every rank holds
    // the reduced amax history.
    if (rk == RecipeKind::kDelayed)
      for (const std::string& l : plan.linears())
        for (Fp8Role role : {Fp8Role::kInput, Fp8Role::kWeight, Fp8Role::kGradOutput})
          recipe.delayed_states().emplace(
              l + "/" + std::string(fp8_role_name(role)),
              kernels::make_delayed_scaling_state(config.recipe.amax_history_len, device));
    for (auto& [name, st] : recipe.delayed_states()) {
      const std::vector<Placement> rep(3, Placement::replicate());
      state.entries.push_back(
          {keys::fp8_delayed(name, "scale"), Layout(mesh, st.scale.shape(), rep), st.scale});
      state.entries.push_back({keys::fp8_delayed(name, "amax_history"),
                               Layout(mesh, st.amax_history.shape(), rep), st.amax_history});
    }
    fp8.emplace(
        options, fp8_gather, plan, comms, recipe, faults,
        [this](std::string_view linear, Fp8Role role) { return amax_dims(linear, role); }, device,
        notes, state);
    units.emplace(options, plan, *fp8, comms, recipe, faults, device);
    if (options.record_collectives) {
      recorder.emplace();
      mesh::attach_recorder(comms, &*recorder);
      units->set_recorder(&*recorder);
      fp8->set_recorder(&*recorder);
    }
    store_scalars();
    for (size_t i = 0; i < plan.params().size(); ++i) {
      const ShardedParam& p = plan.params()[i];
      mem.params += p.master.nbytes().value + fp8->primary_bytes(i);
      mem.grads += p.grad.nbytes().value;
      mem.optimizer += p.exp_avg.nbytes().value + p.exp_avg_sq.nbytes().value;
    }
  }

  void store_scalars() {
    state.scalars[std::string(keys::kOptimStep)] = step;
    state.scalars[std::string(keys::kDataCursor)] = cursor;
    state.scalars[std::string(keys::kRngOffset)] = cursor;
    state.scalars[std::string(keys::kLrStep)] = step;
  }
  void load_scalars() {
    step = state.scalars.at(std::string(keys::kOptimStep));
    cursor = state.scalars.at(std::string(keys::kDataCursor));
    // A checkpoint was just loaded into the state (the callers load, then call this).
    faults.state(FaultHooks::StatePoint::kLoaded, step, state);
  }

  // FP8 amax reduction (docs/design.md sections 4 and 5): each amax the recipe records is
  // MAX-reduced over the group of the ranks that hold a piece of its tensor
  // (engine/parallel/amax_groups.h, looked up per linear kind and role in the default table or
  // options.amax_groups, then through the amax_group fault hook). Every rank therefore quantizes
  // with the single-rank scales.
  DimSet amax_dims(std::string_view linear, Fp8Role role) const {
    return faults.amax_group(
        linear, role, step,
        amax_group({plan.linear_kind(linear), role}, options.mesh, options.amax_groups));
  }
  // A weight's amax reductions are attributed to the weight (the collectives check; the
  // collective fault point); the activations' and gradients' are not in the budget.
  // The reduction runs on the amax's own buffer, where it lives: on the CUDA backend a device
  // MAX over the group (the local communicator's rank-order kernel, NCCL under mpi), no host
  // round trip, and nothing at all for a group of one.
  void reduce_amax(const std::string& linear, Fp8Role role, Tensor& buf) {
    const DimSet dims = amax_dims(linear, role);
    const bool weight = role == Fp8Role::kWeight;
    const std::string tensor = weight ? linear + ".weight" : std::string();
    const mesh::CollectiveRecorder::Subject subject(recorder ? &*recorder : nullptr, tensor);
    mesh::Communicator& group = comms.group(dims);
    if (group.size() > 1 && (!weight || faults
                                            .collective({.kind = mesh::CollectiveKind::kAllReduce,
                                                         .group = dims,
                                                         .tensor = tensor,
                                                         .step = step})
                                            .run))
      group.all_reduce(buf, mesh::ReduceOp::kMax);
    // tp_weight_amax_all_reduced: the weight amax reduced again over another group.
    const DimSet extra = weight ? faults.extra_amax_group(linear, step) : DimSet{};
    if (!extra.empty() && comms.group(extra).size() > 1)
      comms.group(extra).all_reduce(buf, mesh::ReduceOp::kMax);
  }

  // The MoE load-balancing loss with micro-batches (docs/design.md "Tensor-parallel experts"):
  // the forwards of this rank's micro-batches run once first (weights gathered by the unit
  // executor as in the real forward) to record each MoE layer's routing statistics, which are
  // summed over the micro-batches and then over the data-parallel ranks in rank order; the
  // recipe's state is put back, so the step's real passes see it unchanged and, every forward
  // being deterministic, route exactly as the pre-pass did. Empty when not needed. With
  // pipeline stages (section 33) the forwards are a forward-only sweep over the stages
  // (PrepassRunner): each stage records its own MoE layers' statistics (the others' stay empty).
  std::vector<moe::BalanceStats> moe_routing_prepass(const TpContext& tp, int64_t first_row,
                                                     int64_t micro_rows) {
    if (!moe::needs_routing_prepass(config)) return {};
    const Fp8Recipe::Snapshot before = recipe.snapshot();
    std::vector<moe::BalanceStats> load;
    const auto add = [&load](const std::vector<moe::BalanceStats>& s) {
      load.resize(s.size());
      for (size_t i = 0; i < s.size(); ++i) moe::add_balance_stats(load[i], s[i]);
    };
    if (mesh.size(MeshDim::kPp) > 1) {
      PrepassRunner runner(*this, first_row, micro_rows, tp, add);
      mesh::Communicator& pp = comms.group(groups::kPp);
      const double p2p0 = p2p_seconds(pp);
      run_stage_schedule(pp, forward_sweep(config.training.micro_batches), runner);
      pp_time.p2p_wait += p2p_seconds(pp) - p2p0;
    } else {
      for (int64_t mb = 0; mb < config.training.micro_batches; ++mb) {
        const int64_t row0 = first_row + mb * micro_rows;
        add(model.routing_stats(units->weights(), data.rows(cursor, row0, row0 + micro_rows),
                                {cursor, row0}, &recipe, tp, &*units));
      }
    }
    recipe.restore(before);
    mesh::Communicator& data_group = comms.group(groups::kData);
    for (moe::BalanceStats& l : load)
      if (!l.count.empty() && data_group.size() > 1) l = moe::sum_balance_stats(data_group, l);
    return load;
  }

  // The time blocked in the pp group's send/recv: a stage's idle time (section 38).
  static double p2p_seconds(mesh::Communicator& pp) {
    return pp.stats(mesh::CollectiveKind::kSend).seconds +
           pp.stats(mesh::CollectiveKind::kRecv).seconds;
  }

  // The residual stream exchanged between stages for one micro-batch: [rows, H] in the compute
  // dtype, rows = B*S, or B*S/tp under sequence parallelism (each tp rank its sequence shard).
  Tensor stage_activation(int64_t micro_rows, const TpContext& tp) const {
    const int64_t rows = micro_rows * config.training.seq_len / (tp.sp() ? tp.comm->size() : 1);
    const kernels::DType dt = config.recipe.kind == RecipeKind::kFp32 ? kernels::DType::kFloat32
                                                                      : kernels::DType::kBFloat16;
    return Tensor::empty({rows, config.model.hidden}, dt, device);
  }

  // The routing pre-pass on a pipeline stage: each micro-batch's forward without training, in
  // order (forward_sweep: received from the stage below, sent on to the stage above), through
  // GptModel::stage_routing_stats; the statistics go to `add` in micro-batch order, as one
  // stage's pre-pass adds them.
  struct PrepassRunner final : StagePasses {
    Impl& s;
    int64_t first_row, micro_rows;
    const TpContext& tp;
    std::function<void(const std::vector<moe::BalanceStats>&)> add;

    PrepassRunner(Impl& impl, int64_t first, int64_t rows, const TpContext& t,
                  std::function<void(const std::vector<moe::BalanceStats>&)> a)
        : s(impl), first_row(first), micro_rows(rows), tp(t), add(std::move(a)) {}

    Tensor input_buffer(int64_t) override { return s.stage_activation(micro_rows, tp); }
    Tensor grad_output_buffer(int64_t) override { return s.stage_activation(micro_rows, tp); }
    Tensor forward(int64_t mb, const Tensor& input) override {
      const int64_t row0 = first_row + mb * micro_rows;
      Tensor output;
      const auto t0 = Clock::now();
      add(s.model.stage_routing_stats(s.plan.stage(), s.units->weights(),
                                      s.data.rows(s.cursor, row0, row0 + micro_rows), input,
                                      {s.cursor, row0}, &s.recipe, tp, &*s.units, output));
      kernels::synchronize_current();
      s.pp_time.forward += seconds_since(t0);
      return output;
    }
    Tensor backward(int64_t mb, const Tensor&, bool) override {
      MP_FAIL("pipeline stage {}: the routing pre-pass has no backward (micro-batch {})",
              s.mesh.stage(s.rank), mb);
    }
  };

  // One optimizer step, top to bottom: micro-batched forward/backward on this data-parallel
  // rank's rows (the unit executor gathers each unit's weights as the model reaches it and
  // reduces its gradients after its backward in the last micro-batch), the global loss, the
  // sharded optimizer step (clip + AdamW), the FP8 primary weights re-quantized, the counters.
  StepMetrics run_step() {
    faults.state(FaultHooks::StatePoint::kStepBegin, step, state);
    if (recorder) recorder->begin_step(step);
    // Before the step's clock starts: tracing is not the step's time.
    if (options.trace) fp8_trace_before = fp8_state_digests(plan, state, comms, "");
    const TrainingConfig& t = config.training;
    const auto t0 = Clock::now();
    const std::map<std::string, double> coll0 = collective_seconds(comms);
    StepMetrics metrics;
    metrics.step = step;

    // Forward/backward. Gradients are averaged over the data-parallel ranks, so each rank's
    // objective is its rows' loss sum scaled by dp / global positions.
    const auto tc = Clock::now();
    const double coll_compute0 = all_collective_seconds(comms);
    units->begin_step(step);
    fp8->clear_step();
    recipe.clear_prequantized_weights();
    const int64_t dp = mesh.group_size(groups::kData);
    const int64_t j = mesh.group_index(rank, groups::kData);
    const int64_t local_rows = t.batch / dp, micro_rows = local_rows / t.micro_batches;
    const double positions = static_cast<double>(t.batch * t.seq_len);
    const double grad_scale = static_cast<double>(dp) / positions;
    double loss_sum = 0;
    TpContext tp{&comms.group(groups::kTp),
                 options.mesh.sequence_parallel,
                 faults.rope_global_positions(step),
                 &comms.group(groups::kData),
                 faults.router_fp32(step),
                 &comms.group(groups::kDpShard),
                 options.mesh.ep,
                 faults.expert_grad_factor(step, options.mesh.ep)};
    tp.expert_split_padding = faults.expert_split_padding(step);
    const double reduction0 = units->reduction_seconds();
    if (mesh.size(MeshDim::kPp) > 1) {
      pp_time = {};
      loss_sum = run_pipeline(j * local_rows, micro_rows, grad_scale, tp);
    } else {
      const std::vector<moe::BalanceStats> load =
          moe_routing_prepass(tp, j * local_rows, micro_rows);
      if (!load.empty()) tp.moe_load = &load;
      for (int64_t mb = 0; mb < t.micro_batches; ++mb) {
        units->begin_micro_batch(mb == 0, mb + 1 == t.micro_batches);
        const int64_t row0 = j * local_rows + mb * micro_rows;
        const Tensor tokens = data.rows(cursor, row0, row0 + micro_rows);
        loss_sum += model.forward_backward(units->weights(), tokens, {cursor, row0}, grad_scale,
                                           units->grads(), &recipe, tp, &*units);
      }
    }
    units->end_step();
    fp8->clear_step();
    // The phases exclude the collectives that ran inside them (reported per kind below), so the
    // parts of the breakdown do not count the same seconds twice.
    time.compute = seconds_since(tc) - (all_collective_seconds(comms) - coll_compute0);
    const bool sp = options.mesh.sequence_parallel && mesh.size(MeshDim::kTp) > 1;
    metrics.loss =
        sum_doubles(comms.group(sp ? groups::kWorld : groups::kData), loss_sum) / positions;
    // Pipeline stages: the last stage holds the loss; every other stage adds 0.0 (exact), so every
    // rank gets the last stage's value bit for bit.
    if (mesh.size(MeshDim::kPp) > 1)
      metrics.loss =
          sum_doubles(comms.group(groups::kPp), plan.stage().last_stage ? metrics.loss : 0.0);

    // Optimizer: global norm, clipping, AdamW on the local shards; FP8 primary weights follow.
    const auto to = Clock::now();
    const double coll_optimizer0 = all_collective_seconds(comms);
    const OptimizerStepResult opt = sharded_optimizer_step(plan, comms, t, step);
    metrics.grad_norm = opt.grad_norm;
    metrics.lr = opt.lr;
    faults.state(FaultHooks::StatePoint::kAfterUpdate, step, state);
    if (fp8->primary_weights()) fp8->requantize(step);
    if (recorder) recorder->end_step();
    const double optimizer_wall = seconds_since(to);
    time.optimizer = optimizer_wall - (all_collective_seconds(comms) - coll_optimizer0);

    ++step;
    ++cursor;
    store_scalars();
    record_time_and_memory(t0, coll0);
    if (mesh.size(MeshDim::kPp) > 1) {
      pp_time.reduction = units->reduction_seconds() - reduction0;
      pp_time.optimizer = optimizer_wall;
      pp_time.total = time.total;
    }
    return metrics;
  }

  // One pipeline stage's passes of one micro-batch (docs/design.md section 33): the stage's
  // layers through GptModel::stage_forward / stage_backward, each in-flight micro-batch's
  // activations held until its backward, the FSDP units' deferred reduction after the pass the
  // schedule marks last_backward.
  struct StageRunner final : StagePasses {
    Impl& s;
    int64_t first_row, micro_rows;
    double grad_scale;
    const TpContext& tp;
    std::map<int64_t, std::shared_ptr<GptModel::StageState>> in_flight;
    // With recompute: the delayed scales each in-flight micro-batch's forward used, put back
    // before its backward re-runs the forward (Fp8Recipe::forward_scales).
    std::map<int64_t, std::map<std::string, Tensor>> forward_scales;
    // Each micro-batch's loss parts, in micro-batch order (the backwards run in that order).
    std::vector<GptModel::StageLoss> losses;

    StageRunner(Impl& impl, int64_t first, int64_t rows, double scale, const TpContext& t)
        : s(impl), first_row(first), micro_rows(rows), grad_scale(scale), tp(t) {}

    int64_t row0(int64_t mb) const { return first_row + mb * micro_rows; }
    Tensor input_buffer(int64_t) override { return s.stage_activation(micro_rows, tp); }
    Tensor grad_output_buffer(int64_t) override { return s.stage_activation(micro_rows, tp); }
    Tensor forward(int64_t mb, const Tensor& input) override {
      s.units->begin_micro_batch(mb == 0, false);
      const Tensor tokens = s.data.rows(s.cursor, row0(mb), row0(mb) + micro_rows);
      Tensor output;
      double loss = 0;
      const auto t0 = Clock::now();
      in_flight[mb] = s.model.stage_forward(s.plan.stage(), s.units->weights(), tokens, input,
                                            {s.cursor, row0(mb)}, grad_scale, &s.recipe, tp,
                                            &*s.units, true, output, loss);
      if (s.config.training.recompute) forward_scales[mb] = s.recipe.forward_scales();
      // The pass's kernels count in it, not in the send or recv after it (no-op on the CPU).
      kernels::synchronize_current();
      s.pp_time.forward += seconds_since(t0);
      return output;
    }
    Tensor backward(int64_t mb, const Tensor& grad_output, bool last_backward) override {
      // The deferred reduction runs after the schedule's last backward, never inferred from
      // counting micro-batches (docs/design.md section 33).
      const int stage = s.mesh.stage(s.rank);
      const bool reduce = !last_backward || s.faults.pp_last_backward(stage, s.step);
      s.units->begin_micro_batch(mb == 0, last_backward && reduce);
      const auto it = in_flight.find(mb);
      MP_CHECK(it != in_flight.end(),
               "pipeline stage {}: backward of micro-batch {} before its "
               "forward",
               s.mesh.stage(s.rank), mb);
      const std::shared_ptr<GptModel::StageState> st = std::move(it->second);
      in_flight.erase(it);
      if (s.config.training.recompute) {
        s.recipe.set_forward_scales(std::move(forward_scales.at(mb)));
        forward_scales.erase(mb);
      }
      const auto t0 = Clock::now();
      const double reduction0 = s.units->reduction_seconds();
      Tensor dx =
          s.model.stage_backward(*st, s.units->weights(), s.units->grads(), grad_output, &*s.units);
      MP_CHECK(static_cast<int64_t>(losses.size()) == mb,
               "pipeline stage {}: backward of micro-batch {} after {} backwards (not in "
               "micro-batch order)",
               stage, mb, losses.size());
      losses.push_back(s.model.stage_loss_parts(*st));
      if (!reduce) s.units->discard_gradients();  // the fault: nothing reduced
      kernels::synchronize_current();
      // The deferred reduction inside the pass is reported on its own (PipelineStepTime).
      s.pp_time.backward +=
          std::max(0.0, seconds_since(t0) - (s.units->reduction_seconds() - reduction0));
      return dx;
    }
  };

  double run_pipeline(int64_t first_row, int64_t micro_rows, double grad_scale, TpContext tp) {
    // MoE with the aux loss over micro-batches: the routing pre-pass as a forward sweep over
    // the stages; each stage's MoE layers use the statistics of all micro-batches.
    const std::vector<moe::BalanceStats> load = moe_routing_prepass(tp, first_row, micro_rows);
    if (!load.empty()) tp.moe_load = &load;
    StageRunner runner(*this, first_row, micro_rows, grad_scale, tp);
    mesh::Communicator& pp = comms.group(groups::kPp);
    const double p2p0 = p2p_seconds(pp);
    run_stage_schedule(pp,
                       stage_schedule(config.training.pp_schedule, pp.size(), pp.rank(),
                                      config.training.micro_batches),
                       runner);
    pp_time.p2p_wait += p2p_seconds(pp) - p2p0;
    // Tied embeddings: the end stages' gradient parts, exchanged and reduced once the schedule
    // is done (docs/design.md section 33).
    units->sync_tied_embedding(faults.pp_tied_embedding_synced(step));
    MP_CHECK(runner.in_flight.empty(), "pipeline stage {}: {} micro-batches never ran backward",
             pp.rank(), runner.in_flight.size());
    if (config.model.moe.enabled() && config.model.moe.aux_loss_coef > 0)
      stage_aux_into_loss(pp, runner.losses);
    // The micro-batches' loss sums added in micro-batch order, as one stage adds them.
    double loss_sum = 0;
    for (const GptModel::StageLoss& l : runner.losses)
      loss_sum += GptModel::micro_batch_loss(l.cross_entropy, l.layer_aux, l.rows);
    return loss_sum;
  }

  // MoE under pipeline stages (docs/design.md section 33): each MoE layer's load-balancing loss
  // of a micro-batch is computed on its layer's stage, but the last stage adds every layer's to
  // the micro-batch's loss sum. Each stage puts its layers' values at their model index
  // (micro-batch x layer) of a vector of zeros, the vectors are gathered over pp and every
  // micro-batch's `layer_aux` becomes the model's layers' values, each taken from the stage that
  // holds the layer (not summed: the copy is exact whatever the value). micro_batch_loss then
  // adds them in layer order from 0 as one stage does.
  void stage_aux_into_loss(mesh::Communicator& pp, std::vector<GptModel::StageLoss>& losses) {
    const int64_t layers = config.model.layers;
    const int64_t m = static_cast<int64_t>(losses.size());
    const StageLayers& mine = plan.stage();
    std::vector<double> local(static_cast<size_t>(m * layers), 0.0);
    for (int64_t mb = 0; mb < m; ++mb) {
      const std::vector<double>& aux = losses[static_cast<size_t>(mb)].layer_aux;
      MP_CHECK(static_cast<int64_t>(aux.size()) == mine.count,
               "pipeline stage {}: {} aux losses for {} layers", pp.rank(), aux.size(), mine.count);
      for (int64_t i = 0; i < mine.count; ++i)
        local[static_cast<size_t>(mb * layers + mine.first + i)] = aux[static_cast<size_t>(i)];
    }
    const std::vector<double> all = gather_doubles(pp, local);
    // Each layer's value copied from the stage holding it (stage s's vector starts at s * m *
    // layers), not summed with the other stages' zeros: exact for any value.
    for (GptModel::StageLoss& l : losses) l.layer_aux.assign(static_cast<size_t>(layers), 0.0);
    for (int s = 0; s < pp.size(); ++s) {
      const StageLayers span = stage_layers(layers, pp.size(), s, config.model.pp_layers);
      for (int64_t mb = 0; mb < m; ++mb)
        for (int64_t l = span.first; l < span.first + span.count; ++l)
          losses[static_cast<size_t>(mb)].layer_aux[static_cast<size_t>(l)] =
              all[static_cast<size_t>((s * m + mb) * layers + l)];
    }
  }

  void record_time_and_memory(Clock::time_point t0, const std::map<std::string, double>& coll0) {
    const std::map<std::string, double> coll1 = collective_seconds(comms);
    time.collectives.clear();
    for (const auto& [k, v] : coll1)
      if (v - coll0.at(k) > 0) time.collectives[k] = v - coll0.at(k);
    time.total = seconds_since(t0);
    mem.gathered_weights = units->peak_gathered_bytes();
    if (kernels::MemoryTracker* m = kernels::current_context().memory)
      mem.peak = m->peak(device.type).value;
    // The tracker's peak (of the compute device) holds the sharded state (the FP8 primary
    // weights, every recipe's, with the masters), the gathered weights, the unsharded gradients
    // and the activations.
    const int64_t resident = mem.params + mem.grads + mem.optimizer + mem.gathered_weights;
    mem.activations = std::max<int64_t>(0, mem.peak - resident);
  }
};

TrainingSession::TrainingSession(const RunOptions& options, mesh::RankComms& comms)
    : impl_(std::make_unique<Impl>(options, comms)) {}
TrainingSession::~TrainingSession() = default;
StepMetrics TrainingSession::step() { return impl_->run_step(); }
ShardedState& TrainingSession::state() { return impl_->state; }
void TrainingSession::load_scalars() { impl_->load_scalars(); }
namespace {

// gather_global of every pipeline stage (collective): each stage gathers its own parameters
// (or gradients), then broadcasts them from their stage over pp in model order, so every rank
// holds the whole model's. With one stage: gather_global.
std::map<std::string, Tensor> gather_all_stages(const Config& config, const ShardPlan& plan,
                                                mesh::RankComms& comms, bool grad) {
  std::map<std::string, Tensor> out = gather_global(plan, comms, grad);
  mesh::Communicator& pp = comms.group(groups::kPp);
  if (pp.size() == 1) return out;
  const std::vector<ParamSpec> specs = param_specs(config.model);
  for (int s = 0; s < pp.size(); ++s) {
    const StageLayers span =
        stage_layers(config.model.layers, pp.size(), s, config.model.pp_layers);
    for (const ParamSpec& spec : specs) {
      if (!stage_reports(spec, span)) continue;  // a tied embed.tok: the first stage's copy
      Tensor t = s == pp.rank()
                     ? out.at(spec.name)
                     : Tensor::empty(spec.shape, kernels::DType::kFloat32, kernels::Device::cpu());
      pp.broadcast(t, s);
      out[spec.name] = t;
    }
  }
  return out;
}

}  // namespace

std::map<std::string, Tensor> TrainingSession::gather_params() {
  return gather_all_stages(impl_->config, impl_->plan, impl_->comms, false);
}
std::vector<TensorDigest> TrainingSession::digests() {
  // The forward's FP8 state ("fp8/<key>", taken at the step's start), then in canonical
  // parameter order (embeddings, layers in order, head) the gradients and the weights the step's
  // optimizer update produced from them, then the FP8 state after the step ("updated/fp8/<key>":
  // the delayed scales and amax histories updated by the step, the re-quantized FP8 weights).
  MP_CHECK(impl_->options.trace,
           "TrainingSession::digests needs RunOptions::trace: the forward's FP8 state is taken at "
           "each step's start only when tracing");
  std::vector<TensorDigest> d = std::move(impl_->fp8_trace_before);
  impl_->fp8_trace_before.clear();
  const std::map<std::string, Tensor> grads =
      gather_all_stages(impl_->config, impl_->plan, impl_->comms, true);
  const std::map<std::string, Tensor> weights =
      gather_all_stages(impl_->config, impl_->plan, impl_->comms, false);
  // Every stage's parameters in canonical order (with one stage: the plan's own order).
  const std::vector<ParamSpec> specs = param_specs(impl_->config.model);
  for (const ParamSpec& p : specs) d.push_back(digest("grad/" + p.name, grads.at(p.name)));
  for (const ParamSpec& p : specs) d.push_back(digest("param/" + p.name, weights.at(p.name)));
  for (TensorDigest& u : fp8_state_digests(impl_->plan, impl_->state, impl_->comms, "updated/"))
    d.push_back(std::move(u));
  return d;
}
int64_t TrainingSession::steps_done() const { return impl_->step; }
MemoryBreakdown TrainingSession::memory() const { return impl_->mem; }
const std::vector<std::string>& TrainingSession::notes() const { return impl_->notes.list; }
const StepTime& TrainingSession::last_time() const { return impl_->time; }
const PipelineStepTime& TrainingSession::last_pipeline_time() const { return impl_->pp_time; }
RankPipeline TrainingSession::pipeline_stage() const {
  const StageLayers& st = impl_->plan.stage();
  RankPipeline p;
  p.stage = impl_->mesh.stage(impl_->rank);
  p.first_layer = st.first;
  p.layers = st.count;
  return p;
}
std::vector<AllGatherParity> TrainingSession::parity() { return impl_->fp8->parity(); }
std::vector<mesh::CollectiveCall> TrainingSession::collective_calls() const {
  return impl_->recorder ? impl_->recorder->calls() : std::vector<mesh::CollectiveCall>{};
}

}  // namespace meshproof::engine
