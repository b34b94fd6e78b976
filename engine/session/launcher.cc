// The launcher (engine/session/session.h run_on_ranks, run_training): builds the mesh's
// communicators (LocalWorld threads for launcher "local", this process as one rank of
// MPI_COMM_WORLD for "mpi"), runs one TrainingSession per rank and collects the global results and
// the per-rank reports.
#include <algorithm>
#include <chrono>
#include <mutex>

#include "engine/config/run_rules.h"
#include "engine/session/session.h"
#include "engine/session/session_trace.h"
#include "kernels/core/device.h"
#include "kernels/core/device_reserve.h"
#include "kernels/core/error.h"
#include "mesh/local/local_comm.h"
#include "mesh/mpi/mpi_comm.h"
#include "mesh/mpi/split_comm.h"
#include "mesh/nccl/nccl_comm.h"

namespace meshproof::engine {

using kernels::Tensor;
using mesh::DimSet;

namespace {

RankReport rank_report(TrainingSession& s, mesh::RankComms& comms) {
  RankReport r;
  r.rank = comms.rank();
  r.coords = comms.mesh().coords(r.rank);
  r.memory = s.memory();
  r.device_reserves = kernels::device_reserves(kernels::current_context().device);
  r.calls = s.collective_calls();
  for (DimSet d : all_mesh_groups()) {
    mesh::Communicator& c = comms.group(d);
    if (c.size() == 1) continue;
    for (int k = 0; k < mesh::kNumCollectiveKinds; ++k) {
      const auto kind = static_cast<mesh::CollectiveKind>(k);
      const mesh::CollectiveStats& st = c.stats(kind);
      if (st.count == 0) continue;
      r.collectives.push_back({std::string(mesh::collective_name(kind)), d.str(), st.count,
                               st.bytes.value, st.seconds});
    }
  }
  return r;
}

// The body every rank runs; rank 0 (or the only rank) fills `result`'s global parts.
void run_rank(const RunOptions& options, mesh::RankComms& comms, RunResult& result,
              std::mutex& mu) {
  TrainingSession session(options, comms);
  if (options.before_start) {
    options.before_start(session.state(), comms);
    session.load_scalars();
  }
  const int64_t steps = options.steps > 0 ? options.steps : options.config.training.steps;
  using Clock = std::chrono::steady_clock;
  // The global results (metrics, traces, final parameters) are the same on every rank: rank 0
  // hands them out, and with launcher mpi every process does (each is the only rank it has).
  const bool lead = comms.rank() == 0 || options.launcher == "mpi";
  const bool pipelined = options.mesh.pp > 1;
  std::vector<PipelineStepTime> pipeline_times;  // this rank's, per step (pp > 1)
  for (int64_t i = 0; i < steps; ++i) {
    const StepMetrics m = session.step();
    if (pipelined) pipeline_times.push_back(session.last_pipeline_time());
    std::vector<TensorDigest> d;
    if (options.trace) d = session.digests();
    StepTime time = session.last_time();
    if (options.after_step) {
      const auto t0 = Clock::now();
      const bool saved = options.after_step(session.state(), comms, session.steps_done());
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      time.total += seconds;
      if (saved) time.checkpoint = seconds;
    }
    if (lead) {
      result.metrics.push_back(m);
      result.times.push_back(time);
      if (options.trace) result.trace.push_back(std::move(d));
      if (options.on_step) options.on_step(m);
    }
  }
  std::map<std::string, Tensor> final_params = session.gather_params();
  std::vector<AllGatherParity> parity = session.parity();  // collective with stages
  RankReport report = rank_report(session, comms);
  if (pipelined) {
    report.pipeline = session.pipeline_stage();
    report.pipeline.steps = std::move(pipeline_times);
  }
  std::lock_guard<std::mutex> lock(mu);
  result.ranks.push_back(std::move(report));
  if (lead) {
    result.final_params = std::move(final_params);
    result.notes = session.notes();
    result.parity = std::move(parity);
  }
}

}  // namespace

void run_on_ranks(const RunOptions& options, const std::function<void(mesh::RankComms&)>& body,
                  const std::function<void()>& after) {
  // Every input rule, the thread count and memory of this machine included, before any rank
  // thread starts.
  require_valid_run(options);
  const mesh::DeviceMesh dmesh = options.mesh.device_mesh();
  if (options.backend.is_cuda()) {
    const kernels::CudaStatus& cuda = kernels::cuda_status();
    MP_CHECK_INPUT(cuda.usable, "run_training: backend {} is not usable here: {}",
                   options.backend.str(), cuda.reason);
  }
  if (options.launcher == "local") {
    mesh::LocalWorld world(dmesh, {.device = options.backend});
    world.run(body);
    if (after) after();
  } else if (options.launcher == "mpi") {
    // MPI cannot be initialised again after MPI_Finalize, and a process may train many times (a
    // scenario's checks, several scenarios): initialised on first use, finalised at exit.
    static mesh::MpiSession mpi(nullptr, nullptr);
    mesh::MpiRankComms host(dmesh);
    if (options.backend.is_cuda()) {
      // One GPU per process (node-local rank modulo the visible GPUs): host buffers over MPI,
      // device buffers (the model's tensor-parallel collectives) over NCCL. The NCCL
      // communicators are made once per process and mesh and reused by every later run on it
      // (mesh/nccl/nccl_comm.h); a failed run aborts them and drops them from the cache.
      mesh::NcclRankComms& nccl = mesh::nccl_comms_for_mpi(dmesh);
      try {
        const kernels::ScopedRankContext context(nccl.context());
        mesh::SplitRankComms comms(host, nccl);
        body(comms);
      } catch (...) {
        mesh::discard_nccl_comms_for_mpi(dmesh);
        throw;
      }
    } else {
      body(host);
    }
    if (after) after();
  } else {
    MP_FAIL_INPUT("launcher '{}': expected 'local' or 'mpi'", options.launcher);
  }
}

RunResult run_training(const RunOptions& options) {
  RunResult result;
  std::mutex mu;
  run_on_ranks(
      options, [&](mesh::RankComms& comms) { run_rank(options, comms, result, mu); },
      [&] {
        // Tensors made on a rank thread are accounted to that rank's tracker, which dies with
        // the world: hand out copies owned by the caller's context.
        for (auto& [name, t] : result.final_params) t = t.clone();
      });
  std::sort(result.ranks.begin(), result.ranks.end(),
            [](const RankReport& a, const RankReport& b) { return a.rank < b.rank; });
  return result;
}

}  // namespace meshproof::engine
