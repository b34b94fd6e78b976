// The engine's entry point for a whole run on any mesh (docs/design.md sections 2 and 5): options
// in, per-step metrics, per-rank reports and the final global parameters out.
//
// run_training() builds the mesh's communicators (LocalWorld threads for launcher "local", this
// process as one rank of MPI_COMM_WORLD for "mpi"), constructs one TrainingSession per rank and
// runs `steps` optimizer steps. A TrainingSession is one rank's share of the run: it materialises
// only its own shards (Philox init keyed by global element index, so every mesh builds the same
// global model) and runs the single-rank model math (engine/model/model.h) on gathered weights.
//
// Sharded execution (docs/design.md section 5):
//   - placements: Shard(0) over dp_shard (FSDP), Replicate over dp_replicate (HSDP); with tp > 1
//     qkv/fc1 weights+biases Shard(0) over tp with StridedShard(0, sf=tp) over dp_shard, proj/fc2
//     weights Shard(1) over tp, everything else replicated over tp;
//   - per step and micro-batch, per FSDP unit (each layer; the root unit holds embeddings, final
//     norm and lm_head; engine/model/model.h UnitHooks): the unit's weights are all-gathered over
//     dp_shard into their TP-local boxes right before the model reaches it (padded to equal
//     chunk sizes, torch.chunk boxes; padding never reaches the math), and freed after the
//     layer's forward (fsdp.reshard_after_forward, gathered again for its backward) or kept
//     until its backward; forward/backward on this data-parallel rank's rows (rows
//     [j*B/dp, (j+1)*B/dp), j over dp_replicate x dp_shard; TP ranks share rows) with the TP
//     collectives inside the model (TpContext, sequence parallelism included); fp32 gradients
//     accumulate over micro-batches (deferred sync) and each unit's are reduce-scattered (avg)
//     over dp_shard and all-reduced (avg) over dp_replicate right after its backward in the last
//     micro-batch (fsdp.sync_each_micro_batch: after every micro-batch, reduced shards summed);
//     global gradient norm with every element counted once; AdamW on local shards;
//   - FP8: every per-tensor amax (current scaling, delayed-scaling histories) is MAX-reduced over
//     the ranks that hold a piece of its tensor, an explicit table per linear kind and role
//     (engine/parallel/amax_groups.h; weights over dp_shard + tp, activations and gradients over
//     dp_replicate + dp_shard, plus tp where the tensor is split over tp), overridable per entry
//     (RunOptions::amax_groups), so ranks quantize with the single-rank scales;
//     fsdp.fp8_all_gather quantizes the GEMM weights shard-wise once per step and gathers FP8
//     bytes (engine/parallel/fp8_all_gather.h), bitwise equal to the high-precision gather;
//     fsdp.fp8_params keeps the GEMM weights as FP8 shards (+ scale_inv) re-quantized from the
//     fp32 master after every optimizer step, gathered in FP8 and saved in checkpoints
//     ("fp8/params/<name>/..."), so a resumed run computes with the loaded FP8 weights.
// Backends: the model computes on the rank's device (CPU, or CUDA: virtual ranks on cuda:0 with
// launcher local, one GPU per process with launcher mpi); on CUDA the fp32 masters, AdamW
// moments, reduced gradients and the data-parallel collectives live there too (docs/design.md,
// "Device-resident training state"; mpi + CUDA: device buffers over NCCL, host buffers over
// MPI, mesh/mpi/split_comm.h).
// Current limits (input errors, not silent): sequence parallelism needs dropout 0; fp8_params
// needs current, delayed or mxfp8 (mxfp8: 32-row-aligned shards).
// Pipeline stages (mesh.pp > 1, docs/design.md section 33): each rank's plan holds its stage's
// parameters; a step runs the stage's GPipe/1F1B passes over the pp group
// (engine/pipeline/pipeline.h), the deferred gradient reduction after the schedule's last backward;
// bitwise the one-stage step. What stages do not support is refused by engine/config/run_rules.cc.
// Faults act through the named points of engine/faults/fault_hooks.h (weight gather padding, amax
// group, state layout, gradient replicas, backward weight; the checkpoint code asks the save and
// restore points). The session is assembled from parts with one job each (docs/design.md
// section 20): engine/parallel/shard_plan.h, fp8_weights.h, fsdp_units.h, optimizer.h
// (sharded_optimizer_step), session_trace.h; the launcher is engine/session/launcher.cc.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/checkpoint/sharded_state.h"
#include "engine/config/config.h"
#include "engine/config/mesh_spec.h"
#include "engine/faults/faults.h"
#include "engine/model/trainer.h"
#include "engine/parallel/amax_groups.h"
#include "kernels/core/device_reserve.h"
#include "kernels/core/runtime.h"
#include "kernels/core/tensor.h"
#include "mesh/core/collective_recorder.h"
#include "mesh/core/communicator.h"
#include "mesh/core/layout.h"

