#include "engine/dcp/dcp_metadata.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>
#include <set>

#include "engine/dcp/pickle.h"
#include "kernels/core/error.h"

namespace meshproof::engine {
namespace {

namespace fs = std::filesystem;
using Kind = PyValue::Kind;

constexpr std::string_view kMeta = "torch.distributed.checkpoint.metadata.";

// Every global a FileSystemWriter `.metadata` names, PyTorch 2.4 and later.
const std::set<std::string>& metadata_globals() {
  static const std::set<std::string> globals = [] {
    std::set<std::string> g;
    for (const char* name :
         {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
          "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}) {
      g.insert(std::string(kMeta) + name);
    }
    g.insert("torch.distributed.checkpoint.filesystem._StorageInfo");
    g.insert("torch.Size");
    g.insert("torch.strided");
    g.insert("torch.serialization._get_layout");  // TensorProperties.layout:
                                                  // _get_layout("torch.strided")
    g.insert("collections.OrderedDict");
    // StorageMeta.checkpoint_id is the path the writer was given (a str or a pathlib path).
    g.insert("pathlib.PosixPath");
    add_torch_dtype_globals(g);
    // dtypes a checkpoint may declare that the reader does not read: allowed as names, so that
    // verify reports the key and its dtype rather than refusing the whole file.
    for (const char* name : {"complex32", "complex64", "complex128", "uint16", "uint32", "uint64",
                             "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"}) {
      g.insert(std::string("torch.") + name);
    }
    return g;
  }();
  return globals;
}

// The fields of a pickled dataclass instance of `cls`: the BUILD state (a dict, or the (dict,
// slots) pair of a class with __slots__).
const PyValue& fields(const PyRef& v, std::string_view cls, std::string_view what) {
  const PyValue& o = expect_object(v, std::string(kMeta) + std::string(cls), what);
  MP_CHECK_INPUT(o.built && o.state, "{}: a {} without its fields", what, cls);
  if (o.state->kind == Kind::kTuple && o.state->items.size() == 2 && o.state->items[1] &&
      o.state->items[1]->kind == Kind::kDict) {
    return *o.state->items[1];
  }
  return expect(o.state, Kind::kDict, fmt::format("{}: the fields of {}", what, cls));
}

PyRef field(const PyValue& f, std::string_view name, std::string_view what) {
  PyRef v = dict_get(f, name);
  MP_CHECK_INPUT(v != nullptr, "{}: no field '{}'", what, name);
  return v;
}

std::string dtype_of(const PyRef& properties, std::string_view what) {
  const PyValue& p = expect_object(properties, std::string(kMeta) + "TensorProperties", what);
  // TensorProperties pickles its state as a tuple (dtype, layout, requires_grad, memory format,
  // pin_memory) through its __getstate__; a plain dataclass state is a dict.
  PyRef dtype;
  if (p.state && p.state->kind == Kind::kTuple && !p.state->items.empty()) {
    dtype = p.state->items[0];
  } else if (p.state && p.state->kind == Kind::kDict) {
    dtype = dict_get(*p.state, "dtype");
  }
  MP_CHECK_INPUT(dtype && dtype->kind == Kind::kGlobal && dtype->text.starts_with("torch."),
                 "{}: TensorProperties without a torch dtype", what);
  return dtype->text.substr(6);
}

// The rank in a "__<rank>_<n>.distcp" file name, or -1.
int64_t writer_rank(const std::string& file) {
  if (!file.starts_with("__")) return -1;
  const size_t end = file.find('_', 2);
  if (end == std::string::npos || end == 2) return -1;
  int64_t r = 0;
  for (size_t i = 2; i < end; ++i) {
    if (file[i] < '0' || file[i] > '9') return -1;
    r = r * 10 + (file[i] - '0');
  }
  return r;
}

}  // namespace

std::string dcp_index_str(const std::vector<int64_t>& index) {
  return fmt::format("({})", fmt::join(index, ", "));
}

bool is_dcp_checkpoint(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kDcpMetadataFile, ec);
}

DcpMetadata parse_dcp_metadata(std::span<const uint8_t> bytes, std::string_view where) {
  const PyRef root = read_pickle(bytes, metadata_globals(), where);
  const std::string top = fmt::format("{}: Metadata", where);
  const PyValue& meta = fields(root, "Metadata", top);
  DcpMetadata out;
  if (PyRef version = dict_get(meta, "version"); version && version->kind == Kind::kStr) {
    out.version = version->text;
  }
  const PyValue& sdm =
      expect(field(meta, "state_dict_metadata", top), Kind::kDict, top + ".state_dict_metadata");
  for (const auto& [k, v] : sdm.pairs) {
    DcpEntry e;
    e.key = expect_str(k, top + ".state_dict_metadata key");
    const std::string what = fmt::format("{}: key '{}'", where, e.key);
    MP_CHECK_INPUT(!out.entries.contains(e.key), "{} appears twice", what);
    MP_CHECK_INPUT(v && v->kind == Kind::kObject, "{}: its storage metadata is a {}", what,
                   v ? pickle_kind_name(v->kind) : "nothing");
    if (v->text == std::string(kMeta) + "BytesStorageMetadata") {
      e.bytes = true;
      e.chunks.push_back({});
    } else {
      const PyValue& t = fields(v, "TensorStorageMetadata", what);
      e.dtype_name = dtype_of(field(t, "properties", what), what);
      e.dtype = find_torch_dtype(e.dtype_name);
      e.shape = int_sequence(field(t, "size", what), what + " size");
      for (int64_t s : e.shape) MP_CHECK_INPUT(s >= 0, "{}: negative size {}", what, s);
      const PyValue& chunks = expect(field(t, "chunks", what), Kind::kList, what + " chunks");
      for (const PyRef& c : chunks.items) {
        const PyValue& cf = fields(c, "ChunkStorageMetadata", what + " chunk");
        DcpChunk chunk;
        chunk.offsets = int_sequence(field(cf, "offsets", what), what + " chunk offsets");
        chunk.sizes = int_sequence(field(cf, "sizes", what), what + " chunk sizes");
        MP_CHECK_INPUT(
            chunk.offsets.size() == e.shape.size() && chunk.sizes.size() == e.shape.size(),
            "{}: a chunk at {} of rank {} in a tensor of rank {}", what,
            dcp_index_str(chunk.offsets), chunk.sizes.size(), e.shape.size());
        e.chunks.push_back(std::move(chunk));
      }
    }
    out.entries.emplace(e.key, std::move(e));
  }
  // storage_data: MetadataIndex(fqn, offset) -> _StorageInfo(relative_path, offset, length).
  const PyRef storage = field(meta, "storage_data", top);
  if (storage->kind == Kind::kNone) return out;
  const PyValue& items = expect(storage, Kind::kDict, top + ".storage_data");
  for (const auto& [k, v] : items.pairs) {
    const PyValue& index = fields(k, "MetadataIndex", top + ".storage_data key");
    const std::string fqn = expect_str(field(index, "fqn", top), top + ".storage_data fqn");
    const std::string what = fmt::format("{}: storage of key '{}'", where, fqn);
    const PyRef off = dict_get(index, "offset");
    const bool has_offset = off && off->kind != Kind::kNone;
    const std::vector<int64_t> offsets =
        has_offset ? int_sequence(off, what) : std::vector<int64_t>{};
    const PyValue& info =
        expect_object(v, "torch.distributed.checkpoint.filesystem._StorageInfo", what);
    MP_CHECK_INPUT(info.built && info.state && info.state->kind == Kind::kDict,
                   "{}: a _StorageInfo without its fields", what);
    DcpItem item{expect_str(field(*info.state, "relative_path", what), what + " relative_path"),
                 expect_int(field(*info.state, "offset", what), what + " offset"),
                 expect_int(field(*info.state, "length", what), what + " length")};
    // A relative path is a file name inside the folder: nothing may climb out of it.
    MP_CHECK_INPUT(!item.file.empty() && item.file.find('/') == std::string::npos &&
                       item.file != "." && item.file != "..",
                   "{}: relative_path '{}' is not a file name inside the checkpoint folder", what,
                   item.file);
    auto it = out.entries.find(fqn);
    DcpChunk* chunk = nullptr;
    if (it != out.entries.end()) {
      for (DcpChunk& c : it->second.chunks) {
        if (it->second.bytes || c.offsets == offsets) chunk = &c;
      }
    }
    if (chunk == nullptr) {
      out.stray_items.push_back(fmt::format("{} at {}", fqn, dcp_index_str(offsets)));
      continue;
    }
    MP_CHECK_INPUT(!chunk->item.has_value(), "{} at {}: two storage items for one chunk", what,
                   dcp_index_str(offsets));
    chunk->item = std::move(item);
  }
  return out;
}

DcpMetadata read_dcp_metadata(const fs::path& dir) {
  const fs::path p = dir / kDcpMetadataFile;
  std::ifstream f(p, std::ios::binary);
  MP_CHECK_INPUT(f.good(), "{}: cannot read the DCP metadata file", p.string());
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)),
                                   std::istreambuf_iterator<char>());
  return parse_dcp_metadata(bytes, p.string());
}

