#include "mesh/core/library_info.h"

#include <fmt/format.h>

#include <cstdlib>

#if MESHPROOF_HAVE_CUDA
#include <nccl.h>
#endif
#if MESHPROOF_HAVE_MPI
#include <mpi.h>
#endif

namespace meshproof::mesh {

CommLibraries comm_libraries() {
  CommLibraries c;
#if MESHPROOF_HAVE_CUDA
  c.nccl_compiled = true;
  int v = 0;
  if (ncclGetVersion(&v) == ncclSuccess) {
    // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
    c.nccl_version = fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
  }
#endif
#if MESHPROOF_HAVE_MPI
  c.mpi_compiled = true;
  int major = 0, minor = 0;
  MPI_Get_version(&major, &minor);  // callable before MPI_Init
  c.mpi_version = fmt::format("{}.{}", major, minor);
  char lib[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(lib, &len);
  c.mpi_library = std::string(lib, static_cast<size_t>(len));
  while (!c.mpi_library.empty() && (c.mpi_library.back() == '\n' || c.mpi_library.back() == '\0')) {
    c.mpi_library.pop_back();
  }
  if (auto nl = c.mpi_library.find('\n'); nl != std::string::npos) c.mpi_library.resize(nl);
#endif
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS"}) {
    if (std::getenv(var) != nullptr) c.mpi_launched = true;
  }
  return c;
}

int launched_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    if (const char* v = std::getenv(var)) return std::atoi(v);
  }
  return 0;
}

int launched_world_size(std::string* source) {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"}) {
    const char* v = std::getenv(var);
    if (v == nullptr || *v == '\0') continue;
    const int n = std::atoi(v);
    if (n < 1) continue;
    if (source) *source = fmt::format("{}={}", var, v);
    return n;
  }
  return 1;
}

}  // namespace meshproof::mesh
