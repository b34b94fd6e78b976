// `meshproof ckpt inspect|verify|diff` through run_cli: output and exit codes (0 ok, 1 findings,
// 2 bad input).
#include <H5Cpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>

#include "ckpt_test_state.h"
#include "engine/checkpoint/checkpoint.h"
#include "harness/verbs/cli.h"
#include "harness/verbs/exit_codes.h"
#include "mesh/local/local_comm.h"
#include "tests/harness/cli_run.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;

using harness::testing::CliResult;
constexpr auto& run = harness::testing::run_meshproof;

class CkptCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / fmt::format("meshproof_ckpt_cli_{}", ::getpid());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // Saves the seed's synthetic state on `m` under root_/tag as step `step`.
  std::string save(const std::string& tag, const mesh::DeviceMesh& m, uint64_t seed,
                   int64_t step = 7) {
    fs::path dir;
    std::mutex mu;
    mesh::LocalWorld world(m);
    world.run([&](mesh::RankComms& comms) {
      engine::ShardedState s = engine::testing::make_state(m, comms.rank(), seed);
      fs::path d = engine::save_checkpoint(root_ / tag, step, s, comms);
      std::lock_guard<std::mutex> lock(mu);
      dir = d;
    });
    return dir.string();
  }

  // Like save(), with `edit` applied to every rank's state first.
  std::string save_with(const std::string& tag, const mesh::DeviceMesh& m, uint64_t seed,
                        const std::function<void(engine::ShardedState&)>& edit) {
    fs::path dir;
    std::mutex mu;
    mesh::LocalWorld world(m);
    world.run([&](mesh::RankComms& comms) {
      engine::ShardedState s = engine::testing::make_state(m, comms.rank(), seed);
      edit(s);
      fs::path d = engine::save_checkpoint(root_ / tag, 7, s, comms);
      std::lock_guard<std::mutex> lock(mu);
      dir = d;
    });
    return dir.string();
  }

  fs::path root_;
};

TEST_F(CkptCliTest, InspectShowsMeshStepKeysAndChunks) {
  const std::string dir = save("a", mesh::DeviceMesh(1, 2, 2), 1);
  const CliResult r = run({"ckpt", "inspect", dir});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  for (const char* needle :
       {"step 7", "dp_replicate=1,dp_shard=2,tp=2", "model/layers.0.attn.qkv.weight",
        "StridedShard(0, sf=2)", "float32 [13, 8]", "rank_00003.h5", "bfloat16 [9, 4]",
        "data/cursor = 101", "xxh64"}) {
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle << " not in:\n" << r.out;
  }
}

TEST_F(CkptCliTest, VerifyPassesThenNamesAFlippedChunkAndATruncatedFile) {
  const std::string dir = save("a", mesh::DeviceMesh(1, 2, 1), 1);
  CliResult r = run({"ckpt", "verify", dir});
  EXPECT_EQ(r.code, kExitOk) << r.out << r.err;
  EXPECT_NE(r.out.find("OK"), std::string::npos) << r.out;

  // Flip one byte of one chunk's raw data.
  const fs::path file = fs::path(dir) / "rank_00001.h5";
  haddr_t offset;
  {
    H5::H5File f(file.string(), H5F_ACC_RDONLY);
    offset = f.openDataSet("/optim/layers.0.attn.qkv.weight/exp_avg").getOffset();
  }
  {
    std::fstream s(file, std::ios::in | std::ios::out | std::ios::binary);
    s.seekg(static_cast<std::streamoff>(offset));
    char c = 0;
    s.read(&c, 1);
    c = static_cast<char>(c ^ 1);
    s.seekp(static_cast<std::streamoff>(offset));
    s.write(&c, 1);
  }
  r = run({"ckpt", "verify", dir});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("FAIL optim/layers.0.attn.qkv.weight/exp_avg"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank_00001.h5"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("FAIL model/"), std::string::npos) << "only the flipped chunk fails\n"
                                                          << r.out;

  fs::resize_file(file, fs::file_size(file) - 100);
  r = run({"ckpt", "verify", dir});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("truncated"), std::string::npos) << r.out;
}

