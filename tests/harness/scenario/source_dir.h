// The checkout the scenario tests read (scenarios/, docs/): $MESHPROOF_SOURCE_DIR when set, else
// the source directory CMake compiled in (MESHPROOF_SOURCE_DIR_DEFAULT).
#pragma once

#include <cstdlib>
#include <filesystem>

namespace meshproof::harness::test_support {

inline std::filesystem::path source_dir() {
  if (const char* env = std::getenv("MESHPROOF_SOURCE_DIR")) return env;
  return MESHPROOF_SOURCE_DIR_DEFAULT;
}

}  // namespace meshproof::harness::test_support
