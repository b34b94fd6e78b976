// Checkpoint save/load throughput (MB/s of state) on the CPU backend: a state of `MB` megabytes
// of fp32 tensors (four [rows, 4096] keys, FSDP Shard(0)) saved from and loaded into LocalWorld
// virtual ranks, to a directory on disk (MESHPROOF_BENCH_DIR, else the system temp dir). Save
// includes HDF5 writes, xxhash64 of every chunk, fsync of every file and directory and the commit
// rename; load includes the index, reads of the overlapping chunks, checksum verification and the
// copy into the live tensors. Manual time covers only the save_checkpoint / load_checkpoint calls.
//   BM_Save/<mesh>/<MB>: save on mesh (0: 1 rank, 1: dp_shard 4, 2: dp_shard 2 x tp 2)
//   BM_Load/<mesh>/<MB>: load a dp_shard 4 checkpoint onto that mesh (reshards for 0 and 2)
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "engine/checkpoint.h"
#include "mesh/local_comm.h"

namespace meshproof::engine {
namespace {

namespace fs = std::filesystem;
using mesh::DeviceMesh;
using mesh::Placement;

DeviceMesh bench_mesh(int64_t id) {
  switch (id) {
    case 0:
      return DeviceMesh(1, 1, 1);
    case 1:
      return DeviceMesh(1, 4, 1);
    default:
      return DeviceMesh(1, 2, 2);
  }
}

constexpr int kKeys = 4;
constexpr int64_t kCols = 4096;

int64_t rows_for(int64_t megabytes) {
  return megabytes * 1024 * 1024 / (kKeys * kCols * static_cast<int64_t>(sizeof(float)));
}

// This rank's share of the benchmark state (cheap deterministic fill, no RNG cost).
ShardedState bench_state(const DeviceMesh& m, int rank, int64_t megabytes) {
  ShardedState s;
  const int64_t rows = rows_for(megabytes);
  for (int k = 0; k < kKeys; ++k) {
    std::vector<Placement> p(3, Placement::replicate());
    p[1] = Placement::shard(0);
    if (m.size(mesh::MeshDim::kTp) > 1) p[2] = Placement::shard(1);
    mesh::Layout layout(m, kernels::Shape{rows, kCols}, p);
    kernels::Tensor t = kernels::Tensor::empty(layout.local_shape(rank), kernels::DType::kFloat32,
                                               kernels::Device::cpu());
    float* d = t.data<float>();
    for (int64_t i = 0; i < t.numel().value; ++i) d[i] = static_cast<float>((i + k) % 9973) * 0.5f;
    s.entries.push_back(StateEntry{fmt::format("model/w{}", k), layout, t});
  }
  s.scalars["optim/step"] = 1;
  return s;
}

fs::path bench_root(const std::string& tag) {
  const char* env = std::getenv("MESHPROOF_BENCH_DIR");
  const fs::path base = env ? fs::path(env) : fs::temp_directory_path();
  return base / fmt::format("meshproof_ckpt_bench_{}_{}", tag, ::getpid());
}

// Runs fn on every rank after a barrier and returns rank 0's wall time of fn in seconds.
template <typename Fn>
double timed(mesh::LocalWorld& world, const DeviceMesh& m, int64_t megabytes, Fn fn) {
  double seconds = 0;
  world.run([&](mesh::RankComms& comms) {
    ShardedState s = bench_state(m, comms.rank(), megabytes);
    comms.group({mesh::MeshDim::kDpReplicate, mesh::MeshDim::kDpShard, mesh::MeshDim::kTp})
        .barrier();
    const auto t0 = std::chrono::steady_clock::now();
    fn(s, comms);
    const auto t1 = std::chrono::steady_clock::now();
    if (comms.rank() == 0) seconds = std::chrono::duration<double>(t1 - t0).count();
  });
  return seconds;
}

void BM_Save(benchmark::State& state) {
  const DeviceMesh m = bench_mesh(state.range(0));
  const int64_t mb = state.range(1);
  const fs::path root = bench_root("save");
  fs::remove_all(root);
  CheckpointOptions opt;
  opt.keep_last = 1;
  int64_t step = 0;
  mesh::LocalWorld world(m);
  for (auto _ : state) {
    ++step;
    state.SetIterationTime(timed(world, m, mb, [&](ShardedState& s, mesh::RankComms& comms) {
      save_checkpoint(root, step, s, comms, opt);
    }));
  }
  fs::remove_all(root);
  const int64_t bytes = rows_for(mb) * kCols * kKeys * static_cast<int64_t>(sizeof(float));
  state.SetBytesProcessed(state.iterations() * bytes);
  state.SetLabel(m.str());
}

void BM_Load(benchmark::State& state) {
  const DeviceMesh m = bench_mesh(state.range(0));
  const int64_t mb = state.range(1);
  const fs::path root = bench_root("load");
  fs::remove_all(root);
  const DeviceMesh saver = bench_mesh(1);
  fs::path dir;
  {
    mesh::LocalWorld w(saver);
    w.run([&](mesh::RankComms& comms) {
      ShardedState s = bench_state(saver, comms.rank(), mb);
      fs::path d = save_checkpoint(root, 1, s, comms);
      if (comms.rank() == 0) dir = d;
    });
  }
  mesh::LocalWorld world(m);
  for (auto _ : state) {
    state.SetIterationTime(timed(world, m, mb, [&](ShardedState& s, mesh::RankComms& comms) {
      load_checkpoint(dir, s, comms);
    }));
  }
  fs::remove_all(root);
  const int64_t bytes = rows_for(mb) * kCols * kKeys * static_cast<int64_t>(sizeof(float));
  state.SetBytesProcessed(state.iterations() * bytes);
  state.SetLabel("dp_shard=4 -> " + m.str());
}

BENCHMARK(BM_Save)
    ->ArgsProduct({{0, 1, 2}, {8, 128}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Load)
    ->ArgsProduct({{0, 1, 2}, {8, 128}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace meshproof::engine

BENCHMARK_MAIN();
