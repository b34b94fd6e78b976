// The environment part of a run record: plain data filled by the harness, written by reports.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace meshproof::reports {

struct GpuRecord {
  int index = 0;
  std::string name;
  std::string compute_capability;  // "9.0"
  int64_t memory_bytes = 0;
  int sm_count = 0;
};

struct EnvironmentRecord {
  std::string meshproof_version;
  std::string git_commit;
  std::string build_type;
  std::string host;
  std::vector<std::string> backends_compiled;  // "cpu", "cuda"
  std::string active_backend;                  // what "auto" resolves to: "cpu" or "cuda:0"
  bool cuda_compiled = false;
  bool cuda_usable = false;
  std::string cuda_unusable_reason;
  std::string cuda_architectures;  // compiled SASS targets, "90,100"
  std::string cuda_runtime;        // "13.0" or "none"
  std::string cuda_driver;
  std::string cublaslt;
  std::string nccl;
  std::string hdf5;
  bool mpi_compiled = false;
  std::string mpi_version;
  std::string mpi_library;
  bool mpi_launched = false;
  std::vector<GpuRecord> gpus;
  int cpus = 0;               // CPUs this process may use (its affinity mask)
  std::string virtual_ranks;  // MESHPROOF_VIRTUAL_RANKS: "auto", "threads" or "fibers"
};

nlohmann::json to_json(const EnvironmentRecord& env);

}  // namespace meshproof::reports
