// libFuzzer target for checkpoint index.json and rank files (docs/design.md section 17).
//
// LLVMFuzzerInitialize saves a real checkpoint (the synthetic state of the checkpoint tests on a
// dp_shard=2 x tp=2 mesh, four rank files) under a fresh temporary folder, then copies its files
// into a work checkpoint `work/step_0000001/`, with one more copy of rank_00000.h5 at `work/x`
// (so an index naming `../x` reaches a real file). Each input is one of:
//   * anything not starting with "RANKFILE": the bytes become work/step_0000001/index.json;
//   * "RANKFILE" + u32 length + (u32 offset, u8 xor)...: the real index with rank_00000.h5
//     truncated to length % (size + 1) bytes and the given bytes XOR-ed (offset % size),
//     i.e. a torn or bit-rotted rank file.
// Then, as `meshproof ckpt verify` and a resume do: read_checkpoint_index without and with the
// file-size check, read_chunk with checksum verification for every chunk, and load_checkpoint
// into a one-rank state (resharding every key). Each stage may reject the input with
// kernels::Error (the project's error type); anything else is a finding. An index that
// read_checkpoint_index accepts must also say what the JSON says (the oracle below): plain file
// names inside the checkpoint, integer mesh sizes equal to the JSON's, checksums written as 1 to 16
// hex digits that round-trip, chunk boxes inside the key's shape.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "engine/checkpoint/checkpoint.h"
#include "kernels/core/error.h"
#include "mesh/core/device_mesh.h"
#include "mesh/local/local_comm.h"
#include "tests/engine/checkpoint/ckpt_test_state.h"

namespace fs = std::filesystem;
using meshproof::kernels::Error;

namespace {

constexpr std::string_view kRankFileMagic = "RANKFILE";

struct Fixture {
  fs::path root;      // the temporary folder, removed at exit
  fs::path work;      // root/work/step_0000001: the checkpoint each input is written into
  std::string index;  // the real index.json
  std::string rank0;  // the real rank_00000.h5
};

Fixture* fixture = nullptr;

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& p, std::string_view bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "checkpoint_index_fuzz: cannot write %s\n", p.c_str());
    std::abort();
  }
}

void remove_root() {
  if (fixture != nullptr) {
    std::error_code ec;
    fs::remove_all(fixture->root, ec);
  }
}

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "checkpoint_index_fuzz: accepted index disagrees with its JSON: %s\n",
               what.c_str());
  std::abort();
}

bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find_first_of("/\\") == std::string::npos && name.find('\0') == std::string::npos;
}

// The oracle: called only when read_checkpoint_index accepted `text`.
void check_accepted(const meshproof::engine::CheckpointIndex& index, std::string_view text) {
  using meshproof::mesh::MeshDim;
  const nlohmann::json j = nlohmann::json::parse(text);
  for (const std::string& f : index.files) {
    if (!plain_file_name(f)) finding("rank file name '" + f + "' is not a plain file name");
  }
  const nlohmann::json& m = j.at("mesh");
  for (const auto& [name, dim] :
       {std::pair{"dp_replicate", MeshDim::kDpReplicate}, std::pair{"dp_shard", MeshDim::kDpShard},
        std::pair{"tp", MeshDim::kTp}}) {
    const nlohmann::json& v = m.at(name);
    if (!v.is_number_integer() || v.get<int64_t>() != index.mesh.size(dim)) {
      finding(std::string("mesh.") + name + " is " + v.dump() + " in the JSON, " +
              std::to_string(index.mesh.size(dim)) + " in the index");
    }
  }
  for (const auto& [key, k] : index.keys) {
    const nlohmann::json& chunks = j.at("keys").at(key).at("chunks");
    for (size_t c = 0; c < k.chunks.size(); ++c) {
      const meshproof::engine::ChunkRecord& rec = k.chunks[c];
      if (!plain_file_name(rec.file)) {
        finding("key '" + key + "' chunk file '" + rec.file + "' is not a plain file name");
      }
      const std::string hex = chunks.at(c).at("xxh64").get<std::string>();
      const bool all_hex = !hex.empty() && hex.size() <= 16 &&
                           std::all_of(hex.begin(), hex.end(),
                                       [](unsigned char ch) { return std::isxdigit(ch) != 0; });
      if (!all_hex || std::stoull(hex, nullptr, 16) != rec.xxh64) {
        finding("key '" + key + "' checksum '" + hex + "' is not 1 to 16 hex digits");
      }
      if (rec.box.rank() != k.shape.rank() ||
          rec.box.extent.size() != static_cast<size_t>(k.shape.rank())) {
        finding("key '" + key + "' chunk rank differs from the shape's");
      }
      for (size_t d = 0; d < rec.box.offset.size(); ++d) {
        const int64_t off = rec.box.offset[d].value;
        const int64_t ext = rec.box.extent[d].value;
        const int64_t dim = k.shape.dims()[d];
        if (off < 0 || ext < 0 || off > dim || ext > dim - off) {
          finding("key '" + key + "' chunk box lies outside the shape");
        }
      }
    }
  }
}

