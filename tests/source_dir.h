// The checkout a test reads at run time (scenarios/, golden/, docs/, helper scripts):
// $MESHPROOF_SOURCE_DIR when set, else the source directory CMake compiled in
// (MESHPROOF_SOURCE_DIR_DEFAULT). A bundle taken to another machine (tools/gpu-bundle,
// tools/device-check) sets the variable, since the compiled-in path does not exist there.
#pragma once

#include <cstdlib>
#include <filesystem>

namespace meshproof::test_support {

inline std::filesystem::path source_dir() {
  if (const char* env = std::getenv("MESHPROOF_SOURCE_DIR")) return env;
  return MESHPROOF_SOURCE_DIR_DEFAULT;
}

}  // namespace meshproof::test_support
