// The per-rank body of `meshproof bench comm`: every collective on every distinct multi-rank
// group of the mesh at each size, timed nccl-tests style, with a real check of every result
// (#wrong: elements that differ from their exact expected value). Runs on any RankComms (local
// virtual ranks, MPI processes); every rank calls it, rank 0's rows carry the world's numbers.
#pragma once

#include <string>
#include <vector>

#include "kernels/core/runtime.h"
#include "kernels/core/units.h"
#include "mesh/core/communicator.h"

namespace meshproof::mesh {

struct CommBenchOptions {
  // Total fp32 elements per collective (nccl-tests "count"): the gathered output of all_gather,
  // the full input of reduce_scatter, the buffer of all_reduce and broadcast.
  std::vector<kernels::Elements> counts = {kernels::Elements(1024), kernels::Elements(16384),
                                           kernels::Elements(262144)};
  int warmup_iters = 3;
  int iters = 10;
  kernels::Device device = kernels::Device::cpu();  // where the buffers live
};

struct CommBenchRow {
  std::string group;  // "dp_shard", "dp_shard+tp", ...
  int group_size = 0;
  CollectiveKind kind = CollectiveKind::kAllReduce;
  ReduceOp op = ReduceOp::kSum;  // meaningful for reductions only
  kernels::Elements count;       // total elements, nccl-tests convention
  kernels::Bytes size;           // count * 4
  double time_us = 0;            // mean per call, max over the world's ranks
  double algbw_gbs = 0;          // size / time
  double busbw_gbs = 0;          // algbw * bus_bandwidth_factor
  int64_t wrong = 0;             // summed over the world's ranks
};

// Collective over the whole world: every rank must call it with the same options.
std::vector<CommBenchRow> run_comm_bench(RankComms& comms, const CommBenchOptions& options);

// The nccl-tests style table.
std::string format_comm_bench(const std::vector<CommBenchRow>& rows);

}  // namespace meshproof::mesh
