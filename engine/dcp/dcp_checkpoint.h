// A PyTorch DCP folder as a checkpoint meshproof can verify and read (docs/design.md section 40):
// the metadata (engine/dcp/dcp_metadata.h) checked against itself and against the `.distcp`
// files, and each key's global tensor reassembled from its chunks by global index.
#pragma once

#include <filesystem>

#include "engine/checkpoint/checkpoint.h"
#include "engine/dcp/dcp_metadata.h"
#include "kernels/core/tensor.h"

namespace meshproof::engine {

// Everything a load of the folder needs, for every key, collecting the problems instead of
// stopping at the first: each tensor's chunks lie inside its global shape and tile it exactly once
// (a gap or an overlap names the key and its first global index), every chunk has a storage item,
// every item lies inside its file (present and readable) with the length it records, every tensor
// item is a torch.save archive holding a tensor of the chunk's dtype and sizes, every dtype is one
// the reader knows, and no storage item is left without a chunk. A malformed `.metadata` throws
// kInput.
VerifyReport verify_dcp_checkpoint(const std::filesystem::path& dir);

// The bytes of one item of the folder (its file, offset and length), read whole; an item outside
// its file is an integrity error naming the key and file.
std::vector<uint8_t> read_dcp_item(const std::filesystem::path& dir, const DcpItem& item,
                                   std::string_view key);

// The global tensor of a tensor entry, reassembled from its chunks. Integrity errors (a gap, an
// overlap, a damaged item) name the key and file; a dtype without a meshproof equivalent (int8,
// int16, bool) is an input error naming the key and dtype.
kernels::Tensor read_dcp_global(const std::filesystem::path& dir, const DcpEntry& entry);

}  // namespace meshproof::engine
