// Checkpoint save/load throughput (MB/s of state) on the CPU backend: a state of `MB` megabytes
// of fp32 tensors (four [rows, 4096] keys, FSDP Shard(0)) saved from and loaded into LocalWorld
// virtual ranks, to a directory on disk (MESHPROOF_BENCH_DIR, else the system temp dir). Save
// includes HDF5 writes, xxhash64 of every chunk, fsync of every file and directory and the commit
// rename; load includes the index, reads of the overlapping chunks, checksum verification and the
// copy into the live tensors. Manual time covers only the save_checkpoint / load_checkpoint calls.
//   BM_Save/<mesh>/<MB>: save on mesh (0: 1 rank, 1: dp_shard 4, 2: dp_shard 2 x tp 2)
//   BM_Load/<mesh>/<MB>: load a dp_shard 4 checkpoint onto that mesh (reshards for 0 and 2)
//   BM_SessionSave / BM_SessionLoad: the real engine state (engine/session/session.h
//   TrainingSession:
//     fp32 masters, AdamW exp_avg/exp_avg_sq, delayed-scaling scales and amax histories,
//     scalars) of a GPT with hidden 512, 8 heads, 4 layers, ffn 2048, vocab 256, after one
//     delayed-scaling step: 12.9 M parameters, 155 MB of state. Saved from dp_shard 4, loaded
//     onto dp_shard 2 x tp 2 (every tensor resharded). MB/s counts the unique global bytes.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "engine/checkpoint/checkpoint.h"
#include "engine/session/session.h"
#include "mesh/local/local_comm.h"

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

RunOptions session_options(const MeshSpec& mesh) {
  RunOptions o;
  Config& c = o.config;
  c.model.vocab = 256;
  c.model.hidden = 512;
  c.model.heads = 8;
  c.model.layers = 4;
  c.model.ffn = 2048;
  c.model.max_positions = 32;
  c.training.seq_len = 32;
  c.training.batch = 8;
  c.training.steps = 1;
  c.recipe.kind = RecipeKind::kDelayed;
  o.mesh = mesh;
  o.steps = 1;
  return o;
}

// Unique global bytes of a state (each key once, whatever its replication).
int64_t global_bytes(const ShardedState& s) {
  int64_t bytes = 0;
  for (const StateEntry& e : s.entries) {
    bytes += kernels::storage_bytes(e.local.dtype(), e.layout.global_shape().numel()).value;
  }
  return bytes;
}

// Runs `op` `iterations` times on every rank of `comms`, each after a barrier over the whole
// mesh, and appends rank 0's wall seconds per iteration to `seconds`.
template <typename Op>
void time_on_every_rank(mesh::RankComms& comms, int64_t iterations, std::vector<double>& seconds,
                        Op op) {
  auto& all =
      comms.group({mesh::MeshDim::kDpReplicate, mesh::MeshDim::kDpShard, mesh::MeshDim::kTp});
  for (int64_t i = 0; i < iterations; ++i) {
    all.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    op(i);
    const auto t1 = std::chrono::steady_clock::now();
    if (comms.rank() == 0) seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
}

// Hands the measured seconds to Google Benchmark (manual time) with the state's size.
void report_session(benchmark::State& state, const std::vector<double>& seconds, int64_t bytes,
                    const std::string& label) {
  size_t i = 0;
  for (auto _ : state) state.SetIterationTime(seconds[i++]);
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["state_MB"] = static_cast<double>(bytes) / 1e6;
  state.SetLabel(label);
}

void BM_SessionSave(benchmark::State& state) {
  const RunOptions o = session_options({1, 4, 1});
  const fs::path root = bench_root("session_save");
  fs::remove_all(root);
  CheckpointOptions opt;
  opt.keep_last = 1;
  std::vector<double> seconds;
  int64_t bytes = 0;
  const int64_t iterations = state.max_iterations;
  mesh::LocalWorld world(o.mesh.device_mesh());
  world.run([&](mesh::RankComms& comms) {
    TrainingSession s(o, comms);
    s.step();
    if (comms.rank() == 0) bytes = global_bytes(s.state());
    time_on_every_rank(comms, iterations, seconds,
                       [&](int64_t i) { save_checkpoint(root, i + 1, s.state(), comms, opt); });
  });
  fs::remove_all(root);
  report_session(state, seconds, bytes, "TrainingSession state, dp_shard=4");
}

void BM_SessionLoad(benchmark::State& state) {
  const RunOptions saver = session_options({1, 4, 1});
  const RunOptions loader = session_options({1, 2, 2});
  const fs::path root = bench_root("session_load");
  fs::remove_all(root);
  fs::path dir;
  int64_t bytes = 0;
  {
    mesh::LocalWorld world(saver.mesh.device_mesh());
    world.run([&](mesh::RankComms& comms) {
      TrainingSession s(saver, comms);
      s.step();
      fs::path d = save_checkpoint(root, 1, s.state(), comms);
      if (comms.rank() == 0) {
        dir = d;
        bytes = global_bytes(s.state());
      }
    });
  }
  std::vector<double> seconds;
  const int64_t iterations = state.max_iterations;
  mesh::LocalWorld world(loader.mesh.device_mesh());
  world.run([&](mesh::RankComms& comms) {
    TrainingSession s(loader, comms);
    time_on_every_rank(comms, iterations, seconds,
                       [&](int64_t) { load_checkpoint(dir, s.state(), comms); });
  });
  fs::remove_all(root);
  report_session(state, seconds, bytes, "TrainingSession state, dp_shard=4 -> dp_shard=2 x tp=2");
}

BENCHMARK(BM_Save)
    ->ArgsProduct({{0, 1, 2}, {8, 128}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Load)
    ->ArgsProduct({{0, 1, 2}, {8, 128}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// Fixed iteration counts: the session is built once per benchmark (Philox init of 12.9 M
// parameters and one step cost seconds), and its saves/loads are timed inside the world.
BENCHMARK(BM_SessionSave)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SessionLoad)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace meshproof::engine

BENCHMARK_MAIN();
