// `meshproof ckpt inspect|verify|diff` through run_cli: output and exit codes (0 ok, 1 findings,
// 2 bad input).
#include <H5Cpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "ckpt_test_state.h"
#include "engine/checkpoint.h"
#include "harness/cli.h"
#include "harness/exit_codes.h"
#include "mesh/local_comm.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;

struct CliResult {
  int code;
  std::string out;
  std::string err;
};

CliResult run(std::vector<std::string> args) {
  std::vector<const char*> argv = {"meshproof"};
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int code = run_cli(static_cast<int>(argv.size()), argv.data(), out, err);
  return {code, out.str(), err.str()};
}

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

}  // namespace
}  // namespace meshproof::harness
