#include "reports/record/environment.h"

namespace meshproof::reports {

nlohmann::json to_json(const EnvironmentRecord& env) {
  nlohmann::json gpus = nlohmann::json::array();
  for (const GpuRecord& g : env.gpus) {
    gpus.push_back({{"index", g.index},
                    {"name", g.name},
                    {"compute_capability", g.compute_capability},
                    {"memory_bytes", g.memory_bytes},
                    {"sm_count", g.sm_count}});
  }
  return {
      {"meshproof",
       {{"version", env.meshproof_version},
        {"git_commit", env.git_commit},
        {"build_type", env.build_type}}},
      {"host", env.host},
      {"backends_compiled", env.backends_compiled},
      {"active_backend", env.active_backend},
      {"cuda",
       {{"compiled", env.cuda_compiled},
        {"usable", env.cuda_usable},
        {"unusable_reason", env.cuda_unusable_reason},
        {"architectures", env.cuda_architectures},
        {"runtime", env.cuda_runtime},
        {"driver", env.cuda_driver},
        {"cublaslt", env.cublaslt},
        {"nccl", env.nccl}}},
      {"hdf5", env.hdf5},
      {"mpi",
       {{"compiled", env.mpi_compiled},
        {"version", env.mpi_version},
        {"library", env.mpi_library},
        {"launched", env.mpi_launched}}},
      {"gpus", gpus},
      {"cpus", env.cpus},
      {"virtual_ranks", env.virtual_ranks},
  };
}

}  // namespace meshproof::reports
