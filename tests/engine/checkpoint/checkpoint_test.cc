// Sharded HDF5 checkpoints: the reshard matrix (save on each of six meshes, load on each, global
// tensors bitwise equal, each rank reads exactly the chunks that overlap its box), atomic commit
// and crash safety, corruption/truncation/mismatch errors that leave the live state untouched,
// the checkpoint-side faults, and h5py readability.
#include "engine/checkpoint/checkpoint.h"

#include <H5Cpp.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ckpt_test_files.h"
#include "ckpt_test_state.h"
#include "harness/verbs/cli.h"
#include "harness/verbs/exit_codes.h"
#include "kernels/core/error.h"
#include "kernels/core/formats.h"
#include "mesh/local/local_comm.h"
#include "tests/source_dir.h"

namespace meshproof::engine {
namespace {

namespace fs = std::filesystem;
using kernels::Tensor;
using mesh::DeviceMesh;
using testing::detach;
using testing::flip_byte;
using testing::make_state;
using testing::synthetic_global;
using testing::synthetic_keys;
using testing::synthetic_layout;
using testing::synthetic_scalars;

const std::vector<DeviceMesh>& matrix_meshes() {
  static const std::vector<DeviceMesh> meshes = {DeviceMesh(1, 1, 1), DeviceMesh(1, 4, 1),
                                                 DeviceMesh(2, 2, 1), DeviceMesh(1, 1, 2),
                                                 DeviceMesh(1, 2, 2), DeviceMesh(2, 2, 2)};
  return meshes;
}

class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    path_ = fs::temp_directory_path() /
            fmt::format("meshproof_ckpt_{}_{}_{}", tag, ::getpid(), counter()++);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  fs::path path_;
};

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw_data(), b.raw_data(), static_cast<size_t>(a.nbytes().value)) == 0;
}

// Saves the seed's state on mesh `m` as step `step`.
fs::path save_on(const DeviceMesh& m, const fs::path& root, int64_t step, uint64_t seed,
                 const CheckpointOptions& options = {}) {
  fs::path dir;
  std::mutex mu;
  mesh::LocalWorld world(m);
  world.run([&](mesh::RankComms& comms) {
    ShardedState s = make_state(m, comms.rank(), seed);
    fs::path d = save_checkpoint(root, step, s, comms, options);
    std::lock_guard<std::mutex> lock(mu);
    dir = d;
  });
  return dir;
}

struct LoadOutcome {
  std::vector<ShardedState> states;  // per rank, after the load (or the failed attempt)
  std::vector<LoadStats> stats;
};

// Loads `dir` on mesh `m` into states initialised from `live_seed`. Errors propagate.
LoadOutcome load_on(const DeviceMesh& m, const fs::path& dir, uint64_t live_seed,
                    const CheckpointOptions& options = {}) {
  LoadOutcome out;
  out.states.resize(static_cast<size_t>(m.world_size()));
  out.stats.resize(static_cast<size_t>(m.world_size()));
  mesh::LocalWorld world(m);
  world.run([&](mesh::RankComms& comms) {
    const auto r = static_cast<size_t>(comms.rank());
    out.states[r] = make_state(m, comms.rank(), live_seed);
    out.stats[r] = load_checkpoint(dir, out.states[r], comms, options);
  });
  detach(out.states);
  return out;
}

// The global tensor of entry `e` reassembled from every rank's state.
Tensor reassemble(const std::vector<ShardedState>& states, size_t e) {
  std::vector<Tensor> locals;
  for (const ShardedState& s : states) locals.push_back(s.entries[e].local);
  return mesh::unshard(locals, states[0].entries[e].layout);
}

void expect_state_is_seed(const std::vector<ShardedState>& states, uint64_t seed,
                          const std::string& context) {
  const auto& keys = synthetic_keys();
  for (size_t e = 0; e < keys.size(); ++e) {
    EXPECT_TRUE(same_bytes(reassemble(states, e), synthetic_global(keys[e], seed)))
        << context << ": key " << keys[e].key;
  }
  for (const ShardedState& s : states) EXPECT_EQ(s.scalars, synthetic_scalars(seed)) << context;
}

