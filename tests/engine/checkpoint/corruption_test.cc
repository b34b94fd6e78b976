// The corruption sweep (docs/design.md section 13): one pristine checkpoint (dp_shard 2 x tp 2,
// four rank files) is copied and damaged or edited one way per case: data bytes, HDF5 attributes
// and dataset links, rank files swapped, resized, removed, symlinked or taken from another run
// (also one with byte-identical data), and index.json edits with and without a re-sealed
// checksum (scalars, chunk offsets, dataset/hash swaps between keys, path tricks, floats, wrapping
// integers, malformed hashes, overflowing shapes and offsets, duplicate and unknown fields, old
// format versions). Every case must fail a load on two meshes (state untouched) and
// `ckpt verify`, with the expected exit class (1 integrity, 2 input) and a message naming the key
// and file. The unmodified copy must load and verify clean (no false positives).
#include <H5Cpp.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ckpt_test_files.h"
#include "ckpt_test_state.h"
#include "engine/checkpoint/checkpoint.h"
#include "harness/verbs/cli.h"
#include "harness/verbs/exit_codes.h"
#include "kernels/core/error.h"
#include "mesh/local/local_comm.h"

namespace meshproof::engine {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using kernels::ErrorKind;
using kernels::Tensor;
using mesh::DeviceMesh;
using testing::flip_byte;

const DeviceMesh kMesh(1, 2, 2);
constexpr int64_t kStep = 7;

fs::path save(const DeviceMesh& m, const fs::path& root, uint64_t seed) {
  fs::path dir;
  std::mutex mu;
  mesh::LocalWorld world(m);
  world.run([&](mesh::RankComms& comms) {
    ShardedState s = testing::make_state(m, comms.rank(), seed);
    fs::path d = save_checkpoint(root, kStep, s, comms);
    std::lock_guard<std::mutex> lock(mu);
    dir = d;
  });
  return dir;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_text(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

// The index checksum as an outside tool recomputes it: XXH64 of the compact dump (fields sorted)
// of the index without index_xxh64.
void reseal(json& j) {
  j.erase("index_xxh64");
  const std::string canon = j.dump();
  j["index_xxh64"] = fmt::format("{:016x}", XXH64(canon.data(), canon.size(), 0));
}
// Edits index.json as JSON; `sealed` recomputes the checksum (a careful tamperer).
void edit_index(const fs::path& dir, bool sealed, const std::function<void(json&)>& edit) {
  json j = json::parse(read_text(dir / "index.json"));
  edit(j);
  if (sealed) reseal(j);
  write_text(dir / "index.json", j.dump(1));
}
// Replaces the first `from` in index.json's text (for literals JSON values cannot carry).
void edit_index_text(const fs::path& dir, const std::string& from, const std::string& to) {
  std::string text = read_text(dir / "index.json");
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from << " not in index.json";
  text.replace(at, from.size(), to);
  write_text(dir / "index.json", text);
}
// Records the rank files' current sizes in the index and re-seals it, so that an HDF5 edit is
// caught by the chunk-level checks rather than by the size check.
void refresh_sizes(const fs::path& dir) {
  edit_index(dir, true, [&](json& j) {
    for (json& f : j["files"]) {
      f["bytes"] = static_cast<int64_t>(fs::file_size(dir / f["name"].get<std::string>()));
    }
  });
}

template <typename Obj>
void set_string_attr(Obj& obj, const std::string& name, const std::string& value) {
  if (obj.attrExists(name)) obj.removeAttr(name);
  H5::StrType t(H5::PredType::C_S1, value.size());
  obj.createAttribute(name, t, H5::DataSpace(H5S_SCALAR)).write(t, value);
}

struct Case {
  std::string name;
  std::function<void(const fs::path& dir)> mutate;
  ErrorKind kind;
  std::vector<std::string> needles;  // in the load error and in `ckpt verify`'s output
};

class CheckpointCorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / fmt::format("meshproof_ckpt_sweep_{}", ::getpid());
    fs::remove_all(root_);
    pristine_ = save(kMesh, root_ / "pristine", 1);
    other_ = save(kMesh, root_ / "other", 2);  // another run: different data
    twin_ = save(kMesh, root_ / "twin", 1);    // another run: byte-identical data
  }
  void TearDown() override { fs::remove_all(root_); }

  // A fresh copy of the pristine checkpoint, named like it (step_0000007).
  fs::path copy(const std::string& tag) {
    const fs::path dir = root_ / "cases" / tag / pristine_.filename();
    fs::create_directories(dir.parent_path());
    fs::copy(pristine_, dir, fs::copy_options::recursive);
    return dir;
  }

  fs::path root_, pristine_, other_, twin_;
};

// Loads `dir` on `m` into seed-2 states; returns the error (none: "") after checking its kind,
// needles and that every rank's state is still seed 2.
void expect_load_rejects(const DeviceMesh& m, const fs::path& dir, const Case& c) {
  const std::string ctx = c.name + " on " + m.str();
  std::vector<ShardedState> states(static_cast<size_t>(m.world_size()));
  mesh::LocalWorld world(m);
  try {
    world.run([&](mesh::RankComms& comms) {
      const auto r = static_cast<size_t>(comms.rank());
      states[r] = testing::make_state(m, comms.rank(), 2);
      load_checkpoint(dir, states[r], comms);
    });
    ADD_FAILURE() << ctx << ": the load succeeded silently";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(c.kind)) << ctx << ": " << e.what();
    for (const std::string& n : c.needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << ctx << ": '" << n << "' not in: " << e.what();
    }
  }
  for (ShardedState& s : states) {
    for (StateEntry& e : s.entries) e.local = e.local.clone();
  }
  const auto& keys = testing::synthetic_keys();
  for (size_t k = 0; k < keys.size(); ++k) {
    std::vector<Tensor> locals;
    for (const ShardedState& s : states) locals.push_back(s.entries[k].local);
    const Tensor g = mesh::unshard(locals, states[0].entries[k].layout);
    const Tensor want = testing::synthetic_global(keys[k], 2);
    EXPECT_EQ(std::memcmp(g.raw_data(), want.raw_data(), static_cast<size_t>(g.nbytes().value)), 0)
        << ctx << ": the failed load modified " << keys[k].key;
  }
  for (const ShardedState& s : states) {
    EXPECT_EQ(s.scalars, testing::synthetic_scalars(2)) << ctx << ": scalars modified";
  }
}

