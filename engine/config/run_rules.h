// The engine's input rules for one run (docs/design.md section 11): every rule about the model x
// mesh x recipe x FSDP options of engine::RunOptions, and whether this machine can hold the run, in
// one function. The training session constructor and run_training throw the first issue as a
// kInput error; the scenario loader (harness/scenario/scenario_loader.h) calls the same function
// and maps each key path to the FILE:LINE:COLUMN that wrote it, so `validate` and `run` judge
// alike.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "engine/session/session.h"

namespace meshproof::engine {

// What this process may use, for the resource rules. host_limits() probes the machine once.
struct HostLimits {
  int64_t memory_bytes = 0;  // physical memory of the host (0: unknown, not checked)
  int64_t max_threads = 0;   // threads this process may still start (0: unknown, not checked)
};
const HostLimits& host_limits();

// A lower bound of the host bytes one rank allocates (fp32 master shards, AdamW moments and
// gradient shards, the data source's transition table, one micro-batch's fp32 logits), and how
// many ranks share this process (launcher local: all of them, one thread each; mpi: one).
struct MemoryEstimate {
  int64_t per_rank_bytes = 0;
  int64_t ranks_in_process = 1;
  int64_t process_bytes() const { return per_rank_bytes * ranks_in_process; }
};
MemoryEstimate estimate_memory(const RunOptions& options);

// Every rule a run breaks: check_config(options.config) (engine/config/config.h), the mesh, recipe
// and FSDP rules of the sharded session, and (with `limits`) the memory and thread count this
// machine allows. Key paths use the engine's names ("mesh.tp", "fsdp.fp8_params",
// "training.batch"). Empty when the run is acceptable.
std::vector<ConfigIssue> check_run(const RunOptions& options,
                                   const HostLimits& limits = host_limits());

// Throws the first issue of check_run as a kInput error ("KEY: MESSAGE").
void require_valid_run(const RunOptions& options);

}  // namespace meshproof::engine