// Loads `dir` on mesh `m` into seed-`live_seed` states, expects an error of `kind` whose message
// contains every string of `needles`, and checks that no rank's state changed.
void expect_load_fails(const DeviceMesh& m, const fs::path& dir, kernels::ErrorKind kind,
                       const std::vector<std::string>& needles,
                       const CheckpointOptions& options = {}) {
  std::vector<ShardedState> states(static_cast<size_t>(m.world_size()));
  mesh::LocalWorld world(m);
  try {
    world.run([&](mesh::RankComms& comms) {
      const auto r = static_cast<size_t>(comms.rank());
      states[r] = make_state(m, comms.rank(), 2);
      load_checkpoint(dir, states[r], comms, options);
    });
    detach(states);
    ADD_FAILURE() << "load of " << dir << " did not fail";
  } catch (const kernels::Error& e) {
    detach(states);
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& n : needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << n << " not in: " << e.what();
    }
  }
  for (size_t r = 0; r < states.size(); ++r) {
    ASSERT_EQ(states[r].entries.size(), synthetic_keys().size()) << "rank " << r;
  }
  expect_state_is_seed(states, 2, "after a failed load");
}

TEST(CheckpointTest, ReshardMatrixBitwiseWithOverlappingReadsOnly) {
  for (const DeviceMesh& src : matrix_meshes()) {
    TempDir tmp("matrix");
    const fs::path dir = save_on(src, tmp.path(), 5, 1);
    ASSERT_EQ(dir.filename(), "step_0000005");
    const CheckpointIndex index = read_checkpoint_index(dir);
    EXPECT_EQ(index.mesh, src);
    EXPECT_EQ(index.step, 5);
    EXPECT_EQ(index.scalars, synthetic_scalars(1));
    for (const auto& k : synthetic_keys()) {
      // Each distinct box stored once: replicated keys have one chunk, sharded keys one chunk per
      // distinct non-empty box, whatever the replication.
      EXPECT_EQ(index.keys.at(k.key).chunks.size(), synthetic_layout(k, src).chunks().size())
          << k.key << " on " << src.str();
    }
    for (const DeviceMesh& dst : matrix_meshes()) {
      const std::string ctx = src.str() + " -> " + dst.str();
      LoadOutcome out = load_on(dst, dir, 2);
      expect_state_is_seed(out.states, 1, ctx);
      for (int r = 0; r < dst.world_size(); ++r) {
        // The reads this rank must make: the saved chunks overlapping its target box, computed
        // from the layouts alone (independently of the index).
        int64_t expected = 0;
        for (const auto& k : synthetic_keys()) {
          const mesh::Box target = synthetic_layout(k, dst).box(r);
          const mesh::Layout saved = synthetic_layout(k, src);
          for (const mesh::Chunk& c : saved.chunks()) {
            if (!c.box.intersect(target).empty()) ++expected;
          }
        }
        EXPECT_EQ(out.stats[static_cast<size_t>(r)].chunks_read, expected) << ctx << " rank " << r;
      }
    }
  }
}

TEST(CheckpointTest, ShardedTargetReadsFewerChunksThanSaved) {
  // dp_shard 4 -> dp_shard 4: every rank reads only its own chunk of each FSDP key (and the
  // single chunk of each replicated key), and opens only its own rank file plus rank 0's.
  TempDir tmp("fewer");
  const DeviceMesh m(1, 4, 1);
  const fs::path dir = save_on(m, tmp.path(), 1, 1);
  LoadOutcome out = load_on(m, dir, 2);
  const int64_t keys = static_cast<int64_t>(synthetic_keys().size());
  for (int r = 0; r < 4; ++r) {
    EXPECT_LE(out.stats[static_cast<size_t>(r)].chunks_read, keys) << "rank " << r;
    for (const std::string& f : out.stats[static_cast<size_t>(r)].files_opened) {
      EXPECT_TRUE(f == "rank_00000.h5" || f == fmt::format("rank_{:05d}.h5", r)) << f;
    }
  }
  expect_state_is_seed(out.states, 1, "dp_shard 4");
}