void expect_verify_rejects(const fs::path& dir, const Case& c) {
  const std::string d = dir.string();
  std::vector<const char*> argv = {"meshproof", "ckpt", "verify", d.c_str()};
  std::ostringstream out, err;
  const int code = harness::run_cli(static_cast<int>(argv.size()), argv.data(), out, err);
  const int want =
      c.kind == ErrorKind::kIntegrity ? harness::kExitCheckFailed : harness::kExitBadInput;
  const std::string text = out.str() + err.str();
  EXPECT_EQ(code, want) << c.name << ":\n" << text;
  for (const std::string& n : c.needles) {
    EXPECT_NE(text.find(n), std::string::npos) << c.name << ": '" << n << "' not in:\n" << text;
  }
}

TEST_F(CheckpointCorruptionTest, UnmodifiedCopyLoadsAndVerifiesAndResealIsIdentity) {
  const fs::path dir = copy("clean");
  const std::string before = read_text(dir / "index.json");
  json j = json::parse(before);
  const std::string recorded = j["index_xxh64"];
  reseal(j);
  EXPECT_EQ(j["index_xxh64"], recorded) << "the test's reseal must match the engine's checksum";
  std::vector<const char*> argv = {"meshproof", "ckpt", "verify", dir.c_str()};
  std::ostringstream out, err;
  EXPECT_EQ(harness::run_cli(4, argv.data(), out, err), harness::kExitOk) << out.str() << err.str();
  for (const DeviceMesh& m : {DeviceMesh(1, 1, 1), kMesh}) {
    std::vector<ShardedState> states(static_cast<size_t>(m.world_size()));
    mesh::LocalWorld world(m);
    world.run([&](mesh::RankComms& comms) {
      ShardedState s = testing::make_state(m, comms.rank(), 2);
      load_checkpoint(dir, s, comms);
      const ShardedState want = testing::make_state(m, comms.rank(), 1);
      for (size_t k = 0; k < s.entries.size(); ++k) {
        const Tensor& a = s.entries[k].local;
        const Tensor& b = want.entries[k].local;
        EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), static_cast<size_t>(a.nbytes().value)), 0)
            << s.entries[k].key;
      }
      EXPECT_EQ(s.scalars, testing::synthetic_scalars(1));
    });
  }
}

