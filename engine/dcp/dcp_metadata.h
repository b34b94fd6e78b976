// The index of a PyTorch distributed checkpoint (torch.distributed.checkpoint, "DCP"), as
// FileSystemWriter writes it in PyTorch 2.4 and later (docs/design.md section 40): a folder holding
// `.metadata` (a pickled Metadata) and one `__<rank>_<n>.distcp` file per writer. Per state-dict
// key the Metadata holds either a TensorStorageMetadata (dtype, global size, the saved chunks'
// global offsets and sizes) or a BytesStorageMetadata; its storage_data maps each chunk (the key
// and the chunk's offsets) to the item holding it (file, byte offset, length).
//
// The pickle is read by the restricted unpickler (engine/dcp/pickle.h) with only the globals the
// format uses allowed (kDcpMetadataGlobals); the values are then checked field by field, so a
// foreign or truncated `.metadata` is an input error (exit 2) naming the file and, where one is
// reached, the key.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/dcp/torch_archive.h"

namespace meshproof::engine {

// The name of the index file inside a DCP folder; its presence is what makes a folder one.
inline constexpr std::string_view kDcpMetadataFile = ".metadata";
bool is_dcp_checkpoint(const std::filesystem::path& dir);

// Where a chunk's bytes are: an item of one of the folder's files.
struct DcpItem {
  std::string file;  // relative to the folder ("__0_0.distcp")
  int64_t offset = 0;
  int64_t length = 0;
};

struct DcpChunk {
  std::vector<int64_t> offsets;  // [rank] the chunk's first global index per dimension
  std::vector<int64_t> sizes;    // [rank] its extent
  std::optional<DcpItem> item;   // nullopt when storage_data does not name it (verify reports it)
};

struct DcpEntry {
  std::string key;
  bool bytes = false;                 // a BytesStorageMetadata (an opaque io.BytesIO item)
  std::string dtype_name;             // tensors: the torch dtype as pickled ("bfloat16")
  const TorchDType* dtype = nullptr;  // nullptr for bytes, or a dtype the reader does not know
  std::vector<int64_t> shape;         // [rank] tensors: the global size
  std::vector<DcpChunk> chunks;       // tensors: the saved chunks; bytes: one, rank 0
};

struct DcpMetadata {
  std::map<std::string, DcpEntry> entries;
  // storage_data entries that name no chunk of any key (verify reports them).
  std::vector<std::string> stray_items;
  std::string version;  // Metadata.version where the writer records one (PyTorch >= 2.6), else ""
};

// Parses `.metadata` bytes; `where` names the file in messages.
DcpMetadata parse_dcp_metadata(std::span<const uint8_t> bytes, std::string_view where);
// Reads and parses `<dir>/.metadata`; a missing or unreadable file is an input error.
DcpMetadata read_dcp_metadata(const std::filesystem::path& dir);

// A global index or extent as messages print it: "(64, 0)".
std::string dcp_index_str(const std::vector<int64_t>& index);

// The placement the chunks of a tensor imply, in words: "replicated (one chunk)", "Shard(0) over
// 4", "Shard(0) over 2 x Shard(1) over 2", with "uneven last chunk" appended where the last chunk
// along a sharded dimension is smaller than the others. Describes the grid the chunks form; a set
// that is not a grid is described as "irregular (N chunks)".
std::string describe_dcp_placement(const DcpEntry& entry);

}  // namespace meshproof::engine
