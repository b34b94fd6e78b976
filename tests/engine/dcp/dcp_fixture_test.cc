// PyTorch DCP folders that torch itself wrote (tests/data/dcp/torch-<version>/, written by
// tools/make-dcp-fixtures): read, verified, reassembled and compared without torch, by the engine
// (engine/dcp) and by `meshproof ckpt inspect|verify|diff`. Every fixture holds the same model and
// optimizer state, so each reassembles to the world-size-1 save bit for bit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "engine/dcp/dcp_checkpoint.h"
#include "kernels/core/error.h"
#include "tests/harness/cli_run.h"
#include "tests/source_dir.h"

namespace meshproof::engine {
namespace {

namespace fs = std::filesystem;
using harness::testing::run_meshproof;

std::pair<int, int> version_of(const fs::path& p);

// Every torch-<version> folder of tests/data/dcp, oldest first.
std::vector<fs::path> torch_versions() {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(test_support::source_dir() / "tests/data/dcp")) {
    if (e.is_directory() && e.path().filename().string().starts_with("torch-")) {
      out.push_back(e.path());
    }
  }
  std::sort(out.begin(), out.end(),
            [](const fs::path& a, const fs::path& b) { return version_of(a) < version_of(b); });
  return out;
}

// The torch (major, minor) of a torch-<version> folder.
std::pair<int, int> version_of(const fs::path& p) {
  std::smatch m;
  const std::string name = p.filename().string();
  EXPECT_TRUE(std::regex_match(name, m, std::regex(R"(torch-(\d+)\.(\d+)\..*)"))) << name;
  return {std::stoi(m[1]), std::stoi(m[2])};
}

// The fixtures of one version folder: every subfolder holding .metadata, damaged/ aside.
std::vector<fs::path> fixtures(const fs::path& version) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(version)) {
    if (e.is_directory() && is_dcp_checkpoint(e.path())) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

nlohmann::json fixture_record(const fs::path& dir) {
  std::ifstream f(dir / "fixture.json");
  return nlohmann::json::parse(f);
}

bool same_bytes(const kernels::Tensor& a, const kernels::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw_data(), b.raw_data(), static_cast<size_t>(a.nbytes().value)) == 0;
}

TEST(DcpFixtures, EveryVersionHoldsTheFixtureSet) {
  const auto versions = torch_versions();
  ASSERT_FALSE(versions.empty()) << "no tests/data/dcp/torch-* folder";
  // The oldest release the reader supports wrote the first set.
  EXPECT_EQ(versions.front().filename(), "torch-2.4.1");
  for (const fs::path& v : versions) {
    std::set<std::string> names;
    for (const fs::path& f : fixtures(v)) names.insert(f.filename().string());
    std::set<std::string> want{"ws1", "fsdp2_ws2", "fsdp2_ws4", "bf16_ws1", "bf16_fsdp2_ws2"};
    if (version_of(v) >= std::pair{2, 5}) want.insert("fsdp2_tp_2x2");
    EXPECT_EQ(names, want) << v;
  }
}

TEST(DcpFixtures, MetadataSaysWhatTorchSaved) {
  for (const fs::path& v : torch_versions()) {
    for (const fs::path& dir : fixtures(v)) {
      SCOPED_TRACE(dir.string());
      const DcpMetadata meta = read_dcp_metadata(dir);
      const nlohmann::json rec = fixture_record(dir);
      const std::string dtype = rec["param_dtype"];
      const int64_t vocab = rec["model"]["vocab"], dim = rec["model"]["dim"];
      ASSERT_TRUE(meta.entries.contains("model.tok_embeddings.weight"));
      const DcpEntry& emb = meta.entries.at("model.tok_embeddings.weight");
      EXPECT_EQ(emb.dtype_name, dtype);
      EXPECT_EQ(emb.shape, (std::vector<int64_t>{vocab, dim}));
      const int world = rec["world_size"];
      EXPECT_EQ(emb.chunks.size(), static_cast<size_t>(world));
      // AdamW's state under get_state_dict's names, keyed by the parameter's FQN.
      for (const char* s : {"exp_avg", "exp_avg_sq", "step"}) {
        EXPECT_TRUE(
            meta.entries.contains(
                fmt::format("optim.state.model.layers.0.attention.wq.weight.{}", s)) ||
            meta.entries.contains(fmt::format("optim.state.layers.0.attention.wq.weight.{}", s)))
            << s;
      }
      ASSERT_TRUE(meta.entries.contains("extra_state"));
      EXPECT_TRUE(meta.entries.at("extra_state").bytes);
      // One writer file per rank, every item named.
      std::set<std::string> files;
      for (const auto& [k, e] : meta.entries) {
        for (const DcpChunk& c : e.chunks) {
          ASSERT_TRUE(c.item.has_value()) << k;
          files.insert(c.item->file);
        }
      }
      EXPECT_EQ(files.size(), static_cast<size_t>(world));
      EXPECT_TRUE(meta.stray_items.empty());
    }
  }
}

