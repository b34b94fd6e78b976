// The tensors of a torch.save archive (PyTorch's zip serialization, as
// torch.distributed.checkpoint's FileSystemWriter stores each tensor item of a `.distcp` file;
// docs/design.md section 40). The archive is a zip of stored entries: `<root>/data.pkl` (a pickle
// of the tensor: torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, ...), with
// the storage as a persistent id ('storage', torch.<T>Storage, key, location, numel)) and
// `<root>/data/<key>` (the storage's bytes, little-endian). The pickle is read by the restricted
// unpickler (engine/dcp/pickle.h): only the rebuild functions, the storage types, the dtypes and
// collections.OrderedDict are allowed.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/core/dtype.h"

namespace meshproof::engine {

// One torch dtype: its name after "torch." ("float32"), its element size, its torch.save storage
// class ("FloatStorage") and the meshproof dtype holding the same bits, where there is one.
struct TorchDType {
  std::string_view name;
  int bytes = 0;
  std::string_view storage;
  std::optional<kernels::DType> dtype;
};
const TorchDType* find_torch_dtype(std::string_view name);
const TorchDType* find_torch_storage(std::string_view storage_class);
// "torch.float32", ..., "torch.FloatStorage", ... (the globals a torch.save pickle may name).
void add_torch_dtype_globals(std::set<std::string>& globals);

// A tensor as a torch.save archive holds it, materialised in row-major order.
struct TorchTensor {
  const TorchDType* dtype = nullptr;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // [numel * dtype->bytes], row-major (the stride applied)
};

// Reads the one tensor of the torch.save archive `archive` (the whole zip, e.g. one DCP item's
// bytes). `where` names the file and key in every message; anything malformed (not a zip, no
// data.pkl, a pickle that is not one tensor, a storage shorter than the view needs, a big-endian
// archive) is an integrity error (exit 1): the item does not hold what its metadata says.
TorchTensor read_torch_save_tensor(std::span<const uint8_t> archive, std::string_view where);

}  // namespace meshproof::engine
