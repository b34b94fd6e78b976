#include "engine/dcp/torch_archive.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zip.h>

#include <array>
#include <cstring>
#include <memory>

#include "engine/dcp/pickle.h"
#include "kernels/core/error.h"

namespace meshproof::engine {
namespace {

using kernels::DType;

// The dtypes a DCP checkpoint of a transformer holds. Those without a meshproof dtype (int8,
// int16, bool) are still read for inspect and verify; diff and convert refuse them by name.
constexpr std::array<TorchDType, 12> kTorchDTypes{{
    {"float32", 4, "FloatStorage", DType::kFloat32},
    {"float64", 8, "DoubleStorage", DType::kFloat64},
    {"bfloat16", 2, "BFloat16Storage", DType::kBFloat16},
    {"float16", 2, "HalfStorage", DType::kFloat16},
    {"float8_e4m3fn", 1, "Float8_e4m3fnStorage", DType::kE4M3},
    {"float8_e5m2", 1, "Float8_e5m2Storage", DType::kE5M2},
    {"int64", 8, "LongStorage", DType::kInt64},
    {"int32", 4, "IntStorage", DType::kInt32},
    {"uint8", 1, "ByteStorage", DType::kUInt8},
    {"int16", 2, "ShortStorage", std::nullopt},
    {"int8", 1, "CharStorage", std::nullopt},
    {"bool", 1, "BoolStorage", std::nullopt},
}};

struct ZipCloser {
  void operator()(zip_t* z) const { zip_discard(z); }
};
using ZipPtr = std::unique_ptr<zip_t, ZipCloser>;

// One entry of the archive, read whole. A missing entry is nullopt.
std::optional<std::vector<uint8_t>> read_entry(zip_t* z, const std::string& name,
                                               std::string_view where) {
  const zip_int64_t index = zip_name_locate(z, name.c_str(), 0);
  if (index < 0) return std::nullopt;
  zip_stat_t st;
  zip_stat_init(&st);
  MP_CHECK_INTEGRITY(zip_stat_index(z, static_cast<zip_uint64_t>(index), 0, &st) == 0 &&
                         (st.valid & ZIP_STAT_SIZE),
                     "{}: torch.save archive entry {} has no readable size", where, name);
  std::unique_ptr<zip_file_t, int (*)(zip_file_t*)> f(
      zip_fopen_index(z, static_cast<zip_uint64_t>(index), 0), zip_fclose);
  MP_CHECK_INTEGRITY(f != nullptr, "{}: cannot open torch.save archive entry {}: {}", where, name,
                     zip_strerror(z));
  std::vector<uint8_t> data(static_cast<size_t>(st.size));
  const zip_int64_t got = data.empty() ? 0 : zip_fread(f.get(), data.data(), st.size);
  MP_CHECK_INTEGRITY(got == static_cast<zip_int64_t>(st.size),
                     "{}: torch.save archive entry {} reads {} of its {} bytes", where, name, got,
                     st.size);
  // libzip checks an entry's CRC-32 when the read reaches its end: one more read must return 0.
  uint8_t past = 0;
  const zip_int64_t more = zip_fread(f.get(), &past, 1);
  MP_CHECK_INTEGRITY(more == 0, "{}: torch.save archive entry {} is damaged ({})", where, name,
                     more < 0 ? zip_file_strerror(f.get()) : "longer than its size");
  return data;
}

const std::set<std::string>& archive_globals() {
  static const std::set<std::string> globals = [] {
    std::set<std::string> g{"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
                            "collections.OrderedDict", "torch.UntypedStorage",
                            "torch._utils._rebuild_tensor_v3"};
    add_torch_dtype_globals(g);
    return g;
  }();
  return globals;
}

struct TensorView {
  const TorchDType* dtype = nullptr;
  std::string storage_key;
  int64_t storage_offset = 0;
  std::vector<int64_t> size, stride;
};

// The tensor the pickle rebuilds: _rebuild_tensor_v2(storage, offset, size, stride, ...) or
// _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, ...), possibly
// inside _rebuild_parameter(tensor, requires_grad, hooks).
TensorView tensor_view(const PyRef& root, std::string_view where) {
  const std::string what = fmt::format("{}: data.pkl", where);
  MP_CHECK_INTEGRITY(root && root->kind == PyValue::Kind::kObject,
                     "{} is not a tensor (a torch.save of one tensor is expected)", what);
  const PyValue* t = root.get();
  if (t->text == "torch._utils._rebuild_parameter") {
    MP_CHECK_INTEGRITY(
        !t->items.empty() && t->items[0] && t->items[0]->kind == PyValue::Kind::kObject,
        "{}: a parameter without its tensor", what);
    t = t->items[0].get();
  }
  const bool v3 = t->text == "torch._utils._rebuild_tensor_v3";
  MP_CHECK_INTEGRITY(t->text == "torch._utils._rebuild_tensor_v2" || v3,
                     "{} rebuilds its value with {}, not a tensor", what, t->text);
  MP_CHECK_INTEGRITY(t->items.size() >= (v3 ? 7u : 4u), "{}: a tensor rebuild with {} arguments",
                     what, t->items.size());
  const PyRef& storage = t->items[0];
  MP_CHECK_INTEGRITY(storage && storage->kind == PyValue::Kind::kPersistent && storage->state &&
                         storage->state->kind == PyValue::Kind::kTuple &&
                         storage->state->items.size() == 5,
                     "{}: the tensor's storage is not a ('storage', type, key, location, numel) "
                     "persistent id",
                     what);
  const auto& id = storage->state->items;
  MP_CHECK_INTEGRITY(id[0]->kind == PyValue::Kind::kStr && id[0]->text == "storage" &&
                         id[1]->kind == PyValue::Kind::kGlobal &&
                         id[2]->kind == PyValue::Kind::kStr,
                     "{}: a malformed storage persistent id", what);
  TensorView v;
  if (v3) {
    MP_CHECK_INTEGRITY(t->items[6]->kind == PyValue::Kind::kGlobal,
                       "{}: v3 rebuild without a dtype", what);
    v.dtype = find_torch_dtype(std::string_view(t->items[6]->text).substr(6));
  } else {
    v.dtype = find_torch_storage(std::string_view(id[1]->text).substr(6));
  }
  MP_CHECK_INTEGRITY(v.dtype != nullptr, "{}: storage of {} (a dtype this reader does not know)",
                     what, v3 ? t->items[6]->text : id[1]->text);
  v.storage_key = id[2]->text;
  v.storage_offset = expect_int(t->items[1], what + " storage offset");
  v.size = int_sequence(t->items[2], what + " size");
  v.stride = int_sequence(t->items[3], what + " stride");
  MP_CHECK_INTEGRITY(v.size.size() == v.stride.size(), "{}: size {} and stride {} ranks differ",
                     what, v.size.size(), v.stride.size());
  return v;
}

}  // namespace

const TorchDType* find_torch_dtype(std::string_view name) {
  for (const TorchDType& t : kTorchDTypes) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const TorchDType* find_torch_storage(std::string_view storage_class) {
  for (const TorchDType& t : kTorchDTypes) {
    if (t.storage == storage_class) return &t;
  }
  return nullptr;
}

void add_torch_dtype_globals(std::set<std::string>& globals) {
  for (const TorchDType& t : kTorchDTypes) {
    globals.insert(fmt::format("torch.{}", t.name));
    globals.insert(fmt::format("torch.{}", t.storage));
  }
}

TorchTensor read_torch_save_tensor(std::span<const uint8_t> archive, std::string_view where) {
  zip_error_t err;
  zip_error_init(&err);
  zip_source_t* src = zip_source_buffer_create(archive.data(), archive.size(), 0, &err);
  MP_CHECK(src != nullptr, "{}: zip_source_buffer_create: {}", where, zip_error_strerror(&err));
  ZipPtr z(zip_open_from_source(src, ZIP_RDONLY | ZIP_CHECKCONS, &err));
  if (!z) {
    const std::string why = zip_error_strerror(&err);
    zip_source_free(src);
    zip_error_fini(&err);
    MP_CHECK_INTEGRITY(false, "{}: not a torch.save archive (zip: {})", where, why);
  }
  zip_error_fini(&err);
  // The archive's root folder is the name torch.save chose ("archive" for a stream); data.pkl
  // sits directly inside it.
  std::string root;
  const zip_int64_t n = zip_get_num_entries(z.get(), 0);
  for (zip_int64_t i = 0; i < n; ++i) {
    const std::string name = zip_get_name(z.get(), static_cast<zip_uint64_t>(i), 0);
    const size_t slash = name.find('/');
    if (slash != std::string::npos && name.substr(slash) == "/data.pkl") {
      root = name.substr(0, slash);
      break;
    }
  }
  MP_CHECK_INTEGRITY(!root.empty(), "{}: torch.save archive without <root>/data.pkl", where);
  if (auto order = read_entry(z.get(), root + "/byteorder", where)) {
    const std::string s(order->begin(), order->end());
    MP_CHECK_INTEGRITY(s == "little",
                       "{}: a '{}'-endian torch.save archive (only little-endian "
                       "archives are read)",
                       where, s);
  }
  const std::vector<uint8_t> pkl = *read_entry(z.get(), root + "/data.pkl", where);
  const TensorView v = tensor_view(read_pickle(pkl, archive_globals(), where), where);
  const auto data = read_entry(z.get(), root + "/data/" + v.storage_key, where);
  MP_CHECK_INTEGRITY(data.has_value(), "{}: the tensor's storage {}/data/{} is not in the archive",
                     where, root, v.storage_key);
  const int64_t width = v.dtype->bytes;
  const int64_t storage_numel = static_cast<int64_t>(data->size()) / width;
  TorchTensor t;
  t.dtype = v.dtype;
  t.shape = v.size;
  // The view's extent in the storage: every index it reaches must lie inside it.
  int64_t numel = 1, last = v.storage_offset;
  for (size_t d = 0; d < v.size.size(); ++d) {
    MP_CHECK_INTEGRITY(v.size[d] >= 0 && v.stride[d] >= 0,
                       "{}: negative size or stride in dimension {}", where, d);
    numel *= v.size[d];
    if (v.size[d] > 0) last += (v.size[d] - 1) * v.stride[d];
  }
  MP_CHECK_INTEGRITY(v.storage_offset >= 0 && (numel == 0 || last < storage_numel),
                     "{}: the tensor (offset {}, size {}) reaches element {} of a storage of {}",
                     where, v.storage_offset, fmt::join(v.size, "x"), last, storage_numel);
  t.bytes.resize(static_cast<size_t>(numel * width));
  // Row-major copy through the strides, one element at a time (items are small shards; the
  // common contiguous case is one memcpy).
  bool contiguous = true;
  int64_t expect = 1;
  for (size_t d = v.size.size(); d-- > 0;) {
    if (v.size[d] != 1 && v.stride[d] != expect) contiguous = false;
    expect *= v.size[d];
  }
  const uint8_t* base = data->data();
  if (contiguous) {
    std::memcpy(t.bytes.data(), base + v.storage_offset * width, t.bytes.size());
    return t;
  }
  std::vector<int64_t> idx(v.size.size(), 0);
  for (int64_t i = 0; i < numel; ++i) {
    int64_t off = v.storage_offset;
    for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * v.stride[d];
    std::memcpy(t.bytes.data() + i * width, base + off * width, static_cast<size_t>(width));
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < v.size[d]) break;
      idx[d] = 0;
    }
  }
  return t;
}

}  // namespace meshproof::engine