void verify_and_load(const fs::path& dir, std::string_view index_text, bool oracle) {
  namespace engine = meshproof::engine;
  const engine::CheckpointIndex unchecked =
      engine::read_checkpoint_index(dir, {.checksum = false, .file_sizes = false});
  if (oracle) check_accepted(unchecked, index_text);
  // The fuzzer cannot forge index_xxh64, so an accepted edit is re-signed (as a tool that edits
  // an index and recomputes its checksum would): the rank-file, attribute and chunk-hash checks
  // below then see edited indexes with a valid checksum, the silent-wrong-load class.
  if (oracle) {
    std::ofstream(dir / "index.json", std::ios::binary | std::ios::trunc)
        << engine::index_json_text(unchecked);
  }
  const engine::CheckpointIndex index = engine::read_checkpoint_index(dir);
  for (const auto& [name, k] : index.keys) {
    for (const engine::ChunkRecord& c : k.chunks) engine::read_chunk(dir, index, k, c);
  }
  const meshproof::mesh::DeviceMesh one(1, 1, 1);
  meshproof::mesh::LocalWorld world(one);
  world.run([&](meshproof::mesh::RankComms& comms) {
    engine::ShardedState state = engine::testing::make_state(one, comms.rank(), /*seed=*/7);
    engine::load_checkpoint(dir, state, comms);
  });
}

uint32_t read_u32(std::string_view& s) {
  uint32_t v = 0;
  const size_t n = std::min<size_t>(4, s.size());
  std::memcpy(&v, s.data(), n);
  s.remove_prefix(n);
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  namespace engine = meshproof::engine;
  fixture = new Fixture;
  std::string templ = (fs::temp_directory_path() / "meshproof-ckpt-fuzz-XXXXXX").string();
  if (mkdtemp(templ.data()) == nullptr) {
    std::perror("checkpoint_index_fuzz: mkdtemp");
    std::abort();
  }
  fixture->root = templ;
  std::atexit(remove_root);
  const meshproof::mesh::DeviceMesh m(1, 2, 2);
  fs::path saved;
  meshproof::mesh::LocalWorld world(m);
  world.run([&](meshproof::mesh::RankComms& comms) {
    engine::ShardedState s = engine::testing::make_state(m, comms.rank(), /*seed=*/1);
    const fs::path d = engine::save_checkpoint(fixture->root / "saved", 1, s, comms);
    if (comms.rank() == 0) saved = d;
  });
  fixture->work = fixture->root / "work" / saved.filename();
  fs::create_directories(fixture->work);
  for (const fs::directory_entry& e : fs::directory_iterator(saved)) {
    fs::copy_file(e.path(), fixture->work / e.path().filename());
  }
  fs::copy_file(saved / "rank_00000.h5", fixture->root / "work" / "x");
  fixture->index = read_bytes(saved / "index.json");
  fixture->rank0 = read_bytes(saved / "rank_00000.h5");
  // MESHPROOF_FUZZ_SEED_OUT=FILE writes the real index.json there (how the committed seed
  // tests/fuzz/corpus/checkpoint_index/index.json was made).
  if (const char* out = std::getenv("MESHPROOF_FUZZ_SEED_OUT")) write_bytes(out, fixture->index);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  const fs::path& dir = fixture->work;
  const bool rank_file_mode = input.substr(0, kRankFileMagic.size()) == kRankFileMagic;
  std::string_view index_text = input;
  if (rank_file_mode) {
    input.remove_prefix(kRankFileMagic.size());
    std::string rank0 = fixture->rank0;
    const size_t length = read_u32(input) % (rank0.size() + 1);
    while (input.size() >= 5) {
      const size_t at = read_u32(input) % rank0.size();
      rank0[at] = static_cast<char>(rank0[at] ^ input[0]);
      input.remove_prefix(1);
    }
    rank0.resize(length);
    write_bytes(dir / "rank_00000.h5", rank0);
    index_text = fixture->index;
  }
  write_bytes(dir / "index.json", index_text);
  try {
    verify_and_load(dir, index_text, /*oracle=*/!rank_file_mode);
  } catch (const Error&) {
    // The project's error type: a clean rejection of a bad checkpoint.
  }
  if (rank_file_mode) write_bytes(dir / "rank_00000.h5", fixture->rank0);
  return 0;
}
