// The `local` launcher: every rank of the mesh runs in this process ("virtual ranks"), as a thread
// of its own or, with more host ranks than CPUs, as a fiber on one worker thread per CPU
// (mesh/local/rank_fibers.h). Each rank installs its own kernels::RankContext (rank, device, CUDA
// stream, memory tracker),
// and collectives rendezvous in memory: members publish their buffers, wait for each other, then
// each member computes its own output from the others' buffers (host memcpy, or device-to-device
// copies and a rank-order reduction kernel on its own stream). Small host collectives publish a
// staged copy instead, so that nobody waits for the others to finish reading: one barrier per
// call (docs/design.md section 36, "Per-rank overhead"). The barrier sleeps on a futex.
//
// Failure handling: a member that waits longer than the timeout raises a kRuntime error naming
// the collective, the group and the members that never arrived. An exception on any rank aborts
// the world: ranks waiting in a collective wake and stop, and run() rethrows the first error.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include "kernels/core/runtime.h"
#include "mesh/core/communicator.h"
#include "mesh/core/device_mesh.h"
#include "mesh/local/rank_fibers.h"

namespace meshproof::mesh {

struct LocalWorldOptions {
  // Device of every virtual rank. CUDA: all ranks share that GPU, each with its own stream.
  kernels::Device device = kernels::Device::cpu();
  // How long a member waits for the others in one collective before failing (the watchdog;
  // default: MESHPROOF_COLLECTIVE_TIMEOUT or 300 s, mesh/core/communicator.h collective_timeout).
  std::chrono::milliseconds timeout = collective_timeout();
  // Threads or fibers (default: MESHPROOF_VIRTUAL_RANKS, mesh/local/rank_fibers.h). kAuto: fibers
  // when the host ranks outnumber the CPUs this process may use; device ranks are always threads.
  RankThreading threading = rank_threading_from_env();
  // Worker threads of the fibers; 0: as many as the CPUs this process may use (never more than
  // the ranks). Tests set 1 to put every rank on one worker.
  int fiber_workers = 0;
  // Starts one thread (a rank's, or a fiber worker's); empty: std::thread. Tests inject a start
  // failure through it (a machine out of threads throws std::system_error from std::thread's
  // constructor).
  std::function<std::thread(std::function<void()>)> start_thread = nullptr;
};

// How a local world of `ranks` ranks on `device` runs them: the number of fiber worker threads,
// or 0 for one thread per rank (also what the run rules count as the threads a run starts).
// `fiber_workers` as LocalWorldOptions::fiber_workers.
int local_fiber_workers(int ranks, kernels::Device device, RankThreading threading,
                        int fiber_workers = 0);
int local_fiber_workers(int ranks, const LocalWorldOptions& options);

class LocalWorld {
 public:
  explicit LocalWorld(DeviceMesh mesh, LocalWorldOptions options = {});
  ~LocalWorld();
  LocalWorld(const LocalWorld&) = delete;
  LocalWorld& operator=(const LocalWorld&) = delete;

  const DeviceMesh& mesh() const { return mesh_; }
  const LocalWorldOptions& options() const { return options_; }

  // Runs fn(comms) once per rank on mesh().world_size() threads and joins them. If any rank
  // throws, the others are aborted and the first error is rethrown (kernels::Error with the
  // rank prepended to its message, same kind). A rank thread that cannot start aborts the ranks
  // already running, joins them and throws kRuntime naming the rank: every failure path joins
  // every started thread (destroying a joinable std::thread would std::terminate).
  void run(const std::function<void(RankComms&)>& fn);

  // Per-rank memory accounting of the last run (live and peak bytes).
  const kernels::MemoryTracker& memory(int rank) const;
  // Per-rank host<->device copy counts of this world's runs (kernels/core/runtime.h CopyCounter).
  const kernels::CopyCounter& copies(int rank) const;

  struct Impl;

 private:
  DeviceMesh mesh_;
  LocalWorldOptions options_;
  std::vector<std::unique_ptr<kernels::MemoryTracker>> memory_;
  std::vector<std::unique_ptr<kernels::CopyCounter>> copies_;
};

}  // namespace meshproof::mesh
