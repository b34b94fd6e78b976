#include "harness/verbs/bench_comm_verb.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <CLI/CLI.hpp>
#include <charconv>

#include "harness/verbs/exit_codes.h"
#include "kernels/core/device.h"
#include "kernels/core/error.h"
#include "mesh/bench/comm_bench.h"
#include "mesh/local/local_comm.h"
#include "mesh/mpi/mpi_comm.h"
#include "mesh/nccl/nccl_comm.h"

namespace meshproof::harness {

std::vector<kernels::Elements> parse_comm_sizes(std::string_view spec) {
  std::vector<kernels::Elements> out;
  MP_CHECK_INPUT(!spec.empty(), "--sizes is empty (expected e.g. 4K,64K,1M)");
  size_t pos = 0;
  while (true) {
    const size_t comma = spec.find(',', pos);
    std::string_view item =
        spec.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    int64_t mult = 1;
    if (!item.empty()) {
      switch (item.back()) {
        case 'K':
        case 'k':
          mult = 1024;
          break;
        case 'M':
        case 'm':
          mult = 1024 * 1024;
          break;
        case 'G':
        case 'g':
          mult = 1024 * 1024 * 1024;
          break;
        default:
          break;
      }
      if (mult != 1) item.remove_suffix(1);
    }
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    MP_CHECK_INPUT(ec == std::errc() && end == item.data() + item.size() && v > 0,
                   "--sizes '{}': '{}' is not a positive size in bytes (e.g. 4K)", spec, item);
    const int64_t bytes = v * mult;
    MP_CHECK_INPUT(bytes % 4 == 0, "--sizes '{}': {} bytes is not a whole number of fp32 elements",
                   spec, bytes);
    out.emplace_back(bytes / 4);
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

int bench_comm(const BenchCommOptions& options, std::ostream& out) {
  mesh::CommBenchOptions bench;
  bench.counts = parse_comm_sizes(options.sizes);
  bench.iters = options.iters;
  bench.warmup_iters = options.warmup;
  bench.device = kernels::resolve_backend(options.backend);
  std::vector<mesh::CommBenchRow> rows;
  bool print = true;
  std::string what;
  if (options.launcher == "local") {
    const mesh::DeviceMesh m = mesh::DeviceMesh::parse(options.mesh);
    mesh::LocalWorldOptions lw;
    lw.device = bench.device;
    MP_CHECK_INPUT(options.timeout_s > 0, "--timeout must be positive (got {})", options.timeout_s);
    lw.timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000.0));
    mesh::LocalWorld world(m, lw);
    world.run([&](mesh::RankComms& comms) {
      auto r = mesh::run_comm_bench(comms, bench);
      if (comms.rank() == 0) rows = std::move(r);
    });
    what = fmt::format("launcher local ({} virtual ranks on {}), mesh {}", m.world_size(),
                       bench.device.str(), m.str());
  } else if (options.launcher == "mpi") {
    mesh::MpiSession session(nullptr, nullptr);
    const mesh::DeviceMesh m = mesh::DeviceMesh::parse(options.mesh, session.size());
    if (bench.device.is_cpu()) {
      mesh::MpiRankComms comms(m);
      rows = mesh::run_comm_bench(comms, bench);
    } else {
      mesh::NcclRankComms comms = mesh::NcclRankComms::bootstrap_mpi(m);
      kernels::ScopedRankContext ctx(comms.context());
      rows = mesh::run_comm_bench(comms, bench);
    }
    print = session.rank() == 0;
    what = fmt::format("launcher mpi ({} processes, {} buffers via {}), mesh {}", session.size(),
                       bench.device.is_cpu() ? "host" : "device",
                       bench.device.is_cpu() ? "MPI" : "NCCL", m.str());
  } else {
    MP_FAIL_INPUT("--launcher '{}': expected local or mpi", options.launcher);
  }
  int64_t wrong = 0;
  for (const auto& r : rows) wrong += r.wrong;
  if (print) {
    fmt::print(out, "# meshproof bench comm: {}\n", what);
    fmt::print(out, "# {} warmup + {} timed iterations per row; time = slowest rank's mean\n",
               options.warmup, options.iters);
    out << mesh::format_comm_bench(rows);
    fmt::print(out, "# Out of bounds values : {} {}\n", wrong, wrong == 0 ? "OK" : "FAILED");
  }
  return wrong == 0 ? kExitOk : kExitCheckFailed;
}

void add_bench_comm_command(CLI::App& app, std::ostream& out, int& exit_code) {
  // `bench` may already exist (other benchmarks register their own sub-verbs under it).
  CLI::App* bench = nullptr;
  for (CLI::App* sub : app.get_subcommands([](CLI::App* a) { return a->get_name() == "bench"; })) {
    bench = sub;
  }
  if (bench == nullptr) {
    bench = app.add_subcommand("bench", "Benchmarks (comm: collectives over a mesh)");
    bench->require_subcommand(1);
  }
  auto* cmd = bench->add_subcommand(
      "comm",
      "nccl-tests style table of all_gather/reduce_scatter/all_reduce/broadcast on every "
      "group of a mesh, with a check of every result");
  auto opts = std::make_shared<BenchCommOptions>();
  cmd->add_option("--launcher", opts->launcher, "local (virtual ranks) or mpi (under mpirun)")
      ->check(CLI::IsMember({"local", "mpi"}))
      ->capture_default_str();
  cmd->add_option("--backend", opts->backend, "cpu, cuda or auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd->add_option("--mesh", opts->mesh, "mesh dims, e.g. dp_shard=4,tp=2")->capture_default_str();
  cmd->add_option("--sizes", opts->sizes, "bytes of fp32 data per collective, e.g. 4K,64K,1M")
      ->capture_default_str();
  cmd->add_option("--iters", opts->iters, "timed iterations per row")->capture_default_str();
  cmd->add_option("--warmup", opts->warmup, "warmup iterations per row")->capture_default_str();
  cmd->add_option("--timeout", opts->timeout_s,
                  "local launcher: seconds a rank waits for the others in one collective")
      ->capture_default_str();
  cmd->callback([&out, &exit_code, opts] { exit_code = bench_comm(*opts, out); });
}

}  // namespace meshproof::harness
