// A stalled-rank probe for the mpi launcher's collective watchdog
// (tests/mesh/mpi/check_mpi_watchdog.sh): under `mpirun -np N`, every process prints "ready rank R
// pid P" once its first all_reduce on the dp_shard group of all N ranks has completed, then loops
// all_reduce on it forever. The test SIGSTOPs one rank; the others must end the job through the
// watchdog (MPI_Abort, exit 3) with a message naming the collective, the group and the stopped
// rank. The probe never ends by itself. Usage: mpi_stall_probe (the timeout comes from
// MESHPROOF_COLLECTIVE_TIMEOUT)
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "mesh/mpi/mpi_comm.h"

int main(int argc, char** argv) {
  using namespace meshproof;
  try {
    mesh::MpiSession session(&argc, &argv);
    mesh::MpiRankComms comms(mesh::DeviceMesh(1, session.size(), 1));
    mesh::Communicator& group = comms.group({mesh::MeshDim::kDpShard});
    kernels::Tensor t =
        kernels::Tensor::from_vector(kernels::Shape{64}, std::vector<float>(64, 1.0f));
    group.all_reduce(t, mesh::ReduceOp::kSum);
    std::printf("ready rank %d pid %d\n", session.rank(), static_cast<int>(getpid()));
    std::fflush(stdout);
    for (;;) group.all_reduce(t, mesh::ReduceOp::kMax);
  } catch (const kernels::Error& e) {
    std::fprintf(stderr, "mpi_stall_probe: %s\n", e.what());
    return 2;
  }
}
