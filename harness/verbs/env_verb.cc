#include "harness/verbs/env_verb.h"

#include <H5Cpp.h>
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include "kernels/core/build_info.h"
#include "kernels/core/device.h"
#include "mesh/core/library_info.h"
#include "mesh/local/rank_fibers.h"

namespace meshproof::harness {

reports::EnvironmentRecord collect_environment(bool open_cublaslt) {
  const kernels::CudaStatus& cuda = kernels::cuda_status();
  const mesh::CommLibraries comm = mesh::comm_libraries();
  reports::EnvironmentRecord env;
  env.meshproof_version = std::string(kernels::version());
  env.git_commit = std::string(kernels::git_commit());
  env.build_type = std::string(kernels::build_type());
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  env.host = host;
  env.backends_compiled = {"cpu"};
  if (cuda.compiled) env.backends_compiled.push_back("cuda");
  env.active_backend = kernels::resolve_backend("auto").str();
  env.cuda_compiled = cuda.compiled;
  env.cuda_usable = cuda.usable;
  env.cuda_unusable_reason = cuda.reason;
  env.cuda_architectures = std::string(kernels::cuda_architectures());
  env.cuda_runtime = kernels::format_cuda_version(cuda.runtime_version);
  env.cuda_driver = kernels::format_cuda_version(cuda.driver_version);
  env.cublaslt = kernels::cublaslt_version_text(open_cublaslt);
  env.nccl = comm.nccl_version.empty() ? "none" : comm.nccl_version;
  unsigned h5_major = 0, h5_minor = 0, h5_release = 0;
  H5::H5Library::getLibVersion(h5_major, h5_minor, h5_release);
  env.hdf5 = fmt::format("{}.{}.{}", h5_major, h5_minor, h5_release);
  env.mpi_compiled = comm.mpi_compiled;
  env.mpi_version = comm.mpi_version;
  env.mpi_library = comm.mpi_library;
  env.mpi_launched = comm.mpi_launched;
  env.cpus = mesh::usable_cpus();
  env.virtual_ranks = mesh::rank_threading_name(mesh::rank_threading_from_env());
  for (const kernels::GpuInfo& g : cuda.gpus) {
    env.gpus.push_back(reports::GpuRecord{g.index, g.name,
                                          fmt::format("{}.{}", g.cc_major, g.cc_minor),
                                          g.total_memory.value, g.sm_count});
  }
  return env;
}

void print_environment(const reports::EnvironmentRecord& env, std::ostream& out) {
  fmt::print(out, "meshproof {} (commit {}, {})\n", env.meshproof_version, env.git_commit,
             env.build_type);
  fmt::print(out, "host              {}\n", env.host);
  fmt::print(out, "backends compiled {}\n", fmt::join(env.backends_compiled, ", "));
  fmt::print(out, "active backend    {}\n", env.active_backend);
  if (!env.cuda_compiled) {
    fmt::print(out, "CUDA              not compiled: {}\n", env.cuda_unusable_reason);
  } else {
    fmt::print(out, "CUDA              {} (runtime {}, driver {}, compiled for sm {})\n",
               env.cuda_usable ? "usable" : "compiled but not usable", env.cuda_runtime,
               env.cuda_driver, env.cuda_architectures);
    if (!env.cuda_usable) {
      fmt::print(out, "                  -> running on the CPU backend because {}\n",
                 env.cuda_unusable_reason);
    }
    fmt::print(out, "cuBLASLt          {}\n", env.cublaslt);
    fmt::print(out, "NCCL              {}\n", env.nccl);
  }
  fmt::print(out, "HDF5              {}\n", env.hdf5);
  // How the local launcher's host ranks run here (mesh/local/rank_fibers.h).
  const std::string ranks = env.virtual_ranks == "threads" ? "a thread per rank"
                            : env.virtual_ranks == "fibers"
                                ? fmt::format("fibers on up to {} worker threads", env.cpus)
                                : fmt::format(
                                      "a thread per rank up to {} ranks, beyond that "
                                      "fibers on {} worker threads",
                                      env.cpus, env.cpus);
  fmt::print(out, "CPUs              {} usable; virtual ranks {} ({}, {})\n", env.cpus,
             env.virtual_ranks, ranks, "MESHPROOF_VIRTUAL_RANKS");
  if (env.mpi_compiled) {
    fmt::print(out, "MPI               {} (MPI {}){}\n", env.mpi_library, env.mpi_version,
               env.mpi_launched ? ", launched under mpirun" : "");
  } else {
    fmt::print(out, "MPI               not compiled (the mpi launcher is unavailable)\n");
  }
  if (env.gpus.empty()) {
    fmt::print(out, "GPUs              none\n");
  }
  for (const reports::GpuRecord& g : env.gpus) {
    fmt::print(out, "GPU {}             {}, compute capability {}, {:.1f} GiB, {} SMs\n", g.index,
               g.name, g.compute_capability, static_cast<double>(g.memory_bytes) / (1 << 30),
               g.sm_count);
  }
}

}  // namespace meshproof::harness
