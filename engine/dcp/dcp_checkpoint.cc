#include "engine/dcp/dcp_checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>

#include "kernels/core/error.h"

namespace meshproof::engine {
namespace {

namespace fs = std::filesystem;

// A chunk that lies outside the global shape, or "" when it lies inside.
std::string out_of_bounds(const DcpEntry& e, const DcpChunk& c) {
  for (size_t d = 0; d < e.shape.size(); ++d) {
    if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] > e.shape[d] - c.sizes[d]) {
      return fmt::format(
          "chunk at {} of sizes {} reaches outside the global shape {} in dimension {}",
          dcp_index_str(c.offsets), dcp_index_str(c.sizes), dcp_index_str(e.shape), d);
    }
  }
  return "";
}

// Whether the chunks tile the global shape exactly once, and if not the first global index (in
// row-major order) that no chunk or two chunks cover. The shape is cut into cells at every chunk
// boundary; each cell is covered by a whole number of chunks, so counting per cell is exact.
struct Tiling {
  std::optional<std::vector<int64_t>> gap, overlap;
  bool too_many_cells = false;
};
Tiling check_tiling(const DcpEntry& e) {
  Tiling t;
  const size_t rank = e.shape.size();
  for (int64_t s : e.shape) {
    if (s == 0) return t;  // nothing to cover
  }
  std::vector<std::vector<int64_t>> cuts(rank);
  for (size_t d = 0; d < rank; ++d) {
    std::set<int64_t> b{0, e.shape[d]};
    for (const DcpChunk& c : e.chunks) {
      b.insert(c.offsets[d]);
      b.insert(c.offsets[d] + c.sizes[d]);
    }
    cuts[d].assign(b.begin(), b.end());
  }
  uint64_t cells = 1;
  for (const auto& c : cuts) {
    cells *= c.size() - 1;
    if (cells > (uint64_t{1} << 24)) {
      t.too_many_cells = true;
      return t;
    }
  }
  std::vector<uint16_t> count(static_cast<size_t>(cells), 0);
  for (const DcpChunk& c : e.chunks) {
    if (std::find(c.sizes.begin(), c.sizes.end(), 0) != c.sizes.end()) continue;
    std::vector<size_t> lo(rank), hi(rank);
    for (size_t d = 0; d < rank; ++d) {
      lo[d] = static_cast<size_t>(std::lower_bound(cuts[d].begin(), cuts[d].end(), c.offsets[d]) -
                                  cuts[d].begin());
      hi[d] = static_cast<size_t>(
          std::lower_bound(cuts[d].begin(), cuts[d].end(), c.offsets[d] + c.sizes[d]) -
          cuts[d].begin());
    }
    std::vector<size_t> i = lo;
    while (true) {
      size_t flat = 0;
      for (size_t d = 0; d < rank; ++d) flat = flat * (cuts[d].size() - 1) + i[d];
      if (count[flat] < 2) ++count[flat];
      size_t d = rank;
      while (d-- > 0) {
        if (++i[d] < hi[d]) break;
        i[d] = lo[d];
      }
      if (d == static_cast<size_t>(-1)) break;
    }
  }
  for (size_t flat = 0; flat < count.size(); ++flat) {
    if (count[flat] == 1) continue;
    std::vector<int64_t> at(rank);
    size_t rest = flat;
    for (size_t d = rank; d-- > 0;) {
      at[d] = cuts[d][rest % (cuts[d].size() - 1)];
      rest /= cuts[d].size() - 1;
    }
    auto& slot = count[flat] == 0 ? t.gap : t.overlap;
    if (!slot) slot = at;
    if (t.gap && t.overlap) break;
  }
  return t;
}

int64_t file_size_or(const fs::path& p, int64_t missing) {
  std::error_code ec;
  const auto n = fs::file_size(p, ec);
  return ec ? missing : static_cast<int64_t>(n);
}

// Copies a chunk (row-major, sizes c.sizes) into the global row-major buffer of shape `shape`.
void place_chunk(const std::vector<int64_t>& shape, const DcpChunk& c, int64_t width,
                 const uint8_t* src, uint8_t* dst) {
  const size_t rank = shape.size();
  if (rank == 0) {
    std::memcpy(dst, src, static_cast<size_t>(width));
    return;
  }
  for (int64_t s : c.sizes) {
    if (s == 0) return;
  }
  const int64_t run = c.sizes[rank - 1] * width;
  std::vector<int64_t> i(rank - 1, 0);
  int64_t row = 0;
  while (true) {
    int64_t at = 0;
    for (size_t d = 0; d + 1 < rank; ++d) at = at * shape[d] + c.offsets[d] + i[d];
    at = at * shape[rank - 1] + c.offsets[rank - 1];
    std::memcpy(dst + at * width, src + row * run, static_cast<size_t>(run));
    ++row;
    size_t d = rank - 1;
    while (d-- > 0) {
      if (++i[d] < c.sizes[d]) break;
      i[d] = 0;
    }
    if (d == static_cast<size_t>(-1)) break;
  }
}

}  // namespace

std::vector<uint8_t> read_dcp_item(const fs::path& dir, const DcpItem& item, std::string_view key) {
  const fs::path p = dir / item.file;
  const int64_t size = file_size_or(p, -1);
  MP_CHECK_INTEGRITY(size >= 0, "key '{}': its file {} is missing", key, item.file);
  MP_CHECK_INTEGRITY(item.offset >= 0 && item.length >= 0 && item.offset <= size - item.length,
                     "key '{}': its item (offset {}, length {}) lies outside {} ({} bytes)", key,
                     item.offset, item.length, item.file, size);
  std::ifstream f(p, std::ios::binary);
  f.seekg(item.offset);
  std::vector<uint8_t> bytes(static_cast<size_t>(item.length));
  f.read(reinterpret_cast<char*>(bytes.data()), item.length);
  MP_CHECK_INTEGRITY(f.good() || item.length == 0, "key '{}': cannot read {} bytes at {} of {}",
                     key, item.length, item.offset, item.file);
  return bytes;
}