TEST(DcpFixtures, VerifyPassesOnEveryFixture) {
  for (const fs::path& v : torch_versions()) {
    for (const fs::path& dir : fixtures(v)) {
      const VerifyReport r = verify_dcp_checkpoint(dir);
      EXPECT_TRUE(r.ok()) << dir << ": " << (r.ok() ? "" : r.findings[0].message);
      EXPECT_GT(r.chunks, r.keys - 1) << dir;
    }
  }
}

TEST(DcpFixtures, PlacementsFollowTheMesh) {
  for (const fs::path& v : torch_versions()) {
    SCOPED_TRACE(v.string());
    const auto emb = [&](const char* f) {
      return describe_dcp_placement(
          read_dcp_metadata(v / f).entries.at("model.tok_embeddings.weight"));
    };
    EXPECT_EQ(emb("ws1"), "replicated (one chunk)");
    // 255 rows: 128 + 127 over 2, 64 x 3 + 63 over 4 (torch.chunk's split).
    EXPECT_EQ(emb("fsdp2_ws2"), "Shard(0) over 2, uneven last chunk");
    EXPECT_EQ(emb("fsdp2_ws4"), "Shard(0) over 4, uneven last chunk");
    if (fs::exists(v / "fsdp2_tp_2x2")) {
      // wq is TP colwise (Shard(0) over tp) and FSDP2 shards the TP shard's rows again: rank
      // (dp d, tp t) holds rows block 2t + d, so the writers are not in global row order.
      const DcpMetadata m = read_dcp_metadata(v / "fsdp2_tp_2x2");
      const std::string wq =
          describe_dcp_placement(m.entries.at("model.layers.0.attention.wq.weight"));
      EXPECT_NE(wq.find("Shard(0) over 4"), std::string::npos) << wq;
      EXPECT_NE(wq.find("strided"), std::string::npos) << wq;
      // wo is TP rowwise (Shard(1)) under FSDP2's Shard(0): a 2 x 2 grid.
      const std::string wo =
          describe_dcp_placement(m.entries.at("model.layers.0.attention.wo.weight"));
      EXPECT_EQ(wo, "Shard(0) over 2 x Shard(1) over 2") << wo;
    }
  }
}

TEST(DcpFixtures, EveryShardingReassemblesToTheOneRankSaveBitwise) {
  for (const fs::path& v : torch_versions()) {
    for (const std::string base : {"ws1", "bf16_ws1"}) {
      const DcpMetadata ref = read_dcp_metadata(v / base);
      const std::string prefix = base == "ws1" ? "" : "bf16_";
      for (const fs::path& dir : fixtures(v)) {
        const std::string name = dir.filename().string();
        if (name == base || name.starts_with("bf16_") != !prefix.empty()) continue;
        SCOPED_TRACE(dir.string());
        const DcpMetadata m = read_dcp_metadata(dir);
        std::set<std::string> ref_keys, keys;
        for (const auto& [k, e] : ref.entries) ref_keys.insert(k);
        for (const auto& [k, e] : m.entries) keys.insert(k);
        EXPECT_EQ(keys, ref_keys);
        int tensors = 0;
        for (const auto& [k, e] : ref.entries) {
          if (e.bytes || !m.entries.contains(k)) continue;
          EXPECT_TRUE(
              same_bytes(read_dcp_global(dir, m.entries.at(k)), read_dcp_global(v / base, e)))
              << k;
          ++tensors;
        }
        // Every parameter (3 + 9 per layer), its exp_avg and exp_avg_sq, and its step tensor.
        const int layers = fixture_record(dir)["model"]["n_layers"];
        EXPECT_EQ(tensors, (3 + 9 * layers) * 4);
      }
    }
  }
}

