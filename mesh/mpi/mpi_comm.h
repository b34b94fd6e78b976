// The `mpi` launcher: one process per rank under mpirun/srun, host (CPU) buffers, MPI
// collectives. Reductions are deterministic: members exchange the parts of their inputs they
// need (MPI_Alltoall of raw bytes; all_reduce then MPI_Allgathers the reduced chunks) and every
// member reduces in rank order with reduce_rank_order_host, the same function the local backend
// uses, so the two backends give bitwise-equal results. One communicator per mesh group, made
// with MPI_Comm_split.
//
// Builds without MPI (MESHPROOF_HAVE_MPI=0) compile this header; constructing anything throws
// an input error saying that MPI is not available.
#pragma once

#include <chrono>
#include <memory>

#include "mesh/core/communicator.h"
#include "mesh/core/device_mesh.h"

namespace meshproof::mesh {

// Initialises MPI if nobody has (MPI_THREAD_FUNNELED: only the main thread calls MPI) and
// finalises it on destruction if this session initialised it.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int rank() const { return rank_; }  // in MPI_COMM_WORLD
  int size() const { return size_; }

 private:
  bool owns_ = false;
  int rank_ = 0;
  int size_ = 1;
};

// True when this build has MPI (MESHPROOF_HAVE_MPI).
bool mpi_compiled();

// This process's communicators for every group of `mesh`. The MPI world size must equal the
// mesh's rank count (input error otherwise); rank = MPI_COMM_WORLD rank. Collective: every
// process constructs it at the same point.
//
// Watchdog: a member that waits longer than `timeout` in one collective (a peer stopped, hung
// or dead) prints "mpi <collective> (call N on this group) on <group> group of ranks [...] timed
// out ...: ranks [...] never arrived" to stderr and MPI_Aborts the whole job with exit status 3.
// Waiting polls with backoff (sleeps of up to 5 ms), so waiting ranks do not spin a core.
class MpiRankComms final : public RankComms {
 public:
  explicit MpiRankComms(DeviceMesh mesh, std::chrono::milliseconds timeout = collective_timeout());
  ~MpiRankComms() override;

  int rank() const override { return rank_; }
  const DeviceMesh& mesh() const override { return mesh_; }
  Communicator& group(DimSet dims) override;

 private:
  DeviceMesh mesh_;
  int rank_ = 0;
  std::vector<std::unique_ptr<Communicator>> comms_;  // indexed by DimSet bits
};

}  // namespace meshproof::mesh