TEST(CheckpointTest, KeepsLastNAndNeverOverwrites) {
  TempDir tmp("keep");
  const DeviceMesh m(1, 2, 1);
  CheckpointOptions opt;
  opt.keep_last = 2;
  for (int64_t step : {1, 2, 3, 4}) save_on(m, tmp.path(), step, static_cast<uint64_t>(step), opt);
  const auto all = list_checkpoints(tmp.path());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].filename(), "step_0000003");
  EXPECT_EQ(all[1].filename(), "step_0000004");
  EXPECT_EQ(latest_checkpoint(tmp.path())->filename(), "step_0000004");
  try {
    save_on(m, tmp.path(), 4, 9, opt);
    ADD_FAILURE() << "overwrote a complete checkpoint";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("never overwritten"), std::string::npos) << e.what();
  }
  expect_state_is_seed(load_on(m, all[1], 2).states, 4, "step 4 after refused overwrite");
}

// A save that fails (here a hook that throws on one rank) removes its partial directory on every
// path and leaves the previous checkpoint loadable; crashes (which cannot clean up) are below.
TEST(CheckpointTest, FailedSaveRemovesItsPartialDirectoryAndKeepsThePrevious) {
  const DeviceMesh m(2, 2, 1);
  for (SavePoint point :
       {SavePoint::kRankFileWritten, SavePoint::kBeforeIndex, SavePoint::kBeforeRename}) {
    const std::string ctx(save_point_name(point));
    TempDir tmp("crash");
    save_on(m, tmp.path(), 1, 1);
    CheckpointOptions crash;
    crash.fault_hook = [point](SavePoint p, int rank, int64_t) {
      // A crash of rank 2 after its file, or of rank 0 at the commit points.
      if (p == point && (p != SavePoint::kRankFileWritten || rank == 2)) {
        throw std::runtime_error("injected crash");
      }
    };
    EXPECT_THROW(save_on(m, tmp.path(), 2, 2, crash), std::exception) << ctx;
    EXPECT_FALSE(fs::exists(tmp.path() / "step_0000002.partial")) << ctx;
    EXPECT_FALSE(fs::exists(tmp.path() / "step_0000002")) << ctx;
    ASSERT_EQ(latest_checkpoint(tmp.path())->filename(), "step_0000001") << ctx;
    expect_state_is_seed(load_on(DeviceMesh(1, 1, 2), *latest_checkpoint(tmp.path()), 2).states, 1,
                         ctx);
    // The next save commits.
    save_on(m, tmp.path(), 3, 3);
    EXPECT_EQ(latest_checkpoint(tmp.path())->filename(), "step_0000003") << ctx;
  }
}