TEST_F(CheckpointCorruptionTest, EveryCorruptionIsCaughtByLoadAndVerify) {
  const std::string qkv = "model/layers.0.attn.qkv.weight";
  const std::string exp_avg = "optim/layers.0.attn.qkv.weight/exp_avg";
  const std::string exp_avg_sq = "optim/layers.0.attn.qkv.weight/exp_avg_sq";
  const std::string tp_key = "fp8/layers.0.mlp.fc1/weight/scale_bytes";  // [64] Shard(0) over tp
  const std::string ln = "model/final_ln.weight";                        // [5] Shard(0) over fsdp
  auto attr_edit = [](const std::string& file, const std::string& dataset,
                      const std::function<void(H5::DataSet&)>& edit) {
    return [=](const fs::path& dir) {
      {
        H5::H5File f((dir / file).string(), H5F_ACC_RDWR);
        H5::DataSet ds = f.openDataSet(dataset);
        edit(ds);
      }
      refresh_sizes(dir);
    };
  };
  const fs::path other = other_;
  const fs::path twin = twin_;
  const std::vector<Case> cases = {
      // ---- data bytes and whole files ----
      {"fp32 chunk byte flipped",
       [&](const fs::path& d) { flip_byte(d / "rank_00001.h5", "/" + qkv, 3, 0x21); },
       ErrorKind::kIntegrity,
       {qkv, "rank_00001.h5", "checksum mismatch"}},
      {"e4m3 chunk byte flipped",
       [&](const fs::path& d) {
         flip_byte(d / "rank_00002.h5", "/fp8_params/layers.0.attn.qkv.weight/data", 0, 0x21);
       },
       ErrorKind::kIntegrity,
       {"fp8_params/layers.0.attn.qkv.weight/data", "rank_00002.h5", "checksum mismatch"}},
      {"rank file truncated",
       [](const fs::path& d) {
         fs::resize_file(d / "rank_00003.h5", fs::file_size(d / "rank_00003.h5") / 2);
       },
       ErrorKind::kIntegrity,
       {"rank_00003.h5", "truncated"}},
      {"rank file grown",
       [](const fs::path& d) { std::ofstream(d / "rank_00000.h5", std::ios::app) << "junk"; },
       ErrorKind::kIntegrity,
       {"rank_00000.h5", "bytes"}},
      {"rank file missing",
       [](const fs::path& d) { fs::remove(d / "rank_00002.h5"); },
       ErrorKind::kIntegrity,
       {"rank_00002.h5", "missing"}},
      // ---- metadata: HDF5 attributes and links (sizes re-recorded so the chunk checks see it)
      // ----
      {"dataset key attribute rewritten",
       attr_edit("rank_00000.h5", "/" + ln,
                 [](H5::DataSet& ds) { set_string_attr(ds, "key", "model/other"); }),
       ErrorKind::kIntegrity,
       {ln, "rank_00000.h5", "`key` attribute"}},
      {"dataset global_offset attribute rewritten",
       attr_edit("rank_00001.h5", "/" + qkv,
                 [](H5::DataSet& ds) {
                   H5::Attribute a = ds.openAttribute("global_offset");
                   const std::vector<int64_t> off = {1, 0};
                   a.write(H5::PredType::NATIVE_INT64, off.data());
                 }),
       ErrorKind::kIntegrity,
       {qkv, "rank_00001.h5", "global offset"}},
      {"dataset dtype attribute rewritten",
       attr_edit("rank_00000.h5", "/model/embed.tok_bf16_copy",
                 [](H5::DataSet& ds) { set_string_attr(ds, "dtype", "float16"); }),
       ErrorKind::kIntegrity,
       {"model/embed.tok_bf16_copy", "rank_00000.h5", "dtype"}},
      {"rank file checkpoint_id rewritten",
       [](const fs::path& d) {
         {
           H5::H5File f((d / "rank_00003.h5").string(), H5F_ACC_RDWR);
           set_string_attr(f, "checkpoint_id", "0123456789abcdef");
         }
         refresh_sizes(d);
       },
       ErrorKind::kIntegrity,
       {"rank_00003.h5", "another checkpoint"}},
      {"datasets of two keys swapped inside a rank file",
       [&](const fs::path& d) {
         {
           H5::H5File f((d / "rank_00001.h5").string(), H5F_ACC_RDWR);
           f.moveLink("/" + exp_avg, "/swap_tmp");
           f.moveLink("/" + exp_avg_sq, "/" + exp_avg);
           f.moveLink("/swap_tmp", "/" + exp_avg_sq);
         }
         refresh_sizes(d);
       },
       ErrorKind::kIntegrity,
       {"optim/layers.0.attn.qkv.weight/exp_avg", "rank_00001.h5"}},
      // ---- files swapped between ranks and from other runs ----
      {"two rank files swapped",
       [](const fs::path& d) {
         fs::rename(d / "rank_00000.h5", d / "tmp.h5");
         fs::rename(d / "rank_00001.h5", d / "rank_00000.h5");
         fs::rename(d / "tmp.h5", d / "rank_00001.h5");
         refresh_sizes(d);
       },
       ErrorKind::kIntegrity,
       {"rank_0000", "checkpoint key '"}},
      {"rank file from another run",
       [other](const fs::path& d) {
         fs::copy_file(other / "rank_00001.h5", d / "rank_00001.h5",
                       fs::copy_options::overwrite_existing);
       },
       ErrorKind::kIntegrity,
       {"rank_00001.h5"}},
      {"rank file from another run, sizes re-recorded",
       [other](const fs::path& d) {
         fs::copy_file(other / "rank_00001.h5", d / "rank_00001.h5",
                       fs::copy_options::overwrite_existing);
         refresh_sizes(d);
       },
       ErrorKind::kIntegrity,
       {"rank_00001.h5", "another checkpoint"}},
      {"rank file from another run with byte-identical data",
       [twin](const fs::path& d) {
         fs::copy_file(twin / "rank_00002.h5", d / "rank_00002.h5",
                       fs::copy_options::overwrite_existing);
         refresh_sizes(d);
       },
       ErrorKind::kIntegrity,
       {"rank_00002.h5", "another checkpoint"}},
      {"rank file is a symlink to another run's file",
       [other](const fs::path& d) {
         fs::remove(d / "rank_00001.h5");
         fs::create_symlink(other / "rank_00001.h5", d / "rank_00001.h5");
       },
       ErrorKind::kInput,
       {"rank_00001.h5", "not a regular file"}},
      // ---- index.json edits ----
      {"scalar data/cursor edited (checksum not re-sealed)",
       [](const fs::path& d) {
         edit_index(d, false, [](json& j) { j["scalars"]["data/cursor"] = 102; });
       },
       ErrorKind::kIntegrity,
       {"index.json", "index checksum mismatch"}},
      {"scalar optim/step -1 (re-sealed)",
       [](const fs::path& d) {
         edit_index(d, true, [](json& j) { j["scalars"]["optim/step"] = -1; });
       },
       ErrorKind::kInput,
       {"index.json", "scalar 'optim/step'", "got -1"}},
      {"scalar 2^64 (wraps to INT64_MIN in a loose parser)",
       [](const fs::path& d) {
         edit_index_text(d, "\"optim/step\": 11", "\"optim/step\": 18446744073709551616");
       },
       ErrorKind::kInput,
       {"index.json", "scalar 'optim/step'"}},
      {"scalar 2^63 (re-sealed)",
       [](const fs::path& d) {
         edit_index(d, true, [](json& j) { j["scalars"]["lr/step"] = uint64_t{1} << 63; });
       },
       ErrorKind::kInput,
       {"index.json", "scalar 'lr/step'"}},
      {"chunk offsets of one key swapped (re-sealed)",
       [&](const fs::path& d) {
         edit_index(d, true, [&](json& j) {
           json& c = j["keys"][tp_key]["chunks"];
           std::swap(c[0]["offset"], c[1]["offset"]);
         });
       },
       ErrorKind::kInput,
       {tp_key, "rank_00000.h5", "box"}},
      {"dataset and xxh64 of two keys swapped (re-sealed)",
       [&](const fs::path& d) {
         edit_index(d, true, [&](json& j) {
           json& a = j["keys"][exp_avg]["chunks"][0];
           json& b = j["keys"][exp_avg_sq]["chunks"][0];
           std::swap(a["dataset"], b["dataset"]);
           std::swap(a["xxh64"], b["xxh64"]);
         });
       },
       ErrorKind::kInput,
       {exp_avg, "rank_00000.h5", "dataset"}},
      {"chunk file ../x",
       [&](const fs::path& d) {
         edit_index(d, true, [&](json& j) { j["keys"][ln]["chunks"][0]["file"] = "../x"; });
       },
       ErrorKind::kInput,
       {ln, "'../x'", "plain file name"}},
      {"chunk file absolute",
       [&](const fs::path& d) {
         edit_index(d, true, [&](json& j) {
           j["keys"][ln]["chunks"][1]["file"] = (other / "rank_00002.h5").string();
         });
       },
       ErrorKind::kInput,
       {ln, "rank_00002.h5", "plain file name"}},
      {"rank file name ../rank_00001.h5",
       [](const fs::path& d) {
         edit_index(d, true, [](json& j) { j["files"][1]["name"] = "../rank_00001.h5"; });
       },
       ErrorKind::kInput,
       {"files[1]", "../rank_00001.h5", "plain file name"}},
      {"mesh dp_shard 1.5",
       [](const fs::path& d) { edit_index_text(d, "\"dp_shard\": 2", "\"dp_shard\": 1.5"); },
       ErrorKind::kInput,
       {"index.json", "mesh.dp_shard", "1.5"}},
      {"mesh tp 4294967298 (wraps to 2 as int32)",
       [](const fs::path& d) { edit_index_text(d, "\"tp\": 2", "\"tp\": 4294967298"); },
       ErrorKind::kInput,
       {"index.json", "mesh.tp", "4294967298"}},
      {"xxh64 with 0x prefix (re-sealed)",
       [&](const fs::path& d) {
         edit_index(d, true, [&](json& j) {
           json& h = j["keys"][qkv]["chunks"][0]["xxh64"];
           h = "0x" + h.get<std::string>().substr(2);
         });
       },
       ErrorKind::kInput,
       {qkv, "chunks[0].xxh64", "16 lowercase hex"}},
      {"xxh64 with a leading space (re-sealed)",
       [&](const fs::path& d) {
         edit_index(d, true, [&](json& j) {
           json& h = j["keys"][qkv]["chunks"][1]["xxh64"];
           // insert, not " " + string&&: GCC 12's -Wrestrict false positive (GCC bug 105329).
           std::string v = h.get<std::string>().substr(1);
           v.insert(v.begin(), ' ');
           h = v;
         });
       },
       ErrorKind::kInput,
       {qkv, "chunks[1].xxh64"}},
      {"xxh64 with trailing junk (re-sealed)",
       [&](const fs::path& d) {
         edit_index(d, true, [&](json& j) {
           json& h = j["keys"][qkv]["chunks"][2]["xxh64"];
           h = h.get<std::string>() + "zz";
         });
       },
       ErrorKind::kInput,
       {qkv, "chunks[2].xxh64"}},
      {"index_xxh64 in upper case",
       [](const fs::path& d) {
         edit_index(d, false, [](json& j) {
           std::string h = j["index_xxh64"];
           for (char& c : h) c = static_cast<char>(std::toupper(c));
           j["index_xxh64"] = h == j["index_xxh64"] ? "ABCDEF0123456789" : h;
         });
       },
       ErrorKind::kInput,
       {"index.json", "index_xxh64"}},
      {"shape overflowing int64 (re-sealed)",
       [&](const fs::path& d) {
         edit_index(d, true, [&](json& j) { j["keys"][qkv]["shape"] = {int64_t{1} << 62, 8}; });
       },
       ErrorKind::kInput,
       {qkv, "index.json", "more elements than an int64"}},
      {"shape of 32 GiB with matching chunks (re-sealed)",
       [&](const fs::path& d) {
         edit_index(d, true, [&](json& j) {
           const int64_t half = int64_t{1} << 32;
           json& k = j["keys"][ln];
           k["shape"] = {2 * half};
           k["chunks"][0]["extent"] = {half};
           k["chunks"][1]["offset"] = {half};
           k["chunks"][1]["extent"] = {half};
         });
       },
       ErrorKind::kInput,
       {"rank_00000.h5", "more than its recorded"}},
      {"chunk offset near INT64_MAX (re-sealed)",
       [&](const fs::path& d) {
         edit_index(d, true,
                    [&](json& j) { j["keys"][ln]["chunks"][1]["offset"] = {INT64_MAX - 1}; });
       },
       ErrorKind::kInput,
       {ln, "rank_00002.h5", "box"}},
      {"placement changed (re-sealed)",
       [&](const fs::path& d) {
         edit_index(d, true, [&](json& j) {
           j["keys"][ln]["placements"][1] = {{"kind", "replicate"}};
         });
       },
       ErrorKind::kInput,
       {ln, "chunks"}},
      {"duplicate field",
       [](const fs::path& d) { edit_index_text(d, "\"step\": 7", "\"step\": 7, \"step\": 7"); },
       ErrorKind::kInput,
       {"index.json", "\"step\" appears twice"}},
      {"unknown field (re-sealed)",
       [](const fs::path& d) { edit_index(d, true, [](json& j) { j["extra"] = 1; }); },
       ErrorKind::kInput,
       {"index.json", "unknown field \"extra\""}},
      {"format_version 1",
       [](const fs::path& d) { edit_index(d, true, [](json& j) { j["format_version"] = 1; }); },
       ErrorKind::kInput,
       {"index.json", "format_version 1"}},
      {"step edited (re-sealed): the directory says step 7",
       [](const fs::path& d) { edit_index(d, true, [](json& j) { j["step"] = 8; }); },
       ErrorKind::kInput,
       {"step_0000007", "says step 8"}},
      {"rank file size edited (re-sealed)",
       [](const fs::path& d) {
         edit_index(d, true, [](json& j) {
           j["files"][2]["bytes"] = j["files"][2]["bytes"].get<int64_t>() + 1;
         });
       },
       ErrorKind::kIntegrity,
       {"rank_00002.h5", "bytes"}},
      {"trailing junk after the JSON",
       [](const fs::path& d) {
         write_text(d / "index.json", read_text(d / "index.json") + "\n}junk");
       },
       ErrorKind::kInput,
       {"index.json", "not valid JSON"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(c.name);
    const fs::path dir = copy(fmt::format("case{}", i));
    c.mutate(dir);
    expect_load_rejects(DeviceMesh(1, 1, 1), dir, c);
    expect_load_rejects(kMesh, dir, c);
    expect_verify_rejects(dir, c);
  }
}

// The chunk hash binds the bytes to the checkpoint, key, dtype and box: changing any of them
// changes it (so a record moved to another key or offset cannot match).
TEST(ChunkHashTest, CoversCheckpointKeyDtypeOffsetAndExtent) {
  const Tensor t = Tensor::from_vector<float>(kernels::Shape{2, 2}, {1, 2, 3, 4});
  mesh::Box box;
  box.offset = {kernels::Elements(0), kernels::Elements(2)};
  box.extent = {kernels::Elements(2), kernels::Elements(2)};
  const uint64_t h = chunk_xxh64(7, "model/a", kernels::DType::kFloat32, box, t);
  EXPECT_EQ(h, chunk_xxh64(7, "model/a", kernels::DType::kFloat32, box, t));
  EXPECT_NE(h, chunk_xxh64(8, "model/a", kernels::DType::kFloat32, box, t));
  EXPECT_NE(h, chunk_xxh64(7, "model/b", kernels::DType::kFloat32, box, t));
  EXPECT_NE(h, chunk_xxh64(7, "model/a", kernels::DType::kInt32, box, t));
  mesh::Box moved = box;
  moved.offset[0] = kernels::Elements(2);
  EXPECT_NE(h, chunk_xxh64(7, "model/a", kernels::DType::kFloat32, moved, t));
  mesh::Box reshaped = box;
  reshaped.extent = {kernels::Elements(1), kernels::Elements(4)};
  EXPECT_NE(h, chunk_xxh64(7, "model/a", kernels::DType::kFloat32, reshaped, t));
}

// parse_checkpoint_index is callable on a string alone (fuzzers): a saved index parses and
// re-serializes to the same checksum; malformed text is kInput, never a crash.
TEST(IndexParseTest, ParsesFromAStringAndRejectsMalformedText) {
  const fs::path root =
      fs::temp_directory_path() / fmt::format("meshproof_ckpt_parse_{}", ::getpid());
  fs::remove_all(root);
  const fs::path dir = save(DeviceMesh(1, 1, 2), root, 3);
  const std::string text = read_text(dir / "index.json");
  const CheckpointIndex index = parse_checkpoint_index(text, "test");
  EXPECT_EQ(compute_index_xxh64(index), index.index_xxh64);
  EXPECT_EQ(index_json_text(index), text);
  for (const std::string& bad :
       std::vector<std::string>{"", "[]", "{}", "{\"format\": \"meshproof-checkpoint\"}", "nul",
                                text.substr(0, text.size() / 2)}) {
    try {
      parse_checkpoint_index(bad, "test");
      ADD_FAILURE() << "accepted: " << bad.substr(0, 40);
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInput) << e.what();
    }
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace meshproof::engine