VerifyReport verify_dcp_checkpoint(const fs::path& dir) {
  const DcpMetadata meta = read_dcp_metadata(dir);
  VerifyReport r;
  auto finding = [&](const std::string& key, const std::string& file, std::string message) {
    r.findings.push_back({key, file, std::move(message)});
  };
  for (const auto& [key, e] : meta.entries) {
    ++r.keys;
    if (!e.bytes && e.dtype == nullptr) {
      finding(key, std::string(kDcpMetadataFile),
              fmt::format("dtype torch.{} is not one this reader knows", e.dtype_name));
    }
    bool bounded = true;
    for (const DcpChunk& c : e.chunks) {
      if (e.bytes) break;
      if (std::string why = out_of_bounds(e, c); !why.empty()) {
        finding(key, std::string(kDcpMetadataFile), why);
        bounded = false;
      }
    }
    if (!e.bytes && bounded) {
      const Tiling t = check_tiling(e);
      if (t.gap) {
        finding(key, std::string(kDcpMetadataFile),
                fmt::format("no chunk covers global index {} (the chunks leave a gap)",
                            dcp_index_str(*t.gap)));
      }
      if (t.overlap) {
        finding(key, std::string(kDcpMetadataFile),
                fmt::format("two chunks cover global index {} (the chunks overlap)",
                            dcp_index_str(*t.overlap)));
      }
      if (t.too_many_cells) {
        finding(key, std::string(kDcpMetadataFile),
                fmt::format("{} chunks too irregular to check their tiling", e.chunks.size()));
      }
    }
    for (const DcpChunk& c : e.chunks) {
      ++r.chunks;
      if (!c.item) {
        finding(key, std::string(kDcpMetadataFile),
                fmt::format("chunk at {} has no storage item", dcp_index_str(c.offsets)));
        continue;
      }
      try {
        const std::vector<uint8_t> bytes = read_dcp_item(dir, *c.item, key);
        if (e.bytes || e.dtype == nullptr) continue;
        const std::string where =
            fmt::format("key '{}' chunk at {} ({} at {})", key, dcp_index_str(c.offsets),
                        c.item->file, c.item->offset);
        const TorchTensor t = read_torch_save_tensor(bytes, where);
        if (t.dtype != e.dtype || t.shape != c.sizes) {
          finding(key, c.item->file,
                  fmt::format("chunk at {} holds a {} tensor of sizes {}; the metadata says {} {}",
                              dcp_index_str(c.offsets), t.dtype->name, dcp_index_str(t.shape),
                              e.dtype_name, dcp_index_str(c.sizes)));
        }
      } catch (const kernels::Error& err) {
        finding(key, c.item->file, err.message());
      }
    }
  }
  for (const std::string& s : meta.stray_items) {
    finding("", std::string(kDcpMetadataFile),
            fmt::format("storage item for {} matches no chunk of any key", s));
  }
  return r;
}

kernels::Tensor read_dcp_global(const fs::path& dir, const DcpEntry& e) {
  MP_CHECK_INPUT(!e.bytes, "key '{}' is a bytes entry, not a tensor", e.key);
  MP_CHECK_INPUT(e.dtype != nullptr && e.dtype->dtype.has_value(),
                 "key '{}': dtype torch.{} has no meshproof equivalent (float32, float64, "
                 "bfloat16, float16, float8_e4m3fn, float8_e5m2, int64, int32, uint8 are read)",
                 e.key, e.dtype_name);
  for (const DcpChunk& c : e.chunks) {
    const std::string why = out_of_bounds(e, c);
    MP_CHECK_INTEGRITY(why.empty(), "key '{}': {}", e.key, why);
  }
  const Tiling t = check_tiling(e);
  MP_CHECK_INTEGRITY(!t.gap && !t.overlap && !t.too_many_cells,
                     "key '{}': its chunks do not tile the global shape {} exactly once ({})",
                     e.key, dcp_index_str(e.shape),
                     t.gap       ? "a gap at " + dcp_index_str(*t.gap)
                     : t.overlap ? "an overlap at " + dcp_index_str(*t.overlap)
                                 : "irregular");
  kernels::Tensor out = kernels::Tensor::empty(kernels::Shape(e.shape), *e.dtype->dtype);
  for (const DcpChunk& c : e.chunks) {
    MP_CHECK_INTEGRITY(c.item.has_value(), "key '{}': chunk at {} has no storage item", e.key,
                       dcp_index_str(c.offsets));
    const std::vector<uint8_t> bytes = read_dcp_item(dir, *c.item, e.key);
    const TorchTensor tt = read_torch_save_tensor(
        bytes,
        fmt::format("key '{}' chunk at {} ({})", e.key, dcp_index_str(c.offsets), c.item->file));
    MP_CHECK_INTEGRITY(tt.dtype == e.dtype && tt.shape == c.sizes,
                       "key '{}': chunk at {} in {} holds a {} tensor of sizes {}, not {} {}",
                       e.key, dcp_index_str(c.offsets), c.item->file, tt.dtype->name,
                       dcp_index_str(tt.shape), e.dtype_name, dcp_index_str(c.sizes));
    place_chunk(e.shape, c, e.dtype->bytes, tt.bytes.data(), static_cast<uint8_t*>(out.raw_data()));
  }
  return out;
}

}  // namespace meshproof::engine
