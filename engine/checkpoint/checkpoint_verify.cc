// `ckpt verify` (engine/checkpoint/checkpoint.h verify_checkpoint): every integrity problem of a
// checkpoint.
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
using namespace ckpt_detail;  // NOLINT(google-build-using-namespace): the module's helpers

VerifyReport verify_checkpoint(const fs::path& dir) {
  {
    std::lock_guard<std::mutex> lock(hdf5_mutex());
    kernels::silence_hdf5_errors();
  }
  const CheckpointIndex index =
      read_checkpoint_index(dir, {.checksum = false, .file_sizes = false});
  VerifyReport report;
  report.keys = static_cast<int64_t>(index.keys.size());
  const uint64_t h = compute_index_xxh64(index);
  if (h != index.index_xxh64) {
    report.findings.push_back(
        {"", kIndexName,
         fmt::format("index checksum mismatch (xxh64 of the content {}, recorded {}): the index "
                     "was edited or damaged after the save",
                     hash_hex(h), hash_hex(index.index_xxh64))});
  }
  FileCache cache(dir, index.checkpoint_id);
  std::set<std::string> bad_files;
  for (size_t i = 0; i < index.files.size(); ++i) {
    std::optional<std::string> problem = file_size_problem(dir, index, i);
    if (!problem) {
      try {
        std::lock_guard<std::mutex> lock(hdf5_mutex());
        cache.open(index.files[i]);
      } catch (const kernels::Error& e) {
        if (e.kind() != ErrorKind::kIntegrity) throw;
        problem = e.message();
      }
    }
    if (problem) {
      report.findings.push_back({"", index.files[i], *problem});
      bad_files.insert(index.files[i]);
    }
  }
  for (const auto& [name, k] : index.keys) {
    for (const ChunkRecord& c : k.chunks) {
      ++report.chunks;
      if (bad_files.count(c.file)) {
        report.findings.push_back({name, c.file,
                                   fmt::format("chunk {} {} is in the bad rank file {}", c.dataset,
                                               c.box.str(), c.file)});
        continue;
      }
      try {
        read_chunk_cached(cache, index, k, c);
      } catch (const kernels::Error& e) {
        if (e.kind() != ErrorKind::kIntegrity) throw;
        report.findings.push_back({name, c.file, e.message()});
      }
    }
  }
  return report;
}

}  // namespace meshproof::engine
