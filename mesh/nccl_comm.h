// The `nccl` communicator: device buffers, one rank per GPU, one NCCL communicator per mesh group
// (ncclCommSplit of a world communicator). Two ways to build the world communicator:
//  - bootstrap_mpi: one process per rank under mpirun; rank 0's ncclUniqueId is broadcast over
//    MPI_COMM_WORLD; each process uses GPU (node-local rank % visible GPUs);
//  - run_single_process: one process drives world_size GPUs (ncclCommInitAll), one thread per
//    rank, like the local launcher.
// Collectives are blocking (the rank's stream is waited on) so that accounting times are real.
// Waiting polls the stream and ncclCommGetAsyncError, so an NCCL failure or (single-process) an
// exception on another rank aborts the communicators instead of hanging.
// NCCL picks its own reduction order: results are not bitwise equal to local/mpi.
//
// Builds without CUDA compile this header; using it throws an input error.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "kernels/runtime.h"
#include "mesh/communicator.h"
#include "mesh/device_mesh.h"

namespace meshproof::mesh {

class NcclRankComms;

// Single process, one GPU per rank (GPUs 0..world_size-1): runs fn on one thread per rank with
// its context installed; rethrows the first error after aborting the others.
void run_nccl_single_process(const DeviceMesh& mesh, const std::function<void(NcclRankComms&)>& fn);

class NcclRankComms final : public RankComms {
 public:
  // Needs MPI initialised (an MpiSession) and MPI world size == mesh ranks. Collective.
  static NcclRankComms bootstrap_mpi(const DeviceMesh& mesh);

  NcclRankComms(NcclRankComms&&) noexcept;
  ~NcclRankComms() override;

  int rank() const override { return rank_; }
  const DeviceMesh& mesh() const override { return mesh_; }
  Communicator& group(DimSet dims) override;
  // Device and stream of this rank: install it (kernels::ScopedRankContext) before allocating.
  const kernels::RankContext& context() const { return context_; }

  struct State;

 private:
  friend void run_nccl_single_process(const DeviceMesh& mesh,
                                      const std::function<void(NcclRankComms&)>& fn);
  NcclRankComms(DeviceMesh mesh, int rank);

  DeviceMesh mesh_;
  int rank_ = 0;
  kernels::RankContext context_;
  std::unique_ptr<State> state_;
};

// Single process, one GPU per rank (GPUs 0..world_size-1): runs fn on one thread per rank with
// its context installed; rethrows the first error after aborting the others.
void run_nccl_single_process(const DeviceMesh& mesh, const std::function<void(NcclRankComms&)>& fn);

}  // namespace meshproof::mesh