namespace meshproof::engine {

struct FsdpOptions {
  bool reshard_after_forward = true;  // free gathered weights after forward, re-gather for bwd
  bool fp8_all_gather = false;        // gather FP8 bytes + scales instead of fp32/bf16
  bool fp8_params = false;            // FP8 primary weights
  // Reduce-scatter (and HSDP all-reduce) the gradients after every micro-batch's backward and
  // accumulate the reduced shards, instead of accumulating locally and reducing once after the
  // last micro-batch (deferred sync, the default). Same result up to fp32 summation order;
  // micro_batches times the gradient collectives.
  bool sync_each_micro_batch = false;
};

// A digest of one tensor at one point of a step (first-diverging-tensor reports): hash, sum and
// L2 norm summarise it; the values let a check find the first diverging (step, tensor) of two
// runs and measure that tensor's max abs/rel error and ULP distance at that step. Tracing therefore
// holds 2 x (parameter count) x 4 bytes per step (gradients and weights): about 1 MB per step for
// the library's scenario models, plus twice the FP8 state (before and after the step; with
// fsdp.fp8_params one more fp32 value per weight element).
struct TensorDigest {
  std::string name;           // e.g. "grad/layers.0.attn.qkv.weight", "param/embed.tok",
                              // "fp8/layers.0.attn.qkv/input/scale", "updated/fp8/..."
  kernels::Shape shape;       // global shape
  uint64_t hash = 0;          // XXH64 (seed 0) of the fp32 bytes of the global tensor
  double sum = 0;             // sum of elements (double)
  double l2 = 0;              // L2 norm (double)
  std::vector<float> values;  // [shape.numel()] the global fp32 values, row-major
};

// allgather_parity (docs/design.md section 7): one FP8 all-gathered weight at one step compared
// with quantizing the high-precision gathered weight. Bytes are the rowwise and columnwise data and
// scale_inv buffers of both (equal sizes); parity holds when mismatched_bytes == 0. Every rank
// compares its own gathered copy; the session's records (RunResult::parity) sum bytes and
// mismatched_bytes over all ranks and take the largest max_abs_error.
struct AllGatherParity {
  int64_t step = 0;                // 0-based optimizer step, as StepMetrics::step
  std::string tensor;              // parameter name, e.g. "layers.0.attn.qkv.weight"
  int64_t bytes = 0;               // bytes compared
  int64_t mismatched_bytes = 0;    // bytes that differ
  double max_abs_error = 0;        // max |dequant(gathered) - dequant(reference)| over elements
  double scale_inv = 0;            // first rowwise scale_inv of the gathered weight (nvfp4:
                                   // its global decode scale 1/S_enc, the second level)
  double reference_scale_inv = 0;  // the same of the reference quantization
};

struct RunOptions {
  Config config;  // model, recipe, training, data, seed (engine/config/config.h)
  MeshSpec mesh;
  FsdpOptions fsdp;
  kernels::Device backend = kernels::Device::cpu();
  std::string launcher = "local";  // "local" (ranks are threads) or "mpi" (this process = 1 rank)
  FaultInjection faults;           // engine/faults/faults.h
  // Amax reduction groups replacing entries of the default table (engine/parallel/amax_groups.h);
  // empty: the defaults. Tests and fault injection use it; amax_not_reduced empties every group.
  AmaxGroupOverrides amax_groups;
  int64_t steps = 0;  // optimizer steps to run in this call (0: config.training.steps)
  // Per-step digests and values of every global gradient and weight and of the FP8 state
  // (RunResult::trace, TrainingSession::digests); off: no cost.
  bool trace = false;
  // Compare every FP8 all-gathered weight with quantize(gather(shard)) (RunResult::parity).
  bool allgather_parity = false;
  // Record every collective the engine attributes to a parameter, per step
  // (RankReport::calls; the collectives check, docs/design.md section 29); off: no cost.
  bool record_collectives = false;
  // Progress, called on rank 0 (launcher mpi: on every process) after each step.
  std::function<void(const StepMetrics&)> on_step;
  // Checkpoint hooks (the harness fills them with engine/checkpoint/checkpoint.h's load and save).
  // Called on every rank, collectively, with the rank's communicators (comms.rank() is the rank):
  //   before_start(state, comms): after construction, before the first step (load: write into
  //     the entries' tensors and scalars, then the session re-reads the scalars, so the step
  //     counter, data cursor and LR schedule continue from the loaded step);
  //   after_step(state, comms, steps_done): after each optimizer step (steps_done = steps taken,
  //     counting the loaded ones); returns whether it saved a checkpoint, and then its wall time
  //     on rank 0 is the step's StepTime::checkpoint.
  std::function<void(ShardedState& state, mesh::RankComms& comms)> before_start;
  std::function<bool(ShardedState& state, mesh::RankComms& comms, int64_t steps_done)> after_step;
};

struct MemoryBreakdown {
  int64_t params = 0;            // bytes of local fp32 master shards (+ FP8 primary weights)
  int64_t grads = 0;             // bytes of local fp32 gradient shards
  int64_t optimizer = 0;         // bytes of local AdamW moments
  int64_t gathered_weights = 0;  // bytes of the gathered (unsharded) compute weights, at peak
  int64_t activations = 0;       // tracker peak minus the above (activations, temporaries)
  int64_t peak = 0;              // peak bytes of the rank's memory tracker during the run
};

struct CollectiveRecord {
  std::string kind;   // "all_gather", "reduce_scatter", "all_reduce", ...
  std::string group;  // "dp_shard", "dp_replicate", "tp", "dp_replicate+dp_shard", ...
  int64_t count = 0;
  int64_t bytes = 0;  // nccl-tests sizes summed (mesh/core/communicator.h)
  double seconds = 0;
};

// One optimizer step of one rank of a pipelined run (mesh.pp > 1; docs/design.md section 38),
// seconds of the rank's own wall clock (steady_clock; on CUDA the same host clock, each pass ending
// with a synchronisation of the rank's stream so that its kernels count in it). The parts are
// disjoint, so forward + backward + p2p_wait + reduction + optimizer <= total (the rest: the loss
// sums, the step's bookkeeping).
struct PipelineStepTime {
  double forward = 0;    // the stage's forward passes (their weight gathers and TP collectives in)
  double backward = 0;   // the backward passes, without the deferred gradient reduction in them
  double p2p_wait = 0;   // blocked in send/recv of activations and gradients (the idle time)
  double reduction = 0;  // the deferred gradient reduction (reduce-scatter, HSDP all-reduce)
  double optimizer = 0;  // global norm (its reductions, over pp too), clipping, AdamW, FP8 weights
  double total = 0;      // the whole step as the session runs it (no checkpoint hook)
};

// A rank's stage of a pipelined run and its per-step times; empty `steps` with pp = 1.
struct RankPipeline {
  int stage = 0;
  int64_t first_layer = 0;  // the stage's layers [first_layer, first_layer + layers)
  int64_t layers = 0;
  std::vector<PipelineStepTime> steps;  // one per step run, in order (pp > 1 only)
};

struct RankReport {
  int rank = 0;
  mesh::Coords coords{};  // (dp_replicate, dp_shard, tp) coordinates
  MemoryBreakdown memory;
  RankPipeline pipeline;  // mesh.pp > 1: the rank's stage and per-step pipeline times
  // Device memory outside the tracker (kernels/core/device_reserve.h) on this rank's device at the
  // end of the run: the CUDA pool's reserve, NCCL buffers, cuBLASLt workspaces; empty on the CPU.
  std::vector<kernels::NamedReserve> device_reserves;
  std::vector<CollectiveRecord> collectives;  // non-zero counts only
  // RunOptions::record_collectives: each collective attributed to a parameter, in issue order.
  std::vector<mesh::CollectiveCall> calls;
};

// Wall time of one step on rank 0, by phase.
struct StepTime {
  // The phases exclude the collectives that ran inside them, so compute + collectives +
  // optimizer <= total (the rest: loss reduction bookkeeping, host overhead).
  double compute = 0;  // forward + backward, without the per-unit gathers and grad reductions
  std::map<std::string, double> collectives;  // seconds per collective kind
  double optimizer = 0;                       // clipping + AdamW, without the grad-norm reduction
  double checkpoint = 0;  // the after_step hook when it saved a checkpoint, else 0
  double total = 0;       // the whole step, the after_step hook included
};

struct RunResult {
  // Global parts (metrics, trace, parity, final_params, notes) from rank 0; with launcher mpi
  // every process holds them.
  std::vector<StepMetrics> metrics;              // one per step run
  std::vector<std::vector<TensorDigest>> trace;  // [step][tensor] when RunOptions::trace
  std::vector<RankReport> ranks;                 // every rank (launcher mpi: this rank only)
  std::vector<std::string> notes;                // reported fallbacks and behaviour changes
  std::vector<StepTime> times;                   // per step, rank 0 (mpi: this process)
  std::vector<AllGatherParity> parity;           // RunOptions::allgather_parity
  // Final fp32 master weights, global (unsharded), keyed by parameter name.
  std::map<std::string, kernels::Tensor> final_params;
};

// Runs `body` once per rank of options.mesh on options.launcher: "local" on one thread per rank
// of a LocalWorld on options.backend; "mpi" as this process's rank of MPI_COMM_WORLD (host
// buffers over MPI; with a CUDA backend device buffers over NCCL, mesh/mpi/split_comm.h). Then
// `after` on the calling thread while the ranks' memory contexts are alive (copy out tensors
// made on rank threads there). MPI is initialised on first use and finalised at process exit, so
// one process may run many times (a scenario's checks). kInput errors as run_training's.
void run_on_ranks(const RunOptions& options, const std::function<void(mesh::RankComms&)>& body,
                  const std::function<void()>& after = {});

// Runs options.steps steps on options.mesh. Input errors (bad mesh, mesh size != MPI world size,
// batch not divisible by the data-parallel size, unsupported combination) are kInput.
RunResult run_training(const RunOptions& options);

// One rank's share of a run. Construct on every rank of `comms` (collective order: every rank
// calls the same methods in the same order).
class TrainingSession {
 public:
  TrainingSession(const RunOptions& options, mesh::RankComms& comms);
  ~TrainingSession();
  TrainingSession(const TrainingSession&) = delete;
  TrainingSession& operator=(const TrainingSession&) = delete;