// A copy of one fixture's .distcp files under a fresh folder, with `metadata` as its .metadata.
class DcpDamage : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            fmt::format("meshproof_dcp_{}_{}", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
    version_ = torch_versions().front();
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path copy(const fs::path& metadata) {
    const fs::path dir = root_ / fmt::format("ckpt{}", copies_++);
    fs::create_directories(dir);
    for (const auto& e : fs::directory_iterator(version_ / "fsdp2_ws4")) {
      if (e.path().extension() == ".distcp") fs::copy_file(e.path(), dir / e.path().filename());
    }
    fs::copy_file(metadata, dir / ".metadata");
    return dir;
  }
  fs::path damaged(const std::string& defect) {
    return copy(version_ / "damaged" / defect / ".metadata");
  }
  static std::string findings(const VerifyReport& r) {
    std::string s;
    for (const auto& f : r.findings) s += f.key + " (" + f.file + "): " + f.message + "\n";
    return s;
  }
  fs::path root_, version_;
  int copies_ = 0;
};

TEST_F(DcpDamage, ADroppedChunkIsAGapAtItsFirstIndex) {
  const VerifyReport r = verify_dcp_checkpoint(damaged("drop_chunk"));
  ASSERT_EQ(r.findings.size(), 1u) << findings(r);
  EXPECT_EQ(r.findings[0].key, "model.tok_embeddings.weight");
  EXPECT_NE(r.findings[0].message.find("no chunk covers global index (64, 0)"), std::string::npos)
      << findings(r);
}

TEST_F(DcpDamage, AnOverlapNamesTheKeyAndTheIndex) {
  const VerifyReport r = verify_dcp_checkpoint(damaged("overlap"));
  const std::string all = findings(r);
  ASSERT_FALSE(r.ok());
  for (const auto& f : r.findings) EXPECT_EQ(f.key, "model.layers.0.attention.wq.weight") << all;
  // wq has 16 rows over 4 ranks; chunk 0 grown to 5 rows overlaps chunk 1 at row 4.
  EXPECT_NE(all.find("two chunks cover global index (4, 0)"), std::string::npos) << all;
  // The item still holds 4 rows: the size mismatch is reported too.
  EXPECT_NE(all.find("the metadata says float32 (5, 16)"), std::string::npos) << all;
}

TEST_F(DcpDamage, AnItemPastItsFileAndAShortOrMissingFileAreFound) {
  VerifyReport r = verify_dcp_checkpoint(damaged("outside_file"));
  ASSERT_EQ(r.findings.size(), 1u) << findings(r);
  EXPECT_EQ(r.findings[0].key, "model.tok_embeddings.weight");
  EXPECT_NE(r.findings[0].message.find("lies outside __0_0.distcp"), std::string::npos)
      << findings(r);

  const fs::path dir = copy(version_ / "fsdp2_ws4/.metadata");
  ASSERT_TRUE(verify_dcp_checkpoint(dir).ok());
  fs::resize_file(dir / "__3_0.distcp", fs::file_size(dir / "__3_0.distcp") - 100);
  fs::remove(dir / "__1_0.distcp");
  r = verify_dcp_checkpoint(dir);
  const std::string all = findings(r);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(all.find("(__3_0.distcp): key '"), std::string::npos) << all;
  EXPECT_NE(all.find("lies outside __3_0.distcp"), std::string::npos) << all;
  EXPECT_NE(all.find("its file __1_0.distcp is missing"), std::string::npos) << all;
}

TEST_F(DcpDamage, AFlippedByteInsideAnItemIsFound) {
  const fs::path dir = copy(version_ / "fsdp2_ws4/.metadata");
  const DcpMetadata m = read_dcp_metadata(dir);
  const DcpItem item = *m.entries.at("optim.state.tok_embeddings.weight.exp_avg").chunks[0].item;
  {
    std::fstream f(dir / item.file, std::ios::in | std::ios::out | std::ios::binary);
    // The middle of the item: inside the stored tensor bytes, which the zip entry's CRC-32 covers.
    f.seekg(item.offset + item.length / 2);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(item.offset + item.length / 2);
    f.write(&c, 1);
  }
  const VerifyReport r = verify_dcp_checkpoint(dir);
  ASSERT_EQ(r.findings.size(), 1u) << findings(r);
  EXPECT_EQ(r.findings[0].key, "optim.state.tok_embeddings.weight.exp_avg");
}

TEST_F(DcpDamage, AnUnknownDtypeIsNamedWithItsKey) {
  const VerifyReport r = verify_dcp_checkpoint(damaged("unknown_dtype"));
  const std::string all = findings(r);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.findings[0].key, "model.norm.weight") << all;
  EXPECT_NE(all.find("dtype torch.complex64 is not one this reader knows"), std::string::npos)
      << all;
}