// Fills the filesystem of `dir` up to leaving about `free_bytes` free (statvfs granularity).
void fill_leaving(const fs::path& dir, int64_t free_bytes) {
  struct statvfs v {};
  ASSERT_EQ(::statvfs(dir.c_str(), &v), 0) << std::strerror(errno);
  const int64_t avail = static_cast<int64_t>(v.f_bavail) * static_cast<int64_t>(v.f_frsize);
  const int64_t fill = avail - free_bytes;
  if (fill <= 0) return;
  const int fd = ::open((dir / "filler").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const std::vector<char> block(4096, 'x');
  int64_t done = 0;
  while (done < fill) {
    const ssize_t n =
        ::write(fd, block.data(), static_cast<size_t>(std::min<int64_t>(4096, fill - done)));
    if (n <= 0) break;
    done += n;
  }
  ::close(fd);
}

// Disk full (a real ENOSPC on a small tmpfs; needs root to mount): a step-1 checkpoint is saved,
// the filesystem is then filled so that only `k` pages stay free, for k = 0, 1, 2, ... until a
// step-2 save succeeds. Every failed save must name the file and the system's reason ("No space
// left on device"), remove its .partial directory and leave step 1 loadable; some level must fail
// while writing a rank file and some while writing a JSON file (sidecar or index.json).
TEST(CheckpointTest, DiskFullSaveFailsWithTheReasonAndRemovesItsPartialDirectory) {
  TempDir tmp("enospc");
  const fs::path mnt = tmp.path() / "mnt";
  fs::create_directories(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=1m") != 0) {
    GTEST_SKIP() << "cannot mount a 1 MiB tmpfs to fill up (" << std::strerror(errno)
                 << "): needs root (CAP_SYS_ADMIN); RlimitFsizeSaveFailsWithTheReason covers "
                    "the failure path without it";
  }
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{mnt};
  const DeviceMesh m(1, 2, 1);
  const fs::path root = mnt / "ckpt";
  save_on(m, root, 1, 1);
  bool saved = false;
  bool rank_file_failed = false;
  bool json_failed = false;
  for (int64_t pages = 0; pages <= 64 && !saved; ++pages) {
    fs::remove(mnt / "filler");
    fill_leaving(mnt, pages * 4096);
    try {
      save_on(m, root, 2, 2);
      saved = true;
    } catch (const kernels::Error& e) {
      const std::string what = e.what();
      const std::string ctx = fmt::format("{} free pages: {}", pages, what);
      EXPECT_NE(what.find("No space left on device"), std::string::npos) << ctx;
      EXPECT_FALSE(fs::exists(root / "step_0000002.partial")) << ctx;
      EXPECT_FALSE(fs::exists(root / "step_0000002")) << ctx;
      if (what.find(".h5") != std::string::npos) rank_file_failed = true;
      if (what.find(".json") != std::string::npos) json_failed = true;
    }
    fs::remove(mnt / "filler");
    expect_state_is_seed(load_on(DeviceMesh(1, 1, 1), root / "step_0000001", 3).states, 1,
                         fmt::format("step 1 after {} free pages", pages));
  }
  EXPECT_TRUE(saved) << "no fill level let the save through";
  EXPECT_TRUE(rank_file_failed) << "no level failed inside a rank file";
  EXPECT_TRUE(json_failed) << "no level failed writing a sidecar or index.json";
  if (saved) {
    expect_state_is_seed(load_on(DeviceMesh(1, 2, 1), root / "step_0000002", 3).states, 2,
                         "step 2");
  }
}

// The same failure path without root: a child process saves under RLIMIT_FSIZE (writes past the
// limit fail with EFBIG once SIGXFSZ is ignored), limited below the size of every rank file of
// this save (measured on an unlimited save of the same state). The child reports the error text
// through a file written after the limit is lifted.
TEST(CheckpointTest, RlimitFsizeSaveFailsWithTheReason) {
  TempDir tmp("efbig");
  const DeviceMesh m(1, 2, 1);
  const fs::path probe = save_on(m, tmp.path() / "probe", 2, 2);
  int64_t smallest_rank_file = INT64_MAX;
  for (const char* f : {"rank_00000.h5", "rank_00001.h5"}) {
    smallest_rank_file =
        std::min(smallest_rank_file, static_cast<int64_t>(fs::file_size(probe / f)));
  }
  const int64_t limit = smallest_rank_file / 2;
  const fs::path root = tmp.path() / "ckpt";
  save_on(m, root, 1, 1);
  const fs::path report = tmp.path() / "child_error.txt";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl {};
    if (::getrlimit(RLIMIT_FSIZE, &rl) != 0) ::_exit(4);
    const rlim_t hard = rl.rlim_max;
    rl.rlim_cur = static_cast<rlim_t>(limit);  // the soft limit only: it can be lifted again
    if (::setrlimit(RLIMIT_FSIZE, &rl) != 0) ::_exit(4);
    int code = 0;
    std::string text;
    try {
      save_on(m, root, 2, 2);
      code = 5;  // the save went through: the parent fails the test
    } catch (const std::exception& e) {
      text = e.what();
    }
    rl.rlim_cur = hard;
    ::setrlimit(RLIMIT_FSIZE, &rl);
    std::ofstream(report) << text;
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  ASSERT_EQ(WEXITSTATUS(status), 0) << "4: setrlimit failed, 5: the save did not fail";
  std::ifstream in(report);
  const std::string what((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(what.find("rank_0000"), std::string::npos) << what;
  EXPECT_NE(what.find(std::strerror(EFBIG)), std::string::npos) << what;
  EXPECT_FALSE(fs::exists(root / "step_0000002.partial")) << what;
  EXPECT_FALSE(fs::exists(root / "step_0000002")) << what;
  expect_state_is_seed(load_on(DeviceMesh(1, 1, 1), root / "step_0000001", 3).states, 1,
                       "step 1 after the failed save");
}

// A real crash: a child process saves and dies inside the save (SIGKILL, or _exit as a process
// that calls exit() from a signal handler would), including in the middle of a rank file, after
// some of its datasets and before its fsync. The parent then finds the previous checkpoint
// loadable bitwise, the .partial directory ignored by load, `ckpt inspect`, the listing and
// keep-last-N, and a later save committing.
TEST(CheckpointTest, SaveKilledMidWriteLeavesPreviousCheckpoint) {
  constexpr int kCrashExit = 42;
  struct Kill {
    SavePoint point;
    int rank;
    int64_t dataset;  // for kDatasetWritten
    bool sigkill;     // else _exit(kCrashExit)
  };
  // On dp_shard 4 rank 0 writes every replicated key and its shards (12 datasets), rank 2 its
  // shards of the five sharded keys that reach it (at least 3).
  const std::vector<Kill> kills = {
      {SavePoint::kDatasetWritten, 0, 0, true}, {SavePoint::kDatasetWritten, 0, 6, false},
      {SavePoint::kDatasetWritten, 2, 2, true}, {SavePoint::kRankFileWritten, 1, -1, true},
      {SavePoint::kBeforeIndex, 0, -1, false},  {SavePoint::kBeforeRename, 0, -1, true},
  };
  const DeviceMesh m(1, 4, 1);
  for (const Kill& k : kills) {
    const std::string ctx =
        fmt::format("{} rank {} dataset {}", save_point_name(k.point), k.rank, k.dataset);
    TempDir tmp("kill");
    save_on(m, tmp.path(), 1, 1);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << "fork: " << std::strerror(errno);
    if (pid == 0) {
      // Child: never returns into gtest.
      CheckpointOptions crash;
      crash.keep_last = 1;  // a completed save would delete step 1: the kill must come first
      crash.fault_hook = [k](SavePoint p, int rank, int64_t dataset) {
        if (p == k.point && rank == k.rank && dataset == k.dataset) {
          if (k.sigkill) ::raise(SIGKILL);
          ::_exit(kCrashExit);
        }
      };
      try {
        save_on(m, tmp.path(), 2, 2, crash);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);  // the hook never fired: the parent fails the test
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid) << ctx;
    if (k.sigkill) {
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
          << ctx << " status " << status;
    } else {
      ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == kCrashExit)
          << ctx << " status " << status;
    }
    const fs::path partial = tmp.path() / "step_0000002.partial";
    EXPECT_TRUE(fs::is_directory(partial)) << ctx;
    EXPECT_FALSE(fs::exists(tmp.path() / "step_0000002")) << ctx;
    // Listing (and so keep-last-N and `latest`) sees only the complete checkpoint.
    const auto listed = list_checkpoints(tmp.path());
    ASSERT_EQ(listed.size(), 1u) << ctx;
    EXPECT_EQ(listed[0].filename(), "step_0000001") << ctx;
    expect_state_is_seed(load_on(DeviceMesh(1, 2, 2), listed[0], 2).states, 1, ctx);
    expect_load_fails(DeviceMesh(1, 1, 1), partial, kernels::ErrorKind::kInput,
                      {"step_0000002.partial", "incomplete"});
    {
      const std::string dir = partial.string();
      std::vector<const char*> argv = {"meshproof", "ckpt", "inspect", dir.c_str()};
      std::ostringstream out, err;
      EXPECT_EQ(harness::run_cli(static_cast<int>(argv.size()), argv.data(), out, err),
                harness::kExitBadInput)
          << ctx;
      EXPECT_NE(err.str().find("incomplete (.partial) save"), std::string::npos) << err.str();
    }
    // A later save with keep_last 2 commits, removes the partial directory and keeps step 1
    // (the partial one did not count as a checkpoint). A folder that only looks like a partial
    // save is not meshproof's and stays.
    const fs::path not_ours = tmp.path() / "notes.partial";
    fs::create_directories(not_ours);
    CheckpointOptions keep2;
    keep2.keep_last = 2;
    save_on(m, tmp.path(), 3, 3, keep2);
    EXPECT_FALSE(fs::exists(partial)) << ctx;
    EXPECT_TRUE(fs::is_directory(not_ours)) << ctx;
    fs::remove(not_ours);
    const auto after = list_checkpoints(tmp.path());
    ASSERT_EQ(after.size(), 2u) << ctx;
    EXPECT_EQ(after[0].filename(), "step_0000001") << ctx;
    EXPECT_EQ(after[1].filename(), "step_0000003") << ctx;
    expect_state_is_seed(load_on(DeviceMesh(2, 2, 1), after[1], 2).states, 3, ctx);
  }
}

TEST(CheckpointTest, FlippedByteIsCaughtAndNothingIsModified) {
  TempDir tmp("flip");
  const fs::path dir = save_on(DeviceMesh(1, 2, 1), tmp.path(), 1, 1);
  flip_byte(dir / "rank_00001.h5", "/model/layers.0.attn.qkv.weight", 5);
  // One rank reads the bad chunk; the other rank must not commit either.
  expect_load_fails(DeviceMesh(1, 2, 1), dir, kernels::ErrorKind::kIntegrity,
                    {"checksum mismatch", "model/layers.0.attn.qkv.weight", "rank_00001.h5"});
  expect_load_fails(DeviceMesh(1, 1, 1), dir, kernels::ErrorKind::kIntegrity,
                    {"checksum mismatch", "rank_00001.h5"});
}

TEST(CheckpointTest, TruncatedFileIsAClearError) {
  TempDir tmp("trunc");
  const fs::path dir = save_on(DeviceMesh(1, 2, 1), tmp.path(), 1, 1);
  const fs::path f = dir / "rank_00001.h5";
  fs::resize_file(f, fs::file_size(f) / 2);
  expect_load_fails(DeviceMesh(1, 2, 1), dir, kernels::ErrorKind::kIntegrity,
                    {"rank_00001.h5", "truncated"});
  // Also when the recorded size is not there to compare (an index edited and re-sealed with a
  // matching checksum): HDF5 itself fails, still an integrity error naming the file.
  const fs::path idx = dir / "index.json";
  std::ifstream in(idx);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  auto j = nlohmann::json::parse(text);
  j["files"][1]["bytes"] = static_cast<int64_t>(fs::file_size(f));
  j.erase("index_xxh64");
  j["index_xxh64"] = fmt::format("{:016x}", XXH64(j.dump().data(), j.dump().size(), 0));
  std::ofstream(idx) << j.dump();
  expect_load_fails(DeviceMesh(1, 1, 1), dir, kernels::ErrorKind::kIntegrity, {"rank_00001.h5"});
}

TEST(CheckpointTest, MissingIndexAndMissingDirectory) {
  TempDir tmp("noindex");
  const fs::path dir = save_on(DeviceMesh(1, 1, 1), tmp.path(), 1, 1);
  fs::remove(dir / "index.json");
  expect_load_fails(DeviceMesh(1, 1, 1), dir, kernels::ErrorKind::kInput, {"index.json"});
  expect_load_fails(DeviceMesh(1, 1, 1), tmp.path() / "step_0000099", kernels::ErrorKind::kInput,
                    {"step_0000099", "does not exist"});
  EXPECT_FALSE(latest_checkpoint(tmp.path()).has_value());
}

// Loads `dir` into a seed-2 state on one rank after `edit` changed it; expects kInput naming
// `needle` and an unchanged state.
void expect_mismatch(const fs::path& dir, const std::function<void(ShardedState&)>& edit,
                     const std::string& needle) {
  const DeviceMesh m(1, 1, 1);
  mesh::LocalWorld world(m);
  std::vector<ShardedState> states(2);  // live, copy before the load
  ShardedState& s = states[0];
  ShardedState& before = states[1];
  try {
    world.run([&](mesh::RankComms& comms) {
      s = make_state(m, 0, 2);
      edit(s);
      before = s;
      for (auto& e : before.entries) e.local = e.local.clone();
      load_checkpoint(dir, s, comms);
    });
    detach(states);
    ADD_FAILURE() << "no error for " << needle;
  } catch (const kernels::Error& e) {
    detach(states);
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  ASSERT_EQ(s.entries.size(), before.entries.size());
  for (size_t i = 0; i < s.entries.size(); ++i) {
    EXPECT_TRUE(same_bytes(s.entries[i].local, before.entries[i].local)) << s.entries[i].key;
  }
  EXPECT_EQ(s.scalars, before.scalars);
}

TEST(CheckpointTest, ShapeDtypeAndKeyMismatchesNameTheKey) {
  TempDir tmp("mismatch");
  const fs::path dir = save_on(DeviceMesh(1, 2, 1), tmp.path(), 1, 1);
  const DeviceMesh one(1, 1, 1);
  auto replace = [&](ShardedState& s, const std::string& key, kernels::Shape shape,
                     kernels::DType dtype) {
    for (auto& e : s.entries) {
      if (e.key != key) continue;
      e.layout = mesh::Layout(one, shape, e.layout.placements());
      e.local = Tensor::zeros(shape, dtype, kernels::Device::cpu());
    }
  };
  expect_mismatch(
      dir,
      [&](ShardedState& s) {
        replace(s, "model/final_ln.weight", kernels::Shape{6}, kernels::DType::kFloat32);
      },
      "'model/final_ln.weight' has global shape [5]");
  expect_mismatch(
      dir,
      [&](ShardedState& s) {
        replace(s, "model/final_ln.weight", kernels::Shape{5}, kernels::DType::kBFloat16);
      },
      "'model/final_ln.weight' has dtype float32");
  expect_mismatch(
      dir,
      [&](ShardedState& s) {
        s.entries.push_back(StateEntry{
            "model/extra", mesh::Layout(one, kernels::Shape{2}, s.entries[0].layout.placements()),
            Tensor::zeros(kernels::Shape{2}, kernels::DType::kFloat32, kernels::Device::cpu())});
      },
      "'model/extra' of the live state is missing");
  expect_mismatch(
      dir, [&](ShardedState& s) { s.entries.erase(s.entries.begin()); },
      "has no tensor in the live state");
  expect_mismatch(
      dir, [&](ShardedState& s) { s.scalars["data/epoch"] = 1; }, "scalar 'data/epoch'");
}

// The value of key `key` in the reassembled states.
Tensor global_of(const std::vector<ShardedState>& states, const std::string& key) {
  for (size_t e = 0; e < states[0].entries.size(); ++e) {
    if (states[0].entries[e].key == key) return reassemble(states, e);
  }
  ADD_FAILURE() << "no key " << key;
  return {};
}

const testing::SyntheticKey& key_named(const std::string& key) {
  for (const auto& k : synthetic_keys()) {
    if (k.key == key) return k;
  }
  throw std::runtime_error("no synthetic key " + key);
}

TEST(CheckpointTest, Fp8StateDroppedFault) {
  TempDir tmp("fp8drop");
  CheckpointOptions fault;
  fault.faults.fp8_state_dropped_from_checkpoint = true;
  const fs::path dir = save_on(DeviceMesh(1, 2, 1), tmp.path(), 1, 1, fault);
  const CheckpointIndex index = read_checkpoint_index(dir);
  EXPECT_EQ(index.keys.count("fp8/layers.0.attn.qkv/input/scale"), 0u);
  EXPECT_EQ(index.keys.count("fp8/layers.0.attn.qkv/input/amax_history"), 0u);
  EXPECT_EQ(index.keys.count("fp8_params/layers.0.attn.qkv.weight/data"), 1u);
  // Without the fault active the missing FP8 state is an error ...
  expect_load_fails(DeviceMesh(1, 1, 2), dir, kernels::ErrorKind::kInput,
                    {"fp8/layers.0.attn.qkv/input"});
  // ... with it, the FP8 state keeps its live value and everything else is restored.
  LoadOutcome out = load_on(DeviceMesh(1, 1, 2), dir, 2, fault);
  for (const auto& k : synthetic_keys()) {
    const uint64_t expect_seed = k.key.rfind("fp8/", 0) == 0 ? 2 : 1;
    EXPECT_TRUE(same_bytes(global_of(out.states, k.key), synthetic_global(k, expect_seed)))
        << k.key;
  }
}

TEST(CheckpointTest, ScaleInvSavedBf16Fault) {
  TempDir tmp("bf16scale");
  CheckpointOptions fault;
  fault.faults.scale_inv_saved_bf16 = true;
  const fs::path dir = save_on(DeviceMesh(1, 1, 1), tmp.path(), 1, 1, fault);
  LoadOutcome out = load_on(DeviceMesh(1, 2, 1), dir, 2);
  for (const std::string key :
       {"fp8/layers.0.attn.qkv/input/scale", "fp8_params/layers.0.attn.qkv.weight/scale_inv"}) {
    const float original = synthetic_global(key_named(key), 1).to_vector<float>()[0];
    const float rounded = kernels::fmt8::bf16_to_float(kernels::fmt8::float_to_bf16(original));
    ASSERT_NE(original, rounded) << "test value is bf16-exact, the fault would be invisible";
    EXPECT_EQ(global_of(out.states, key).to_vector<float>()[0], rounded) << key;
  }
  // Other fp32 keys are saved exactly.
  EXPECT_TRUE(
      same_bytes(global_of(out.states, "fp8/layers.0.attn.qkv/input/amax_history"),
                 synthetic_global(key_named("fp8/layers.0.attn.qkv/input/amax_history"), 1)));
}

TEST(CheckpointTest, RestoreFaultsSkipCursorAndOptimizerState) {
  TempDir tmp("restore");
  const fs::path dir = save_on(DeviceMesh(1, 2, 2), tmp.path(), 1, 1);
  {
    CheckpointOptions f;
    f.faults.data_cursor_not_restored = true;
    LoadOutcome out = load_on(DeviceMesh(1, 2, 1), dir, 2, f);
    EXPECT_EQ(out.states[0].scalars.at("data/cursor"), synthetic_scalars(2).at("data/cursor"));
    EXPECT_EQ(out.states[1].scalars.at("optim/step"), synthetic_scalars(1).at("optim/step"));
  }
  for (const std::string part : {"all", "exp_avg", "exp_avg_sq", "step"}) {
    CheckpointOptions f;
    f.faults.optimizer_state_not_restored = true;
    f.faults.optimizer_state_part = part;
    LoadOutcome out = load_on(DeviceMesh(2, 1, 1), dir, 2, f);
    for (const auto& k : synthetic_keys()) {
      const bool optim = k.key.rfind("optim/", 0) == 0;
      const bool skipped =
          optim && (part == "all" || (part == "exp_avg" && k.key.ends_with("/exp_avg")) ||
                    (part == "exp_avg_sq" && k.key.ends_with("/exp_avg_sq")));
      EXPECT_TRUE(same_bytes(global_of(out.states, k.key), synthetic_global(k, skipped ? 2 : 1)))
          << part << " " << k.key;
    }
    const bool step_skipped = part == "all" || part == "step";
    EXPECT_EQ(out.states[0].scalars.at("optim/step"),
              synthetic_scalars(step_skipped ? 2 : 1).at("optim/step"))
        << part;
    EXPECT_EQ(out.states[0].scalars.at("data/cursor"), synthetic_scalars(1).at("data/cursor"));
  }
}

TEST(CheckpointTest, H5pyReadsRankFilesAndReassemblesTheSameBytes) {
  const std::string python = MESHPROOF_TEST_PYTHON;
  if (python.empty() || !fs::exists(python)) GTEST_SKIP() << "no python3 with h5py configured";
  const fs::path src = test_support::source_dir();
  TempDir tmp("h5py");
  const fs::path dir = save_on(DeviceMesh(2, 2, 2), tmp.path(), 3, 1);
  const fs::path out = tmp.path() / "py";
  const std::string cmd = fmt::format("'{}' '{}' '{}' '{}'", python,
                                      (src / "tests/engine/checkpoint/read_with_h5py.py").string(),
                                      dir.string(), out.string());
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const auto& k : synthetic_keys()) {
    std::string name = k.key;
    for (char& c : name) {
      if (c == '/') c = '#';
    }
    std::string file;
    for (char c : name) file += c == '#' ? std::string("__") : std::string(1, c);
    std::ifstream in(out / (file + ".bin"), std::ios::binary);
    ASSERT_TRUE(in.good()) << file;
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const Tensor g = synthetic_global(k, 1);
    ASSERT_EQ(static_cast<int64_t>(bytes.size()), g.nbytes().value) << k.key;
    EXPECT_EQ(std::memcmp(bytes.data(), g.raw_data(), bytes.size()), 0) << k.key;
  }
}

}  // namespace
}  // namespace meshproof::engine
