// Pipeline parallelism's parts that do not need the model split (docs/design.md, "Pipeline
// parallelism"): the split of the layers over pp stages; the per-stage order of forward and
// backward micro-batch passes (GPipe, 1F1B); a unit-time simulation of a schedule over all
// stages that checks its send/recv dependencies and measures its bubble and in-flight
// activations; and the executor that plays one stage's order over the pp group's send/recv
// (run_stage_schedule), which the training session drives with the model's stage passes
// (engine/session/session.cc; docs/design.md section 33). These parts are tested on their own
// (tests/engine/pipeline/pipeline_test.cc), the pipelined step in
// tests/engine/pipeline/pipeline_training_test.cc.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "engine/config/config.h"
#include "kernels/core/tensor.h"
#include "mesh/core/communicator.h"

namespace meshproof::engine {

// GPipe runs every micro-batch's forward, then every backward; 1F1B (PipeDream-flush) runs
// (stages - stage - 1) warm-up forwards, then alternates one forward and one backward, then
// drains the backwards. Both run the backwards in micro-batch order, so every parameter's
// gradient accumulates micro-batch 0 first, as with one stage.
// (PpSchedule and its names are in engine/config/config.h: TrainingConfig::pp_schedule.)
std::string_view pp_schedule_name(PpSchedule s);  // "gpipe", "1f1b"

// The layers of each of `pp` stages: `split` when it is non-empty (pp entries, each >= 1,
// summing to `layers`: an input error naming the split otherwise), else as even as possible
// with the earlier stages taking the extra layers (layers = 7, pp = 3: [3, 2, 2]). Needs
// 1 <= pp <= layers (input error).
std::vector<int64_t> stage_layer_counts(int64_t layers, int pp,
                                        const std::vector<int64_t>& split = {});

// The layer range of one stage: layers [first, first + count).
struct StageLayers {
  int64_t first = 0;         // first layer of the stage
  int64_t count = 0;         // layers in the stage (>= 1)
  bool first_stage = false;  // holds the embeddings
  bool last_stage = false;   // holds the final norm, LM head and loss
};
StageLayers stage_layers(int64_t layers, int pp, int stage, const std::vector<int64_t>& split = {});

enum class PpPass : uint8_t { kForward, kBackward };

// One pass of one micro-batch on one stage. A forward receives its input activation from
// stage - 1 (the first stage reads tokens) and sends its output to stage + 1 (the last stage
// computes the loss); a backward receives its output gradient from stage + 1 (the last stage
// starts from the loss) and sends its input gradient to stage - 1.
struct PpStep {
  PpPass pass = PpPass::kForward;
  int64_t micro_batch = 0;
  // The stage's final backward of the optimizer step: the one after which the deferred gradient
  // reduction runs (reduce-scatter over dp_shard, HSDP all-reduce), NeMo's "last backward". Set
  // on exactly one step per stage. Under 1F1B it is not the step after the last forward, so an
  // executor must take it from here, never infer it from the forward count.
  bool last_backward = false;
  bool operator==(const PpStep&) const = default;
};

// Stage `stage`'s passes over `micro_batches` micro-batches, in execution order: every
// micro-batch's forward and backward exactly once, each forward before its backward.
// Needs 0 <= stage < pp and micro_batches >= 1 (input errors).
std::vector<PpStep> stage_schedule(PpSchedule schedule, int pp, int stage, int64_t micro_batches);

// Every micro-batch's forward in order and no backward, the same list on every stage: the MoE
// routing pre-pass under pipeline stages (docs/design.md section 33), run by run_stage_schedule.
// Its programs are a chain (each stage receives micro-batch mb before it sends it on, and the
// last stage sends nothing), free of deadlocks with eager and rendezvous sends: check_programs
// plays them in tests/engine/pipeline/pipeline_test.cc. Needs micro_batches >= 1 (input error).
std::vector<PpStep> forward_sweep(int64_t micro_batches);

// A schedule played on all stages in unit time: a forward costs `forward_cost`, a backward
// `backward_cost`; a pass starts when its stage is free and its input has arrived (the
// neighbour's pass finished; sends are buffered and take no time, as the local communicator's).
// Throws (internal error naming the stuck stages and their passes) when the stages' orders
// deadlock.
struct ScheduleTimeline {
  int64_t makespan = 0;                 // finish time of the last pass on any stage
  std::vector<int64_t> busy;            // [pp] time each stage spends in passes
  std::vector<int64_t> peak_in_flight;  // [pp] most micro-batches forwarded, not yet backwarded
  // Stage s idle for (makespan - busy[s]) of the step: the pipeline bubble.
  double bubble_fraction(int stage) const;
};
ScheduleTimeline simulate_schedule(const std::vector<std::vector<PpStep>>& stages,
                                   int64_t forward_cost, int64_t backward_cost);
// Every stage's stage_schedule, simulated.
ScheduleTimeline simulate_schedule(PpSchedule schedule, int pp, int64_t micro_batches,
                                   int64_t forward_cost, int64_t backward_cost);

// One stage's computation, called by run_stage_schedule in its schedule's order.
class StagePasses {
 public:
  virtual ~StagePasses() = default;
  // Buffers the executor receives into (shape and dtype of what the neighbour sends): the
  // activation entering this stage for micro-batch `mb` (not asked on the first stage) and the
  // gradient of this stage's output (not asked on the last stage).
  virtual kernels::Tensor input_buffer(int64_t mb) = 0;
  virtual kernels::Tensor grad_output_buffer(int64_t mb) = 0;
  // Forward of `mb`: `input` as received (undefined on the first stage, which reads its own
  // data); returns the activation for the next stage (ignored on the last stage). The stage
  // keeps what its backward needs.
  virtual kernels::Tensor forward(int64_t mb, const kernels::Tensor& input) = 0;
  // Backward of `mb`: `grad_output` as received (undefined on the last stage, which starts from
  // its loss); returns the gradient of its input for the previous stage (ignored on the first).
  // `last_backward` is PpStep::last_backward: the stage runs its deferred gradient reduction
  // after this backward, and only then.
  virtual kernels::Tensor backward(int64_t mb, const kernels::Tensor& grad_output,
                                   bool last_backward) = 0;
};

// The communication and computation of one stage, in order: what run_stage_schedule executes
// and check_programs plays. A pass's input is received (kRecv) before its computation
// (kCompute), its output sent (kSend) after. Where two neighbours would each send to the other
// at once (1F1B's steady state: the lower stage sends a forward's activation up and next waits
// for a gradient from above, while the upper stage sends a backward's gradient down and next
// waits for an activation from below), the upper stage receives its next input before sending:
// with rendezvous sends (MPI above its eager limit) the crossing sends would otherwise wait on
// each other forever.
struct PpOp {
  enum class Kind : uint8_t { kRecv, kCompute, kSend };
  Kind kind = Kind::kCompute;
  PpStep step;    // the pass whose input (kRecv), computation or output (kSend) this is
  int peer = -1;  // kRecv, kSend: the neighbouring stage
  bool operator==(const PpOp&) const = default;
};
// Stage `stage` of `stages`: the program of its `steps` (stage_schedule's list).
std::vector<PpOp> stage_program(const std::vector<PpStep>& steps, int stage, int stages);

// Plays every stage's program (programs[s] for stage s) with sends that are buffered (`eager`,
// the local communicator) or that complete only when the receiver is at the matching receive
// (rendezvous, the worst case of MPI); every receive must get the message of the pass it names,
// in order. Throws (internal error) naming the stuck stages and their ops on a deadlock, and on
// a message received by a receive of another pass.
void check_programs(const std::vector<std::vector<PpOp>>& programs, bool eager);

// Executes `steps` (this stage's stage_schedule) on stage pp.rank() of pp.size() as
// stage_program orders it: receives over `pp`, calls `passes`, sends. Every stage of the group
// calls it with its own list of the same schedule. check_programs proves every gpipe and 1f1b
// program free of deadlocks with eager and with rendezvous sends
// (tests/engine/pipeline/pipeline_test.cc).
void run_stage_schedule(mesh::Communicator& pp, const std::vector<PpStep>& steps,
                        StagePasses& passes);

}  // namespace meshproof::engine
