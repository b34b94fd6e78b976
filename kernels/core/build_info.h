// Version and provenance of this build, for env output, reports and golden files.
#pragma once

#include <string_view>

namespace meshproof::kernels {

std::string_view version();             // e.g. "0.1.0"
std::string_view git_commit();          // short hash at configure time, or "unknown"
std::string_view build_type();          // CMake build type
bool cuda_compiled();                   // whether the CUDA backend was compiled in
std::string_view cuda_architectures();  // e.g. "90;100", empty when CUDA is off

}  // namespace meshproof::kernels
