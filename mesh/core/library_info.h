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

// The number of processes of this job as its launcher announces it (OMPI_COMM_WORLD_SIZE of
// Open MPI's mpirun, PMI_SIZE of MPICH/Hydra and PMI-2, SLURM_NTASKS of srun), 1 when none did;
// `source` (when given) receives the variable and its value ("OMPI_COMM_WORLD_SIZE=4"). Readable
// before MPI_Init: `meshproof run` refuses to run local-launcher scenarios in every one of
// several ranks (they would all write one output folder).
int launched_world_size(std::string* source = nullptr);

}  // namespace meshproof::mesh
