// Versions and availability of the communication libraries this build links (NCCL, MPI).
#pragma once

#include <string>

namespace meshproof::mesh {

struct CommLibraries {
  bool nccl_compiled = false;
  std::string nccl_version;  // "2.27.7", or "" when not compiled
  bool mpi_compiled = false;
  std::string mpi_version;    // MPI standard version, e.g. "3.1"
  std::string mpi_library;    // the implementation's own version line, e.g. "Open MPI v4.1.4 ..."
  bool mpi_launched = false;  // this process was started by mpirun/srun (rank env vars present)
};

// Safe to call without MPI_Init and without a GPU.
CommLibraries comm_libraries();

// This process's rank in the job as its launcher (mpirun, srun) announces it in the environment,
// 0 when no launcher started it. Readable before MPI_Init, so the CLI can decide up front that
// only rank 0 prints and writes reports.
int launched_rank();

}  // namespace meshproof::mesh