TEST_F(DcpDamage, AForeignOrTruncatedMetadataIsBadInput) {
  const auto input_error = [](const fs::path& dir) {
    try {
      read_dcp_metadata(dir);
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
      return e.message();
    }
    ADD_FAILURE() << "accepted " << dir;
    return std::string();
  };
  const fs::path foreign = damaged("foreign_global");
  std::string msg = input_error(foreign);
  EXPECT_NE(msg.find(".metadata"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'collections.Counter'"), std::string::npos) << msg;
  // Every prefix of a real .metadata fails cleanly (no crash, no hang), naming the file.
  const fs::path dir = root_ / "truncated";
  fs::create_directories(dir);
  std::ifstream in(version_ / "fsdp2_ws2/.metadata", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (size_t n = 0; n < bytes.size(); n += 97) {
    std::ofstream(dir / ".metadata", std::ios::binary | std::ios::trunc).write(bytes.data(), n);
    msg = input_error(dir);
    EXPECT_NE(msg.find((dir / ".metadata").string()), std::string::npos) << n << ": " << msg;
  }
}

// The CLI on the same folders: inspect, verify and diff take a DCP folder wherever they take a
// meshproof checkpoint.
TEST(DcpCli, InspectVerifyDiff) {
  const fs::path v = torch_versions().front();
  auto r = run_meshproof({"ckpt", "inspect", (v / "fsdp2_ws4").string()});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("PyTorch distributed checkpoint (DCP)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model.tok_embeddings.weight  float32 [255, 16]  Shard(0) over 4, uneven "
                       "last chunk  4 chunk(s)"),
            std::string::npos)
      << r.out;
  EXPECT_TRUE(std::regex_search(
      r.out, std::regex(R"(\n    extra_state  bytes  __[0-3]_0\.distcp@\d+ \+\d+\n)")))
      << r.out;
  r = run_meshproof({"ckpt", "inspect", "--summary", (v / "fsdp2_ws4").string()});
  EXPECT_EQ(r.code, 0) << r.err;
  // One layer: 12 parameters, each in 4 chunks.
  EXPECT_NE(r.out.find("    model.  12 keys  48 chunks"), std::string::npos) << r.out;

  r = run_meshproof({"ckpt", "verify", (v / "fsdp2_ws2").string()});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find(": OK, DCP metadata and"), std::string::npos) << r.out;

  r = run_meshproof({"ckpt", "diff", (v / "fsdp2_ws4").string(), (v / "ws1").string()});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("checkpoints are equal"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("extra_state: equal (bytes)"), std::string::npos) << r.out;

  // bf16 against fp32: every tensor key differs in dtype; exit 1.
  r = run_meshproof({"ckpt", "diff", (v / "bf16_ws1").string(), (v / "ws1").string(), "--key",
                     "model.norm.weight"});
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("model.norm.weight: bfloat16 [16] vs float32 [16]"), std::string::npos)
      << r.out;
}

TEST(DcpCli, DamagedFoldersExitOneAndForeignOnesTwo) {
  const fs::path v = torch_versions().front();
  const fs::path root = fs::temp_directory_path() / fmt::format("meshproof_dcp_cli_{}", ::getpid());
  fs::remove_all(root);
  fs::create_directories(root);
  for (const auto& e : fs::directory_iterator(v / "fsdp2_ws4")) {
    if (e.path().extension() == ".distcp") fs::copy_file(e.path(), root / e.path().filename());
  }
  fs::copy_file(v / "damaged/drop_chunk/.metadata", root / ".metadata");
  auto r = run_meshproof({"ckpt", "verify", root.string()});
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("FAIL model.tok_embeddings.weight (.metadata): no chunk covers global index "
                       "(64, 0)"),
            std::string::npos)
      << r.out;
  // diff reads through the gap: the key cannot be compared, the others can.
  r = run_meshproof({"ckpt", "diff", root.string(), (v / "fsdp2_ws4").string()});
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("model.tok_embeddings.weight: cannot compare:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model.norm.weight: equal"), std::string::npos) << r.out;
  fs::copy_file(v / "damaged/foreign_global/.metadata", root / ".metadata",
                fs::copy_options::overwrite_existing);
  r = run_meshproof({"ckpt", "inspect", root.string()});
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("'collections.Counter'"), std::string::npos) << r.err;
  fs::remove_all(root);
}

}  // namespace
}  // namespace meshproof::engine
