// The checkpoint index (engine/checkpoint/checkpoint.h "The index"): index.json's strict JSON,
// parse, canonical text and checksum, and reading it from a checkpoint directory.
#include <H5Cpp.h>
#include <fcntl.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/checkpoint_files.h"
#include "engine/faults/fault_hooks.h"
#include "kernels/core/build_info.h"
#include "kernels/core/error.h"
#include "kernels/core/formats.h"
#include "kernels/core/hdf5_check.h"
#include "kernels/core/runtime.h"

namespace meshproof::engine {
namespace ckpt_detail {

json read_json_file(const fs::path& p, std::string_view what) {
  return parse_json_text(read_text_file(p, what), p.string());
}

// ---- Strict JSON (index.json): duplicate fields, exact field sets, typed values. ----

// json::parse keeps the last of duplicate object fields silently; this rejects them.
json parse_json_text(std::string_view text, std::string_view where) {
  std::vector<std::set<std::string>> seen;  // one per open object (arrays push an empty marker)
  std::string duplicate;
  auto cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        seen.emplace_back();
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!seen.empty()) seen.pop_back();
        break;
      case json::parse_event_t::key:
        if (!seen.empty() && !seen.back().insert(parsed.get<std::string>()).second &&
            duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    MP_FAIL_INPUT("{} is not valid JSON: {}", where, e.what());
  }
  MP_CHECK_INPUT(duplicate.empty(), "{}: field \"{}\" appears twice in one object", where,
                 duplicate);
  return j;
}

// A short rendering of a JSON value for messages.
std::string shown(const json& j) {
  std::string s = j.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// `j` must be an object with exactly the fields `names`.
void expect_fields(const json& j, std::string_view where, std::string_view what,
                   std::initializer_list<std::string_view> names) {
  MP_CHECK_INPUT(j.is_object(), "{}: {} must be a JSON object, got {}", where, what, shown(j));
  for (std::string_view n : names) {
    MP_CHECK_INPUT(j.contains(std::string(n)), "{}: {} has no field \"{}\"", where, what, n);
  }
  for (const auto& [name, v] : j.items()) {
    MP_CHECK_INPUT(std::find(names.begin(), names.end(), name) != names.end(),
                   "{}: {} has an unknown field \"{}\"", where, what, name);
  }
}

// A JSON integer (never a float, never wrapped) in [lo, hi].
int64_t get_int(const json& j, std::string_view where, std::string_view what, int64_t lo,
                int64_t hi) {
  bool ok = false;
  int64_t v = 0;
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    ok = u <= static_cast<uint64_t>(INT64_MAX);
    v = static_cast<int64_t>(u);
  } else if (j.is_number_integer()) {
    v = j.get<int64_t>();
    ok = true;
  }
  MP_CHECK_INPUT(ok && lo <= v && v <= hi, "{}: {} must be an integer in [{}, {}], got {}", where,
                 what, lo, hi, shown(j));
  return v;
}

// Printable ASCII of at most `max_len` characters.
std::string get_string(const json& j, std::string_view where, std::string_view what,
                       size_t max_len = 256) {
  MP_CHECK_INPUT(j.is_string(), "{}: {} must be a string, got {}", where, what, shown(j));
  const std::string s = j.get<std::string>();
  const bool printable =
      std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
  MP_CHECK_INPUT(s.size() <= max_len && printable,
                 "{}: {} must be printable ASCII of at most {} characters, got {}", where, what,
                 max_len, shown(j));
  return s;
}

// Exactly 16 lowercase hex digits (as hash_hex writes them): no "0x", spaces, signs or junk.
uint64_t get_hash(const json& j, std::string_view where, std::string_view what) {
  const bool ok =
      j.is_string() && j.get<std::string>().size() == 16 &&
      std::all_of(j.get_ref<const std::string&>().begin(), j.get_ref<const std::string&>().end(),
                  [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
  MP_CHECK_INPUT(ok, "{}: {} must be 16 lowercase hex digits, got {}", where, what, shown(j));
  return std::stoull(j.get<std::string>(), nullptr, 16);
}

std::vector<int64_t> get_int_array(const json& j, std::string_view where, std::string_view what,
                                   size_t size, int64_t lo, int64_t hi) {
  MP_CHECK_INPUT(j.is_array() && j.size() == size, "{}: {} must be an array of {} integers, got {}",
                 where, what, size, shown(j));
  std::vector<int64_t> out;
  for (size_t i = 0; i < j.size(); ++i) {
    out.push_back(get_int(j[i], where, fmt::format("{}[{}]", what, i), lo, hi));
  }
  return out;
}

// A key is also an HDF5 dataset path, "/" + key.
bool valid_key(std::string_view k) {
  if (k.empty() || k.size() > 1024) return false;
  size_t start = 0;
  while (start <= k.size()) {
    size_t slash = k.find('/', start);
    if (slash == std::string_view::npos) slash = k.size();
    const std::string_view part = k.substr(start, slash - start);
    if (part.empty() || part == "." || part == "..") return false;
    for (char c : part) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-' &&
          c != '+') {
        return false;
      }
    }
    start = slash + 1;
  }
  return true;
}

// A plain file name: no directory part, not "." or "..", no control characters.
bool plain_file_name(std::string_view n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string_view::npos &&
         n.find('\\') == std::string_view::npos &&
         std::all_of(n.begin(), n.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

constexpr size_t kMaxTensorRank = 16;

json placement_json(const mesh::Placement& p) {
  switch (p.kind) {
    case mesh::Placement::Kind::kReplicate:
      return json{{"kind", "replicate"}};
    case mesh::Placement::Kind::kShard:
      return json{{"kind", "shard"}, {"dim", p.dim}};
    case mesh::Placement::Kind::kStridedShard:
      return json{{"kind", "strided_shard"}, {"dim", p.dim}, {"split_factor", p.split_factor}};
  }
  return {};
}

mesh::Placement placement_from_json(const json& j, std::string_view where, const std::string& what,
                                    int tensor_rank) {
  MP_CHECK_INPUT(j.is_object() && j.contains("kind"), "{}: {} must be an object with a \"kind\"",
                 where, what);
  const std::string kind = get_string(j.at("kind"), where, what + ".kind");
  const int64_t max_dim = std::max(tensor_rank - 1, 0);
  if (kind == "replicate") {
    expect_fields(j, where, what, {"kind"});
    return mesh::Placement::replicate();
  }
  if (kind == "shard") {
    expect_fields(j, where, what, {"kind", "dim"});
    return mesh::Placement::shard(
        static_cast<int>(get_int(j.at("dim"), where, what + ".dim", 0, max_dim)));
  }
  if (kind == "strided_shard") {
    expect_fields(j, where, what, {"kind", "dim", "split_factor"});
    return mesh::Placement::strided_shard(
        static_cast<int>(get_int(j.at("dim"), where, what + ".dim", 0, max_dim)),
        static_cast<int>(
            get_int(j.at("split_factor"), where, what + ".split_factor", 1, kMaxWorld)));
  }
  MP_FAIL_INPUT("{}: {} has unknown kind '{}' (replicate, shard, strided_shard)", where, what,
                kind);
}

std::vector<int64_t> elems(const std::vector<Elements>& v) {
  std::vector<int64_t> out;
  for (const Elements& e : v) out.push_back(e.value);
  return out;
}

std::vector<Elements> to_elems(const std::vector<int64_t>& v) {
  std::vector<Elements> out;
  for (int64_t e : v) out.emplace_back(e);
  return out;
}

json index_to_json(const CheckpointIndex& index, bool with_checksum) {
  json j;
  j["format"] = "meshproof-checkpoint";
  j["format_version"] = index.format_version;
  j["checkpoint_id"] = hash_hex(index.checkpoint_id);
  j["meshproof_version"] = index.meshproof_version;
  j["git_commit"] = index.git_commit;
  j["step"] = index.step;
  j["scenario_hash"] = index.scenario_hash;
  // The model the state belongs to (field -> value; empty when the saver recorded none).
  j["model"] = json::object();
  for (const auto& [field, value] : index.model) j["model"][field] = value;
  j["mesh"] = {{"dp_replicate", index.mesh.size(mesh::MeshDim::kDpReplicate)},
               {"dp_shard", index.mesh.size(mesh::MeshDim::kDpShard)},
               {"tp", index.mesh.size(mesh::MeshDim::kTp)}};
  // Pipeline stages only when there are several (docs/design.md section 33), so the index of a
  // mesh without stages is what it always was.
  const int pp = index.mesh.size(mesh::MeshDim::kPp);
  if (pp > 1) j["mesh"]["pp"] = pp;
  json files = json::array();
  for (size_t i = 0; i < index.files.size(); ++i) {
    files.push_back({{"name", index.files[i]}, {"bytes", index.file_bytes[i]}});
  }
  j["files"] = files;
  j["scalars"] = index.scalars;
  json keys = json::object();
  for (const auto& [name, k] : index.keys) {
    json placements = json::array();
    for (const auto& p : k.placements) placements.push_back(placement_json(p));
    json chunks = json::array();
    for (const ChunkRecord& c : k.chunks) {
      chunks.push_back({{"file", c.file},
                        {"dataset", c.dataset},
                        {"offset", elems(c.box.offset)},
                        {"extent", elems(c.box.extent)},
                        {"xxh64", hash_hex(c.xxh64)}});
    }
    keys[name] = {{"shape", k.shape.dims()},
                  {"dtype", std::string(kernels::dtype_name(k.dtype))},
                  {"placements", placements},
                  {"chunks", chunks}};
  }
  j["keys"] = keys;
  if (with_checksum) j["index_xxh64"] = hash_hex(compute_index_xxh64(index));
  return j;
}

}  // namespace ckpt_detail

using namespace ckpt_detail;  // NOLINT(google-build-using-namespace): the module's helpers

std::string canonical_index_text(const CheckpointIndex& index) {
  return index_to_json(index, /*with_checksum=*/false).dump();
}

uint64_t compute_index_xxh64(const CheckpointIndex& index) {
  const std::string text = canonical_index_text(index);
  return XXH64(text.data(), text.size(), 0);
}

std::string index_json_text(const CheckpointIndex& index) {
  return index_to_json(index, /*with_checksum=*/true).dump(1) + "\n";
}

CheckpointIndex parse_checkpoint_index(std::string_view text, std::string_view where) {
  const json j = parse_json_text(text, where);
  MP_CHECK_INPUT(j.is_object(), "{}: a checkpoint index is a JSON object", where);
  MP_CHECK_INPUT(j.contains("format") && j.at("format") == "meshproof-checkpoint",
                 "{}: not a meshproof checkpoint index (no \"format\": \"meshproof-checkpoint\")",
                 where);
  MP_CHECK_INPUT(j.contains("format_version"), "{}: no format_version", where);
  CheckpointIndex index;
  index.format_version =
      static_cast<int>(get_int(j.at("format_version"), where, "format_version", 0, INT32_MAX));
  MP_CHECK_INPUT(index.format_version != 1,
                 "{}: format_version 1 was written by a meshproof without checkpoint integrity "
                 "records (no index checksum; chunk hashes that do not cover key and offset) and "
                 "is not read by this build (format_version {}): save the checkpoint again",
                 where, kCheckpointFormatVersion);
  MP_CHECK_INPUT(index.format_version == kCheckpointFormatVersion,
                 "{}: format_version {} (this build reads {})", where, index.format_version,
                 kCheckpointFormatVersion);
  expect_fields(
      j, where, "the index",
      {"format", "format_version", "checkpoint_id", "meshproof_version", "git_commit", "step",
       "scenario_hash", "model", "mesh", "files", "scalars", "keys", "index_xxh64"});
  index.checkpoint_id = get_hash(j.at("checkpoint_id"), where, "checkpoint_id");
  index.index_xxh64 = get_hash(j.at("index_xxh64"), where, "index_xxh64");
  index.step = get_int(j.at("step"), where, "step", 0, INT64_MAX);
  index.scenario_hash = get_string(j.at("scenario_hash"), where, "scenario_hash");
  const json& model = j.at("model");
  MP_CHECK_INPUT(model.is_object(), "{}: model must be a JSON object (field -> value), got {}",
                 where, shown(model));
  for (const auto& [field, value] : model.items()) {
    index.model[field] = get_string(value, where, "model." + field);
  }
  index.meshproof_version = get_string(j.at("meshproof_version"), where, "meshproof_version");
  index.git_commit = get_string(j.at("git_commit"), where, "git_commit");

  const json& m = j.at("mesh");
  // `pp` is written only for a mesh with several pipeline stages (one form per mesh).
  const bool has_pp = m.is_object() && m.contains("pp");
  if (has_pp) {
    expect_fields(m, where, "mesh", {"pp", "dp_replicate", "dp_shard", "tp"});
  } else {
    expect_fields(m, where, "mesh", {"dp_replicate", "dp_shard", "tp"});
  }
  const int64_t pp = has_pp ? get_int(m.at("pp"), where, "mesh.pp", 2, kMaxWorld) : 1;
  const int64_t dr = get_int(m.at("dp_replicate"), where, "mesh.dp_replicate", 1, kMaxWorld);
  const int64_t ds = get_int(m.at("dp_shard"), where, "mesh.dp_shard", 1, kMaxWorld);
  const int64_t tp = get_int(m.at("tp"), where, "mesh.tp", 1, kMaxWorld);
  MP_CHECK_INPUT(dr * ds * tp <= kMaxWorld && pp * dr * ds * tp <= kMaxWorld,
                 "{}: mesh {}x{}x{}x{} (pp x dp_replicate x dp_shard x tp) has more than {} ranks",
                 where, pp, dr, ds, tp, kMaxWorld);
  index.mesh = mesh::DeviceMesh(static_cast<int>(dr), static_cast<int>(ds), static_cast<int>(tp),
                                static_cast<int>(pp));
  const int world = index.mesh.world_size();
  const int stage_size = index.mesh.stage_size();

  const json& files = j.at("files");
  MP_CHECK_INPUT(files.is_array() && static_cast<int64_t>(files.size()) == world,
                 "{}: files must list one rank file per rank of the {}-rank mesh", where, world);
  for (int r = 0; r < world; ++r) {
    const json& f = files[static_cast<size_t>(r)];
    const std::string what = fmt::format("files[{}]", r);
    expect_fields(f, where, what, {"name", "bytes"});
    const std::string name = get_string(f.at("name"), where, what + ".name");
    MP_CHECK_INPUT(plain_file_name(name),
                   "{}: {} '{}' is not a plain file name inside the checkpoint directory", where,
                   what, name);
    MP_CHECK_INPUT(name == rank_file_name(r), "{}: {} is '{}', rank {}'s file is '{}'", where, what,
                   name, r, rank_file_name(r));
    index.files.push_back(name);
    index.file_bytes.push_back(get_int(f.at("bytes"), where, what + ".bytes", 0, INT64_MAX));
  }

  const json& scalars = j.at("scalars");
  MP_CHECK_INPUT(scalars.is_object(), "{}: scalars must be an object", where);
  for (const auto& [name, v] : scalars.items()) {
    MP_CHECK_INPUT(valid_key(name), "{}: scalar name '{}' is not a checkpoint key", where, name);
    // Scalars are counters and positions (optimizer and LR steps, the data cursor, RNG offsets).
    index.scalars[name] = get_int(v, where, fmt::format("scalar '{}'", name), 0, INT64_MAX);
  }

  const json& keys = j.at("keys");
  MP_CHECK_INPUT(keys.is_object(), "{}: keys must be an object", where);
  std::vector<int64_t> bytes_in_file(static_cast<size_t>(world), 0);
  for (const auto& [name, kj] : keys.items()) {
    MP_CHECK_INPUT(valid_key(name),
                   "{}: key '{}' is not a checkpoint key (path components of [A-Za-z0-9._+-] "
                   "separated by '/', none '.' or '..')",
                   where, name);
    const std::string what = fmt::format("key '{}'", name);
    expect_fields(kj, where, what, {"shape", "dtype", "placements", "chunks"});
    KeyRecord k;
    k.key = name;
    const json& sj = kj.at("shape");
    MP_CHECK_INPUT(sj.is_array() && sj.size() <= kMaxTensorRank,
                   "{}: {} shape must be an array of at most {} integers", where, what,
                   kMaxTensorRank);
    k.shape = Shape(get_int_array(sj, where, what + " shape", sj.size(), 0, INT64_MAX));
    k.dtype = kernels::parse_dtype(get_string(kj.at("dtype"), where, what + " dtype"),
                                   fmt::format("{} {} dtype", where, what));
    const int64_t esize = element_bytes(k.dtype, name);
    int64_t numel = 1;
    int64_t nbytes = 0;
    for (int64_t d : k.shape.dims()) {
      MP_CHECK_INPUT(!__builtin_mul_overflow(numel, d, &numel),
                     "{}: {} shape {} has more elements than an int64 counts", where, what,
                     k.shape.str());
    }
    MP_CHECK_INPUT(!__builtin_mul_overflow(numel, esize, &nbytes),
                   "{}: {} shape {} has more bytes than an int64 counts", where, what,
                   k.shape.str());
    const json& pj = kj.at("placements");
    MP_CHECK_INPUT(pj.is_array() && static_cast<int>(pj.size()) == mesh::kNumMeshDims,
                   "{}: {} placements must list one placement per mesh dim ({})", where, what,
                   mesh::kNumMeshDims);
    for (size_t i = 0; i < pj.size(); ++i) {
      k.placements.push_back(placement_from_json(
          pj[i], where, fmt::format("{} placements[{}]", what, i), k.shape.rank()));
    }
    std::optional<mesh::Layout> layout;
    try {
      layout.emplace(index.mesh, k.shape, k.placements);
    } catch (const kernels::Error& e) {
      if (e.kind() != ErrorKind::kInput) throw;
      MP_FAIL_INPUT("{}: {}: {}", where, what, e.message());
    }
    // The chunks are exactly the layout's: each distinct box once, in its owner's rank file.
    const std::vector<mesh::Chunk>& expected = layout->chunks();
    const json& cj = kj.at("chunks");
    MP_CHECK_INPUT(cj.is_array() && cj.size() == expected.size(),
                   "{}: {} must have {} chunks (its layout {}), got {}", where, what,
                   expected.size(), layout->str(), cj.is_array() ? shown(cj.size()) : shown(cj));
    // With pipeline stages a key is held by the ranks of one stage, which write its chunks: the
    // layout's owners (ranks of stage 0: layouts place tensors over the stage dims only) moved
    // to the key's stage, the same stage for every chunk. The first chunk's file names it.
    int stage = 0;
    if (index.mesh.size(mesh::MeshDim::kPp) > 1 && !cj.empty() && cj[0].is_object() &&
        cj[0].contains("file") && cj[0].at("file").is_string()) {
      const std::string first = cj[0].at("file").get<std::string>();
      for (int s = 0; s < index.mesh.size(mesh::MeshDim::kPp); ++s)
        if (first == rank_file_name(expected[0].owner + s * stage_size)) stage = s;
    }
    for (size_t i = 0; i < cj.size(); ++i) {
      const json& c = cj[i];
      const std::string cw = fmt::format("{} chunks[{}]", what, i);
      expect_fields(c, where, cw, {"file", "dataset", "offset", "extent", "xxh64"});
      ChunkRecord rec;
      rec.file = get_string(c.at("file"), where, cw + ".file", 4096);
      MP_CHECK_INPUT(plain_file_name(rec.file),
                     "{}: {} file '{}' is not a plain file name inside the checkpoint directory",
                     where, cw, rec.file);
      const int owner = expected[i].owner + stage * stage_size;
      MP_CHECK_INPUT(
          rec.file == rank_file_name(owner),
          "{}: {} is in file '{}'; its writer{}, rank {}, writes '{}'", where, cw, rec.file,
          index.mesh.size(mesh::MeshDim::kPp) > 1
              ? fmt::format(" in pipeline stage {} (the stage of the key's first chunk)", stage)
              : std::string(),
          owner, rank_file_name(owner));
      rec.dataset = get_string(c.at("dataset"), where, cw + ".dataset", 2048);
      MP_CHECK_INPUT(rec.dataset == "/" + name, "{}: {} (file {}) has dataset '{}', expected '/{}'",
                     where, cw, rec.file, rec.dataset, name);
      const size_t rank = static_cast<size_t>(k.shape.rank());
      rec.box.offset =
          to_elems(get_int_array(c.at("offset"), where, cw + ".offset", rank, 0, INT64_MAX));
      rec.box.extent =
          to_elems(get_int_array(c.at("extent"), where, cw + ".extent", rank, 0, INT64_MAX));
      MP_CHECK_INPUT(rec.box == expected[i].box,
                     "{}: {} (file {}) has box {}, the layout {} gives {}", where, cw, rec.file,
                     rec.box.str(), layout->str(), expected[i].box.str());
      rec.xxh64 = get_hash(c.at("xxh64"), where, cw + ".xxh64");
      int64_t& in_file = bytes_in_file[static_cast<size_t>(owner)];
      MP_CHECK_INPUT(!__builtin_add_overflow(in_file, rec.box.numel().value * esize, &in_file),
                     "{}: chunk bytes of {} overflow int64", where, rec.file);
      k.chunks.push_back(std::move(rec));
    }
    index.keys.emplace(name, std::move(k));
  }
  // Chunks are stored contiguously and uncompressed: a file holds at least its chunks' bytes.
  // This bounds every allocation a reader makes by the recorded (and, when checked, actual) sizes.
  for (int r = 0; r < world; ++r) {
    const auto i = static_cast<size_t>(r);
    MP_CHECK_INPUT(bytes_in_file[i] <= index.file_bytes[i],
                   "{}: the chunks in {} hold {} bytes, more than its recorded {} bytes", where,
                   index.files[i], bytes_in_file[i], index.file_bytes[i]);
  }
  return index;
}

CheckpointIndex read_checkpoint_index(const fs::path& dir, IndexChecks checks) {
  MP_CHECK_INPUT(!ends_with(dir.filename().string(), kPartialSuffix),
                 "checkpoint {} is an incomplete (.partial) save and cannot be loaded",
                 dir.string());
  MP_CHECK_INPUT(fs::is_directory(dir), "checkpoint directory {} does not exist", dir.string());
  const fs::path index_path = dir / kIndexName;
  MP_CHECK_INPUT(fs::exists(index_path),
                 "checkpoint {} has no {} (an incomplete save, or not a checkpoint)", dir.string(),
                 kIndexName);
  CheckpointIndex index =
      parse_checkpoint_index(read_text_file(index_path, "checkpoint index"), index_path.string());
  // A directory named step_N holds step N (listing and keep-last-N go by the name).
  static const std::regex re("step_([0-9]{7,18})");
  std::smatch m;
  const std::string name = dir.filename().string();
  if (std::regex_match(name, m, re)) {
    MP_CHECK_INPUT(std::stoll(m[1].str()) == index.step,
                   "checkpoint {}: the directory name says step {}, {} says step {}", dir.string(),
                   m[1].str(), index_path.string(), index.step);
  }
  if (checks.checksum) {
    const uint64_t h = compute_index_xxh64(index);
    MP_CHECK_INTEGRITY(h == index.index_xxh64,
                       "{}: index checksum mismatch (xxh64 of the content {}, recorded {}): the "
                       "index was edited or damaged after the save",
                       index_path.string(), hash_hex(h), hash_hex(index.index_xxh64));
  }
  if (checks.file_sizes) {
    for (size_t i = 0; i < index.files.size(); ++i) {
      const std::optional<std::string> problem = file_size_problem(dir, index, i);
      MP_CHECK_INTEGRITY(!problem, "checkpoint {}: {}", dir.string(), problem.value_or(""));
    }
  }
  return index;
}

}  // namespace meshproof::engine
