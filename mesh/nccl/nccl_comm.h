// The `nccl` communicator: device buffers, one rank per GPU, one NCCL communicator per distinct
// mesh group, made with ncclCommSplit of a world communicator sharing its resources
// (ncclConfig_t.splitShare = 1). Two ways to build the world communicator:
//  - bootstrap_mpi: one process per rank under mpirun; rank 0's ncclUniqueId is broadcast over
//    MPI_COMM_WORLD; each process uses GPU (node-local rank % visible GPUs);
//  - run_nccl_single_process: one process drives world_size GPUs (ncclCommInitAll), one thread per
//    rank, like the local launcher.
// Lifetime (docs/design.md section 34): the launcher's communicators are created once per
// process and mesh (nccl_comms_for_mpi, run_nccl_single_process) and reused by every later run on
// that mesh (a scenario's checks train several times); nccl_teardown() destroys them -- all ranks
// of a communicator in parallel, one thread per rank, children before the world -- explicitly or
// at process exit. A run that fails aborts its communicators and drops them from the cache.
// Collectives are blocking (the rank's stream is waited on) so that accounting times are real.
// Waiting polls the stream and ncclCommGetAsyncError, so an NCCL failure or (single-process) an
// exception on another rank aborts the communicators instead of hanging.
// NCCL picks its own reduction order: results are not bitwise equal to local/mpi.
// The device memory taken by creating the communicators is the named reserve "nccl" of each
// device (kernels/core/device_reserve.h) while they live.
//
// Builds without CUDA compile this header; using it throws an input error. The cache and the
// group plan are host logic, compiled and tested everywhere.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/core/runtime.h"
#include "mesh/core/communicator.h"
#include "mesh/core/device_mesh.h"

namespace meshproof::mesh {

// Per group slot (DeviceMesh::group_slots: DimSet bits 0 .. 2^kNumMeshDims - 1, and the pp dim's
// sets too with pp > 1): the bits of the communicator that group uses. Dims
// of size 1 do not change a group's members, so they are cleared: e.g. with tp = 1, {dp_shard}
// and {dp_shard, tp} share one communicator. The distinct values, in increasing order, are the
// splits every rank makes (ncclCommSplit is collective over the world: the same list everywhere).
std::vector<unsigned> nccl_group_plan(const DeviceMesh& mesh);
std::vector<unsigned> nccl_distinct_splits(const std::vector<unsigned>& plan);

// What one process's cached communicators are for: the mesh, the world ranks this process drives
// and their CUDA ordinals.
struct NcclCommKey {
  std::string mesh;        // DeviceMesh::str()
  std::vector<int> ranks;  // mpi: this rank; single process: 0 .. world - 1
  // CUDA ordinal of each rank (single process); empty for mpi, where the process picks its GPU
  // from its node-local rank inside bootstrap_mpi (the same every time for a given process).
  std::vector<int> devices;
  auto operator<=>(const NcclCommKey&) const = default;
};

// A per-process cache of communicator sets by key: created on first use, reused after, handed
// back whole for teardown. Thread-safe; values never move while cached.
template <typename V>
class CommCache {
 public:
  // The value for `key`, made by `make` on first use; `created` tells which.
  V& get_or_create(const NcclCommKey& key, const std::function<std::unique_ptr<V>()>& make,
                   bool* created = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [k, v] : entries_)
      if (k == key) {
        if (created) *created = false;
        return *v;
      }
    std::unique_ptr<V> v = make();
    V& ref = *v;
    entries_.emplace_back(key, std::move(v));
    ++creations_;
    if (created) *created = true;
    return ref;
  }
  // Removes the entry for `key` (nullptr when absent).
  std::unique_ptr<V> take(const NcclCommKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->first == key) {
        std::unique_ptr<V> v = std::move(it->second);
        entries_.erase(it);
        return v;
      }
    return nullptr;
  }
  // Removes every entry, oldest first.
  std::vector<std::unique_ptr<V>> take_all() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::unique_ptr<V>> out;
    for (auto& [k, v] : entries_) out.push_back(std::move(v));
    entries_.clear();
    return out;
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.size();
  }
  int64_t creations() const {
    std::lock_guard<std::mutex> lock(mu_);
    return creations_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::pair<NcclCommKey, std::unique_ptr<V>>> entries_;
  int64_t creations_ = 0;
};

// One rank's communicator teardown order: every split finalized then destroyed, in split order,
// then the world whose resources they share (splitShare). Null handles (a split that failed) are
// skipped. `finalize` and `destroy` return "" on success or the failure; the sequence goes on after
// a failure so that nothing is leaked, and the first failure is returned ("" when none).
template <typename Comm, typename Finalize, typename Destroy>
std::string finalize_and_destroy(const std::vector<Comm>& splits, Comm world, Finalize finalize,
                                 Destroy destroy) {
  std::string first;
  auto note = [&first](std::string e) {
    if (first.empty()) first = std::move(e);
  };
  auto one = [&](Comm c, std::string_view what) {
    if (c == Comm{}) return;
    if (std::string e = finalize(c); !e.empty()) note(fmt::format("finalize {}: {}", what, e));
    if (std::string e = destroy(c); !e.empty()) note(fmt::format("destroy {}: {}", what, e));
  };
  for (size_t i = 0; i < splits.size(); ++i) one(splits[i], fmt::format("split {}", i));
  one(world, "world");
  return first;
}

// Runs destroy(0) .. destroy(members - 1) -- the ranks of ONE communicator set -- at the same
// time, one thread each, and joins them: NCCL's finalize of a rank waits for its peers, so one
// thread destroying rank after rank would hang on the first. Returns the failures (what() of each
// exception, prefixed with the member) in member order; empty when every member succeeded.
std::vector<std::string> destroy_in_parallel(size_t members,
                                             const std::function<void(size_t)>& destroy);

class NcclRankComms;

// Single process, one GPU per rank (GPUs 0..world_size-1): runs fn on one thread per rank with
// its context installed, on this process's cached communicators for `mesh` (created on first
// use); rethrows the first error after aborting the others (and dropping them from the cache).
void run_nccl_single_process(const DeviceMesh& mesh, const std::function<void(NcclRankComms&)>& fn);

// Launcher mpi: this process's cached communicators for `mesh` (bootstrap_mpi on first use; a
// collective call: every process of MPI_COMM_WORLD must make it for the same mesh). After a
// failed run, discard_nccl_comms_for_mpi aborts them and drops them from the cache.
NcclRankComms& nccl_comms_for_mpi(const DeviceMesh& mesh);
void discard_nccl_comms_for_mpi(const DeviceMesh& mesh);

// Destroys every cached communicator (the ranks of each set in parallel, one thread per rank)
// and clears their "nccl" reserves. Registered with std::atexit when the first set is created;
// safe to call again. Returns the number of sets destroyed.
int nccl_teardown();
// Sets of communicators created and cached so far in this process (for tests and reports).
int64_t nccl_comm_sets_created();
size_t nccl_comm_sets_cached();

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
  // Zeroes every group's collective statistics (a cached set starts each run from zero).
  void reset_stats();
  // Finalizes and destroys this rank's communicators (children, then the world) and its stream;
  // with several ranks in one process, each rank's call must run on its own thread at the same
  // time (NCCL's finalize waits for the other ranks). Idempotent; the destructor calls it.
  void destroy();
  // Aborts this rank's communicators (after a failure, when the other ranks may never finalize).
  void abort();

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

}  // namespace meshproof::mesh