TEST_F(CkptCliTest, DiffEqualAcrossMeshesAndDifferentAcrossSeeds) {
  // The same global state saved on two meshes is equal key by key after reassembly.
  const std::string a = save("a", mesh::DeviceMesh(2, 2, 2), 1);
  const std::string b = save("b", mesh::DeviceMesh(1, 1, 1), 1);
  CliResult r = run({"ckpt", "diff", a, b});
  EXPECT_EQ(r.code, kExitOk) << r.out << r.err;
  EXPECT_NE(r.out.find("checkpoints are equal"), std::string::npos) << r.out;

  const std::string c = save("c", mesh::DeviceMesh(1, 4, 1), 2);
  r = run({"ckpt", "diff", a, c});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("model/final_ln.weight: 5 of 5 elements differ"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("max ULP"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("scalar data/cursor: 101 vs 102"), std::string::npos) << r.out;
}

TEST_F(CkptCliTest, DiffReportsAOneUlpChange) {
  const std::string a = save("a", mesh::DeviceMesh(1, 1, 1), 1);
  // Same state except one fp32 element moved by exactly one ULP.
  fs::path dir;
  const mesh::DeviceMesh m(1, 2, 1);
  mesh::LocalWorld world(m);
  world.run([&](mesh::RankComms& comms) {
    engine::ShardedState s = engine::testing::make_state(m, comms.rank(), 1);
    for (auto& e : s.entries) {
      if (e.key == "model/final_ln.weight" && comms.rank() == 0) {
        float* p = e.local.data<float>();
        p[1] = std::nextafter(p[1], 1e30f);
      }
    }
    fs::path d = engine::save_checkpoint(root_ / "b", 7, s, comms);
    if (comms.rank() == 0) dir = d;
  });
  const CliResult r = run({"ckpt", "diff", a, dir.string()});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("model/final_ln.weight: 1 of 5 elements differ"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("max ULP 1\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model/layers.0.attn.qkv.weight: equal"), std::string::npos) << r.out;
}

TEST_F(CkptCliTest, BadInputExitsTwo) {
  EXPECT_EQ(run({"ckpt", "inspect", (root_ / "nope").string()}).code, kExitBadInput);
  EXPECT_EQ(run({"ckpt", "verify", (root_ / "nope").string()}).code, kExitBadInput);
  const std::string a = save("a", mesh::DeviceMesh(1, 1, 1), 1);
  EXPECT_EQ(run({"ckpt", "diff", a}).code, kExitBadInput);
  EXPECT_EQ(run({"ckpt"}).code, kExitBadInput);
  fs::remove(fs::path(a) / "index.json");
  const CliResult r = run({"ckpt", "verify", a});
  EXPECT_EQ(r.code, kExitBadInput);
  EXPECT_NE(r.err.find("index.json"), std::string::npos) << r.err;
}

TEST_F(CkptCliTest, InspectSummaryAndKeyFilter) {
  const std::string dir = save("a", mesh::DeviceMesh(1, 1, 1), 1);
  CliResult r = run({"ckpt", "inspect", dir, "--summary"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  // One line per key group; model/ holds qkv.weight [13,8], proj.weight [7,10], qkv.bias [3],
  // final_ln.weight [5] (float32) and embed.tok_bf16_copy [9,4] (bfloat16): 218 elements,
  // 4 * 182 + 2 * 36 = 800 bytes, one chunk each on one rank.
  for (const char* needle :
       {"index checksum OK", "key groups (13 keys)",
        "model/  5 keys  5 chunks  218 elements  800 bytes  bfloat16,float32\n", "optim/  2 keys",
        "fp8/  3 keys", "fp8_params/  2 keys", "rng/  1 keys"}) {
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle << " not in:\n" << r.out;
  }
  EXPECT_EQ(r.out.find("xxh64"), std::string::npos) << "no chunk lines in a summary\n" << r.out;

  r = run({"ckpt", "inspect", dir, "--key", "fp8/*"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_NE(r.out.find("keys (3):"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fp8/layers.0.attn.qkv/input/scale  float32"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("model/"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("fp8_params/"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("data/cursor"), std::string::npos) << r.out;
  r = run({"ckpt", "inspect", dir, "--key", "nothing/*"});
  EXPECT_EQ(r.code, kExitBadInput) << r.out;

  // A hand-edited index: inspect shows it and exits 1.
  const fs::path idx = fs::path(dir) / "index.json";
  std::ifstream in(idx);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  const std::string from = "\"data/cursor\": 101";
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos);
  text.replace(at, from.size(), "\"data/cursor\": 105");
  std::ofstream(idx) << text;
  r = run({"ckpt", "inspect", dir});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("index checksum MISMATCH"), std::string::npos) << r.out;
}

// A cross-mesh pair that is correct up to rounding: B is A's state with every fp32 model/ element
// moved by one ULP. One ULP of a normal float is between 2^-24 and 2^-23 of its magnitude, so
// --rtol 2.4e-7 (> 2^-22, with margin for |b| vs |a|) must pass and --rtol 2e-8 (< 2^-24) must
// fail on every moved element.
TEST_F(CkptCliTest, DiffWithToleranceAndKeyFilter) {
  const std::string a = save("a", mesh::DeviceMesh(2, 2, 2), 1);
  auto nudge = [](engine::ShardedState& s) {
    for (auto& e : s.entries) {
      if (e.key.rfind("model/", 0) != 0 || e.local.dtype() != kernels::DType::kFloat32) continue;
      float* p = e.local.data<float>();
      for (int64_t i = 0; i < e.local.numel().value; ++i) p[i] = std::nextafter(p[i], 1e30f);
    }
  };
  const std::string b = save_with("b", mesh::DeviceMesh(1, 1, 1), 1, nudge);
  CliResult r = run({"ckpt", "diff", a, b});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("model/final_ln.weight: 5 of 5 elements differ"), std::string::npos)
      << r.out;

  r = run({"ckpt", "diff", a, b, "--rtol", "2.4e-7"});
  EXPECT_EQ(r.code, kExitOk) << r.out << r.err;
  EXPECT_NE(r.out.find("model/final_ln.weight: within tolerance: 5 of 5 elements differ"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("checkpoints match within rtol 2.4e-07"), std::string::npos) << r.out;
  // bfloat16 key untouched: still equal.
  EXPECT_NE(r.out.find("model/embed.tok_bf16_copy: equal"), std::string::npos) << r.out;

  r = run({"ckpt", "diff", a, b, "--rtol", "2e-8"});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("model/final_ln.weight: 5 of 5 elements differ"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("5 outside rtol 2e-08"), std::string::npos) << r.out;

  // --key: only the optimizer state (untouched) is compared; the flag takes one glob per use,
  // also before the positionals.
  r = run({"ckpt", "diff", "--key", "optim/*", a, b});
  EXPECT_EQ(r.code, kExitOk) << r.out << r.err;
  EXPECT_EQ(r.out.find("model/"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("checkpoints are equal (2 keys, 1 scalars)"), std::string::npos) << r.out;
  r = run({"ckpt", "diff", a, b, "--key", "optim/*/exp_avg", "--key", "model/final_ln.weight"});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("optim/layers.0.attn.qkv.weight/exp_avg: equal"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("model/final_ln.weight: 5 of 5"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("exp_avg_sq"), std::string::npos) << r.out;

  // Scalars stay exact under a tolerance.
  const std::string c = save_with("c", mesh::DeviceMesh(1, 2, 1), 1, [&](engine::ShardedState& s) {
    nudge(s);
    s.scalars["data/cursor"] += 1;
  });
  r = run({"ckpt", "diff", a, c, "--rtol", "2.4e-7"});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("scalar data/cursor: 101 vs 102"), std::string::npos) << r.out;

  EXPECT_EQ(run({"ckpt", "diff", a, b, "--rtol", "-1"}).code, kExitBadInput);
  EXPECT_EQ(run({"ckpt", "diff", a, b, "--atol", "nan"}).code, kExitBadInput);
  EXPECT_EQ(run({"ckpt", "diff", a, b, "--key", "nothing*"}).code, kExitBadInput);
}

// ULP distances of int64 values span 2^64: 2^62 vs -2^62 is 2^63 apart (the signed difference
// overflowed and printed "max ULP 0").
TEST_F(CkptCliTest, DiffUlpDistanceDoesNotOverflow) {
  auto set_rng = [](int64_t v) {
    return [v](engine::ShardedState& s) {
      for (auto& e : s.entries) {
        if (e.key == "rng/philox_state") e.local.data<int64_t>()[0] = v;
      }
    };
  };
  const int64_t big = int64_t{1} << 62;
  const std::string a = save_with("a", mesh::DeviceMesh(1, 1, 1), 1, set_rng(big));
  const std::string b = save_with("b", mesh::DeviceMesh(1, 2, 1), 1, set_rng(-big));
  const CliResult r = run({"ckpt", "diff", a, b});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("rng/philox_state: 1 of 2 elements differ, max abs 9.22337e+18, max rel "
                       "2, max ULP 9223372036854775808\n"),
            std::string::npos)
      << r.out;
}

// A corrupted chunk in B: diff names the key and file and still compares every other key.
TEST_F(CkptCliTest, DiffNamesACorruptedChunkAndComparesTheRest) {
  const std::string a = save("a", mesh::DeviceMesh(1, 1, 1), 1);
  const std::string b = save("b", mesh::DeviceMesh(1, 2, 1), 1);
  const fs::path file = fs::path(b) / "rank_00001.h5";
  haddr_t offset;
  {
    H5::H5File f(file.string(), H5F_ACC_RDONLY);
    offset = f.openDataSet("/model/layers.0.attn.qkv.weight").getOffset();
  }
  {
    std::fstream s(file, std::ios::in | std::ios::out | std::ios::binary);
    s.seekg(static_cast<std::streamoff>(offset));
    char ch = 0;
    s.read(&ch, 1);
    ch = static_cast<char>(ch ^ 4);
    s.seekp(static_cast<std::streamoff>(offset));
    s.write(&ch, 1);
  }
  const CliResult r = run({"ckpt", "diff", a, b});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("model/layers.0.attn.qkv.weight: cannot compare:"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("checksum mismatch in dataset /model/layers.0.attn.qkv.weight of " +
                       file.string()),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("model/layers.0.attn.proj.weight: equal"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("optim/layers.0.attn.qkv.weight/exp_avg: equal"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("1 difference(s)"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace meshproof::harness
