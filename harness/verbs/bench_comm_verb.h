// `meshproof bench comm`: nccl-tests style bandwidth table of every collective on every group of
// a mesh, on the local launcher (virtual ranks; CPU or one GPU) or under mpirun (CPU buffers via
// MPI, GPU buffers via NCCL). Each result is checked against exact expected values (#wrong).
#pragma once

#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/core/units.h"

namespace CLI {
class App;
}

namespace meshproof::harness {

struct BenchCommOptions {
  std::string launcher = "local";  // local | mpi
  std::string backend = "cpu";     // cpu | cuda | auto
  std::string mesh = "dp_shard=4,tp=2";
  std::string sizes = "4K,64K,1M";  // bytes of fp32 data per collective (nccl-tests "size")
  int iters = 10;
  int warmup = 3;
  double timeout_s = 300;  // local launcher: how long a rank waits for the others per collective
};

// "8,4K,1M" -> fp32 element counts (bytes / 4; K/M/G are powers of 1024). Input error when a size
// is not a positive multiple of 4 bytes or does not parse.
std::vector<kernels::Elements> parse_comm_sizes(std::string_view spec);

// Runs the benchmark and prints the table (rank 0 only under mpi). Returns the exit code:
// 0 when every result was right, 1 (check failed) when any #wrong > 0.
int bench_comm(const BenchCommOptions& options, std::ostream& out);

// Registers `bench comm` (creating the `bench` verb if no other bench registered it first).
void add_bench_comm_command(CLI::App& app, std::ostream& out, int& exit_code);

}  // namespace meshproof::harness
