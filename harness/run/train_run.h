// The harness's one door into the engine (engine::run_training, engine/session/session.h): maps a
// harness::Scenario onto the engine's run options (scenario -> engine::Config; its faults map onto
// engine::FaultInjection through the fault table, harness/faults/scenario_faults.h) and trains
// it, reporting each step. Everything engine-specific the runner and the checks need goes through
// here, so that the runner does not care whether the single-rank
// Trainer or the sharded session executes the run.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "engine/faults/faults.h"
#include "engine/model/params.h"
#include "engine/session/session.h"
#include "harness/scenario/scenario.h"
#include "kernels/core/error.h"
#include "reports/record/run_record.h"

namespace meshproof::harness {

// The scenario's engine::Config, checked by engine::validate() (kInput naming the engine key).
engine::Config to_engine_config(const Scenario& s);
// The same without any check (s.config(); engine::check_run reports every issue).
engine::Config engine_config_of(const Scenario& s);
// The scenario's config, mesh, FSDP options and launcher as engine::RunOptions, unchecked: what
// the loader hands to engine::check_run (engine/config/run_rules.h).
engine::RunOptions engine_run_options(const Scenario& s);

// The periodic checkpoints of a run (the scenario's `checkpoint` mapping with `every` > 0):
// step_NNNNNNN/ under `dir` after every `every`-th step and after the last step, each committed
// atomically (engine::save_checkpoint); after each commit the run removes its own oldest
// checkpoints beyond `keep_last`. Only rank 0 touches the filesystem outside the collective save.
struct CheckpointPlan {
  std::filesystem::path dir;
  int64_t every = 0;
  int64_t keep_last = 2;
};

// The checkpoints a run writes go under the scenario's checkpoint.dir, by default
// <out_dir>/<scenario folder>/checkpoints.
std::filesystem::path checkpoint_root(const Scenario& s, const std::filesystem::path& out_dir);

// Throws kInput (before any work) when periodic checkpoints (checkpoint.every > 0) would go into a
// folder that already holds a checkpoint (complete or .partial): a run never overwrites or prunes
// checkpoints it did not write.
void check_checkpoint_root_unused(const Scenario& s, const std::filesystem::path& root);

// The model a checkpoint belongs to, as recorded in its index (engine::CheckpointOptions::model):
// the scenario's canonical `model` mapping, field -> JSON text.
std::map<std::string, std::string> model_record(const Scenario& s);

// Checks that checkpoint `dir` (step_NNNNNNN/) can start scenario `s` and returns its step: the
// index reads, its recorded model equals the scenario's field by field and its step is below
// train.steps. kInput naming the checkpoint and the differing field otherwise.
int64_t check_start_checkpoint(const Scenario& s, const std::filesystem::path& dir);

// Loading the checkpoint a run starts from failed (a corrupt or missing chunk, a key the scenario
// does not have): the message names the key and file. The runner reports it as a failed
// `checkpoint` check.
class CheckpointLoadError : public kernels::Error {
 public:
  explicit CheckpointLoadError(const kernels::Error& e)
      : kernels::Error(e.kind(), e.file(), e.line(), e.expression(), e.message()) {}
};

struct TrainRequest {
  engine::FaultInjection faults;
  // Provenance recorded in every checkpoint the run writes: the scenario's hash as validate and
  // the goldens print it (harness::scenario_hash_hex of the scenario as loaded, before the CLI's
  // --backend/--launcher resolve it). Empty: the hash of the scenario passed in.
  std::string scenario_hash;
  // Periodic checkpoints (main run only).
  std::optional<CheckpointPlan> checkpoints;
  // Start from this checkpoint (step_NNNNNNN/, any mesh of the same model) and train the remaining
  // steps up to train.steps; step numbers, data cursor and LR schedule continue from it. A failed
  // load throws CheckpointLoadError.
  std::filesystem::path from_checkpoint;
  int64_t steps = -1;  // -1: s.train.steps
  bool trace = false;  // per-step per-tensor digests (TrainOutcome::trace)
  // Compare every FP8 all-gathered weight with quantizing the gathered weight
  // (TrainOutcome::parity; engine::RunOptions::allgather_parity).
  bool allgather_parity = false;
  // Record every collective attributed to a parameter (TrainOutcome::calls;
  // engine::RunOptions::record_collectives).
  bool record_collectives = false;
  // Called after each step with the step's metrics (1-based step) and the steps planned.
  std::function<void(const reports::StepMetrics&, int64_t total_steps)> on_step;
  // The resume check's save, taken by the main run (TrainOutcome::resume_saved): after this step
  // (1-based, absolute) the run saves into a folder it creates under resume_root, as
  // resume_scenario's first half would (resume_check_step<N>[.<k>]). 0: none.
  int64_t resume_save_at = 0;
  std::filesystem::path resume_root;
};

struct TrainOutcome {
  std::vector<reports::StepMetrics> steps;  // 1-based, in order
  engine::TensorMap final_params;           // global (unsharded) fp32 parameters after training
  std::vector<reports::RankMemory> memory;  // per rank
  // mesh.pp > 1: per stage (pipeline_stages); empty with one stage.
  std::vector<reports::PipelineStageRecord> pipeline;
  std::vector<reports::CollectiveStats> collectives;
  std::vector<std::string> notes;  // engine fallbacks and limitations the user must know
  std::string device;              // "cpu" or "cuda:0"
  std::vector<std::vector<engine::TensorDigest>> trace;  // [step][tensor] with request.trace
  std::vector<engine::AllGatherParity> parity;           // with request.allgather_parity
  // With request.record_collectives: per rank (the RankReport's rank), its recorded calls.
  std::vector<std::pair<int, std::vector<mesh::CollectiveCall>>> calls;
  // Periodic checkpoints kept, oldest first; for the resume check, the one folder it saved into.
  std::vector<std::filesystem::path> checkpoints;
  // With TrainRequest::resume_save_at: the step_N folder the main run saved for the resume check.
  std::filesystem::path resume_saved;
};

TrainOutcome train_scenario(const Scenario& s, const TrainRequest& request);

// The per-stage pipeline report of a run (docs/design.md section 38): the ranks grouped by their
// stage (RankReport::pipeline), each stage's phase times averaged over its ranks and the
// steady-state steps (reports::mean_pipeline_phases), its measured bubble
// (reports::bubble_fraction of the mean p2p wait and step), the bubble its schedule predicts
// (engine::simulate_schedule, forward 1, backward 2) and its ranks' peak memory. Empty for a
// one-stage run (options.mesh.pp == 1).
std::vector<reports::PipelineStageRecord> pipeline_stages(const engine::RunResult& result,
                                                          const engine::RunOptions& options);

// The scenario as engine::RunOptions (launcher, mesh, FSDP options, faults, steps, trace).
engine::RunOptions make_run_options(const Scenario& s, const TrainRequest& request);

struct ResumeRequest {
  int64_t at_step = 1;                   // save after this step (1-based, absolute)
  std::optional<engine::MeshSpec> mesh;  // resume on this mesh (default: the scenario's)
  engine::FaultInjection faults;         // engine and checkpoint faults (save/load side)
  // The check saves into a folder it creates under this root: resume_check_step<N>, or
  // resume_check_step<N>.<k> with the smallest k >= 2 that does not exist yet (a rerun into the
  // same folder never deletes or overwrites an earlier run's checkpoint).
  std::filesystem::path checkpoint_root;
  std::string scenario_hash;              // as TrainRequest::scenario_hash
  std::filesystem::path from_checkpoint;  // both halves start there (TrainRequest)
  bool trace = false;  // per-step per-tensor digests of both halves (TrainOutcome::trace)
  // Called on rank 0 after each step of both halves with the step's metrics (1-based step,
  // loss, grad_norm, lr, tokens; no timing) and the scenario's step count.
  std::function<void(const reports::StepMetrics&, int64_t total_steps)> on_step;
  // The main run of the same scenario, faults and start, which saved after at_step
  // (TrainRequest::resume_save_at, TrainOutcome::resume_saved): its first steps and trace are the
  // first half's, and only the second half is trained. The first half is the same computation
  // (the engine is deterministic, which the determinism check proves on its own), so reusing it
  // changes what is compared by nothing but the time it takes. Null: train the first half.
  const TrainOutcome* first_half = nullptr;
};

// The resume half of the resume check: train to at_step on the scenario's mesh (from
// from_checkpoint when given), save a checkpoint in a fresh folder under checkpoint_root,
// construct a fresh engine (on the resume mesh), load, and train to the end (with
// request.first_half, only the last part: the main run saved). Returns the stitched
// per-step metrics (the steps run, up to train.steps), trace (with request.trace) and the final
// global parameters.
TrainOutcome resume_scenario(const Scenario& s, const ResumeRequest& request);

struct StateRequest {
  int64_t at_step = 1;  // save after this step (1-based, absolute)
  std::optional<engine::MeshSpec>
      mesh;                       // load and save again on this mesh (default: the scenario's)
  engine::FaultInjection faults;  // engine and checkpoint faults (save/load side)
  // The check's folder: state_check_step<N>[.<k>] under this root, as ResumeRequest's.
  std::filesystem::path checkpoint_root;
  std::string scenario_hash;              // as TrainRequest::scenario_hash
  std::filesystem::path from_checkpoint;  // the first half starts there (TrainRequest)
  std::function<void(const reports::StepMetrics&, int64_t total_steps)> on_step;
};

// The three checkpoints of the state check (docs/design.md section 22), each a step_N folder:
struct StateOutcome {
  std::filesystem::path folder;  // the check's own folder (holds the three below)
  // The live state after at_step on the scenario's mesh, saved without the faults' save side
  // (what the run holds: the expected state).
  std::filesystem::path before;
  // The checkpoint under test: the same state saved with the faults (equal to `before` without
  // save-side faults; then the same folder).
  std::filesystem::path saved;
  // `saved` loaded (with the faults' load side) into a fresh engine on the state mesh and saved
  // again at once without the faults' save side: what the resumed engine holds.
  std::filesystem::path after;
  // The run's masters after at_step as its engine gathers them (global fp32, canonical order):
  // what the model/ keys of `before` must hold.
  engine::TensorMap params;
  std::vector<reports::StepMetrics> steps;  // the steps the first half ran
  std::vector<std::string> notes;
};

// Trains to at_step on the scenario's mesh (from from_checkpoint when given), saves `before` and
// `saved`, constructs a fresh engine on the state mesh, loads `saved` and saves `after` without
// running a step. Collective over the ranks of each half; rank 0 creates the folder.
StateOutcome state_roundtrip(const Scenario& s, const StateRequest& request);
// Launcher mpi: returns once every process of the launch has called it (a barrier over the
// scenario's ranks), so that rank 0 removes a check's files only after every process has read
// them. Launcher local: returns at once (the ranks are threads of this process).
void wait_for_every_process(const Scenario& s);

}  // namespace meshproof::harness