  // One optimizer step (collective). Metrics are global (identical on every rank).
  StepMetrics step();
  // Live state: entries share storage with the training tensors (see
  // engine/checkpoint/sharded_state.h).
  ShardedState& state();
  // Re-reads the scalars of state() (after a checkpoint load wrote them).
  void load_scalars();
  // Global fp32 master weights gathered from all shards (collective).
  std::map<std::string, kernels::Tensor> gather_params();
  // Digests of the last step (collective; needs RunOptions::trace): the FP8 state its forward
  // read ("fp8/<checkpoint key>"), its gradients ("grad/<param>"), the weights its update wrote
  // ("param/<param>") and the FP8 state after it ("updated/fp8/<checkpoint key>"), global fp32.
  std::vector<TensorDigest> digests();

  int64_t steps_done() const;
  MemoryBreakdown memory() const;
  const std::vector<std::string>& notes() const;
  const StepTime& last_time() const;
  // The last step's pipeline times (mesh.pp > 1; zeros with one stage) and the rank's stage.
  const PipelineStepTime& last_pipeline_time() const;
  RankPipeline pipeline_stage() const;  // stage, first_layer, layers; no steps
  // allgather_parity records of the steps run so far (RunOptions::allgather_parity; rank 0 holds
  // them, other ranks an empty list). With pipeline stages every stage's records, merged over
  // the pp group: a collective that every rank calls (Fp8WeightStore::parity).
  std::vector<AllGatherParity> parity();
  // RunOptions::record_collectives: this rank's recorded collectives so far (empty otherwise).
  std::vector<mesh::CollectiveCall> collective_calls() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshproof::engine
