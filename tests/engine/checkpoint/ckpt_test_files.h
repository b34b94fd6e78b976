// File surgery shared by the checkpoint tests: damage a committed checkpoint the way a disk or a
// hand edit would, so that load and `ckpt verify` can be shown to catch it.
#pragma once

#include <H5Cpp.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace meshproof::engine::testing {

// XORs one byte (at `byte` within the raw data of `dataset`) of the HDF5 file `file` with `mask`.
inline void flip_byte(const std::filesystem::path& file, const std::string& dataset,
                      int64_t byte = 0, char mask = 0x5a) {
  haddr_t offset = 0;
  {
    H5::H5File f(file.string(), H5F_ACC_RDONLY);
    offset = f.openDataSet(dataset).getOffset();
  }
  ASSERT_NE(offset, HADDR_UNDEF);
  std::fstream s(file, std::ios::in | std::ios::out | std::ios::binary);
  s.seekg(static_cast<std::streamoff>(offset + static_cast<haddr_t>(byte)));
  char c = 0;
  s.read(&c, 1);
  c = static_cast<char>(c ^ mask);
  s.seekp(static_cast<std::streamoff>(offset + static_cast<haddr_t>(byte)));
  s.write(&c, 1);
}

}  // namespace meshproof::engine::testing
