// libFuzzer target for PyTorch DCP folders (engine/dcp, docs/design.md sections 17 and 40).
//
// LLVMFuzzerInitialize copies the .distcp files of a fixture torch wrote
// (tests/data/dcp/torch-2.4.1/fsdp2_ws2) into a fresh work folder. Each input is one of:
//   * anything not starting with "ITEM": the bytes become the folder's .metadata;
//   * "ITEM" + bytes: the bytes are read as one torch.save archive (a .distcp item).
// Then, as `meshproof ckpt verify` and `ckpt diff` do: read_dcp_metadata, describe every key's
// placement, verify_dcp_checkpoint, and read_dcp_global for every tensor key. Each stage may
// reject the input with kernels::Error; anything else (a crash, a sanitizer report, a foreign
// exception, a hang) is a finding. Oracle: a metadata the reader accepts has chunks of its
// tensor's rank, and a key read_dcp_global returns has the key's global shape.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "engine/dcp/dcp_checkpoint.h"
#include "engine/dcp/torch_archive.h"
#include "kernels/core/error.h"

namespace fs = std::filesystem;

namespace {

fs::path* work = nullptr;

void remove_work() {
  if (work) fs::remove_all(work->parent_path());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  std::string templ = (fs::temp_directory_path() / "meshproof-dcp-fuzz-XXXXXX").string();
  if (mkdtemp(templ.data()) == nullptr) {
    std::perror("dcp_metadata_fuzz: mkdtemp");
    std::abort();
  }
  work = new fs::path(fs::path(templ) / "ckpt");
  fs::create_directories(*work);
  std::atexit(remove_work);
  const fs::path src = fs::path(MESHPROOF_SOURCE_DIR) / "tests/data/dcp/torch-2.4.1/fsdp2_ws2";
  for (const auto& e : fs::directory_iterator(src)) {
    if (e.path().extension() == ".distcp") fs::copy_file(e.path(), *work / e.path().filename());
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using meshproof::kernels::Error;
  namespace engine = meshproof::engine;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  if (input.starts_with("ITEM")) {
    try {
      engine::read_torch_save_tensor({data + 4, size - 4}, "fuzz item");
    } catch (const Error&) {
    }
    return 0;
  }
  std::ofstream(*work / ".metadata", std::ios::binary | std::ios::trunc)
      .write(input.data(), static_cast<std::streamsize>(size));
  engine::DcpMetadata meta;
  try {
    meta = engine::read_dcp_metadata(*work);
  } catch (const Error&) {
    return 0;
  }
  for (const auto& [key, e] : meta.entries) {
    for (const engine::DcpChunk& c : e.chunks) {
      if (!e.bytes && (c.offsets.size() != e.shape.size() || c.sizes.size() != e.shape.size())) {
        std::fprintf(stderr, "dcp_metadata_fuzz: key %s has a chunk of another rank\n",
                     key.c_str());
        std::abort();
      }
    }
    (void)engine::describe_dcp_placement(e);
  }
  try {
    (void)engine::verify_dcp_checkpoint(*work);
  } catch (const Error&) {
  }
  for (const auto& [key, e] : meta.entries) {
    if (e.bytes) continue;
    try {
      const meshproof::kernels::Tensor t = engine::read_dcp_global(*work, e);
      if (std::vector<int64_t>(t.shape().dims().begin(), t.shape().dims().end()) != e.shape) {
        std::fprintf(stderr, "dcp_metadata_fuzz: key %s read with another shape\n", key.c_str());
        std::abort();
      }
    } catch (const Error&) {
    }
  }
  return 0;
}
