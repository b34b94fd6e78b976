// `meshproof ckpt` on PyTorch DCP folders (docs/design.md section 40), and the CheckpointView of
// either format that `ckpt diff` compares.
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include <map>
#include <set>

#include "engine/checkpoint/checkpoint.h"
#include "engine/dcp/dcp_checkpoint.h"
#include "harness/verbs/ckpt_verb.h"
#include "harness/verbs/exit_codes.h"
#include "kernels/core/error.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;

std::string sizes_str(const std::vector<int64_t>& v) {
  return fmt::format("[{}]", fmt::join(v, ", "));
}

int64_t entry_bytes(const engine::DcpEntry& e) {
  int64_t n = 0;
  for (const engine::DcpChunk& c : e.chunks) n += c.item ? c.item->length : 0;
  return n;
}

}  // namespace

int dcp_inspect(const std::string& dir, std::ostream& out, const InspectOptions& options) {
  const engine::DcpMetadata meta = engine::read_dcp_metadata(dir);
  std::vector<const engine::DcpEntry*> keys;
  for (const auto& [name, e] : meta.entries) {
    if (matches_any(options.key_globs, name)) keys.push_back(&e);
  }
  MP_CHECK_INPUT(!keys.empty() || options.key_globs.empty(),
                 "ckpt inspect {}: no key matches --key {}", dir,
                 fmt::join(options.key_globs, " --key "));
  // Per file: the items it holds and their bytes, and the size it has on disk.
  std::map<std::string, std::pair<int64_t, int64_t>> files;
  for (const auto& [name, e] : meta.entries) {
    for (const engine::DcpChunk& c : e.chunks) {
      if (!c.item) continue;
      auto& f = files[c.item->file];
      ++f.first;
      f.second += c.item->length;
    }
  }
  fmt::print(out, "checkpoint {}\n  PyTorch distributed checkpoint (DCP){}: {} keys, {} files\n",
             dir, meta.version.empty() ? "" : fmt::format(" metadata version {}", meta.version),
             meta.entries.size(), files.size());
  if (options.summary) {
    struct Group {
      int64_t keys = 0, chunks = 0, elements = 0, bytes = 0;
      std::set<std::string> dtypes;
    };
    std::map<std::string, Group> groups;
    for (const engine::DcpEntry* e : keys) {
      Group& g = groups[e->key.substr(0, e->key.find('.'))];
      ++g.keys;
      g.chunks += static_cast<int64_t>(e->chunks.size());
      int64_t n = 1;
      for (int64_t s : e->shape) n *= s;
      g.elements += e->bytes ? 0 : n;
      g.bytes += entry_bytes(*e);
      g.dtypes.insert(e->bytes ? "bytes" : e->dtype_name);
    }
    fmt::print(out, "  key groups ({} keys):\n", keys.size());
    for (const auto& [name, g] : groups) {
      fmt::print(out, "    {}.  {} keys  {} chunks  {} elements  {} item bytes  {}\n", name, g.keys,
                 g.chunks, g.elements, g.bytes, fmt::join(g.dtypes, ","));
    }
    return kExitOk;
  }
  fmt::print(out, "  files ({}):\n", files.size());
  for (const auto& [name, f] : files) {
    std::error_code ec;
    const auto size = fs::file_size(fs::path(dir) / name, ec);
    fmt::print(out, "    {}  {} items  {} item bytes  {}\n", name, f.first, f.second,
               ec ? std::string("MISSING") : fmt::format("{} bytes on disk", size));
  }
  fmt::print(out, "  keys ({}):\n", keys.size());
  for (const engine::DcpEntry* e : keys) {
    if (e->bytes) {
      const auto& item = e->chunks[0].item;
      fmt::print(out, "    {}  bytes  {}\n", e->key,
                 item ? fmt::format("{}@{} +{}", item->file, item->offset, item->length)
                      : std::string("no storage item"));
      continue;
    }
    fmt::print(out, "    {}  {} {}  {}  {} chunk(s)\n", e->key, e->dtype_name, sizes_str(e->shape),
               engine::describe_dcp_placement(*e), e->chunks.size());
    for (const engine::DcpChunk& c : e->chunks) {
      fmt::print(out, "      {}  offsets {} sizes {}\n",
                 c.item ? fmt::format("{}@{} +{}", c.item->file, c.item->offset, c.item->length)
                        : std::string("(no storage item)"),
                 sizes_str(c.offsets), sizes_str(c.sizes));
    }
  }
  return kExitOk;
}

int dcp_verify(const std::string& dir, std::ostream& out) {
  return print_verify_report(engine::verify_dcp_checkpoint(dir), dir, out, "DCP metadata",
                             "tiling, items, files, dtypes and sizes of every tensor item");
}

CheckpointView open_checkpoint_view(const std::string& dir) {
  CheckpointView v;
  if (engine::is_dcp_checkpoint(dir)) {
    auto meta = std::make_shared<engine::DcpMetadata>(engine::read_dcp_metadata(dir));
    std::set<std::string> files;
    for (const auto& [name, e] : meta->entries) {
      for (const engine::DcpChunk& c : e.chunks) {
        if (c.item) files.insert(c.item->file);
      }
      CheckpointView::Key k;
      const engine::DcpEntry* entry = &e;
      if (e.bytes) {
        k.dtype = "bytes";
        k.bytes = [meta, entry, dir] {
          const auto& item = entry->chunks[0].item;
          MP_CHECK_INTEGRITY(item.has_value(), "key '{}' has no storage item", entry->key);
          const std::vector<uint8_t> b = engine::read_dcp_item(dir, *item, entry->key);
          return std::string(b.begin(), b.end());
        };
      } else {
        // Compared by the meshproof dtype where there is one, so that a DCP float32 key and a
        // meshproof float32 key agree.
        k.dtype = e.dtype && e.dtype->dtype ? std::string(kernels::dtype_name(*e.dtype->dtype))
                                            : "torch." + e.dtype_name;
        k.shape = kernels::Shape(e.shape);
        k.read = [meta, entry, dir] { return engine::read_dcp_global(dir, *entry); };
      }
      v.keys.emplace(name, std::move(k));
    }
    v.title = fmt::format("DCP, {} files", files.size());
    return v;
  }
  auto index = std::make_shared<engine::CheckpointIndex>(engine::read_checkpoint_index(dir));
  v.title = fmt::format("step {}, mesh {}", index->step, index->mesh.str());
  v.scalars = index->scalars;
  for (const auto& [name, k] : index->keys) {
    const engine::KeyRecord* record = &k;
    v.keys.emplace(name, CheckpointView::Key{std::string(kernels::dtype_name(k.dtype)),
                                             k.shape,
                                             [index, record, dir] {
                                               return engine::read_global(dir, *index, *record);
                                             },
                                             {}});
  }
  return v;
}

}  // namespace meshproof::harness