std::string describe_dcp_placement(const DcpEntry& e) {
  if (e.bytes) return "bytes";
  if (e.chunks.size() == 1) {
    return e.chunks[0].sizes == e.shape ? "replicated (one chunk)" : "one partial chunk";
  }
  const size_t rank = e.shape.size();
  std::vector<std::set<int64_t>> starts(rank);
  for (const DcpChunk& c : e.chunks) {
    for (size_t d = 0; d < rank; ++d) starts[d].insert(c.offsets[d]);
  }
  size_t grid = 1;
  for (const auto& s : starts) grid *= s.size();
  if (grid != e.chunks.size()) return fmt::format("irregular ({} chunks)", e.chunks.size());
  std::vector<std::string> parts;
  bool uneven = false;
  for (size_t d = 0; d < rank; ++d) {
    if (starts[d].size() < 2) continue;
    parts.push_back(fmt::format("Shard({}) over {}", d, starts[d].size()));
    // Along d the chunks are even when every one but the last has the same extent and the last is
    // no larger (torch.chunk's split: ceil(n / k) each, the remainder last).
    std::map<int64_t, int64_t> extent;
    for (const DcpChunk& c : e.chunks) extent[c.offsets[d]] = c.sizes[d];
    const int64_t first = extent.begin()->second;
    if (extent.rbegin()->second != first) uneven = true;
  }
  std::string s = fmt::format("{}", fmt::join(parts, " x "));
  // Chunks in global order whose writers' ranks do not ascend: the ranks hold the tensor in a
  // strided order (FSDP2 over a TP shard of the same dimension: _StridedShard).
  std::vector<const DcpChunk*> order;
  for (const DcpChunk& c : e.chunks) order.push_back(&c);
  std::sort(order.begin(), order.end(),
            [](const DcpChunk* a, const DcpChunk* b) { return a->offsets < b->offsets; });
  int64_t prev = -1;
  bool strided = false;
  for (const DcpChunk* c : order) {
    const int64_t r = c->item ? writer_rank(c->item->file) : -1;
    if (r < 0) {
      prev = -1;
      break;
    }
    if (r < prev) strided = true;
    prev = r;
  }
  if (strided) s += ", strided (writer ranks not in chunk order)";
  if (uneven) s += ", uneven last chunk";
  return s;
}

}  // namespace meshproof::engine
