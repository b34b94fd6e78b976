// `meshproof env`: compiled backends, CUDA runtime/driver, cuBLASLt and NCCL versions, each GPU's
// name, compute capability and memory, MPI availability.
#pragma once

#include <ostream>

#include "reports/environment.h"

namespace meshproof::harness {

reports::EnvironmentRecord collect_environment();
void print_environment(const reports::EnvironmentRecord& env, std::ostream& out);

}  // namespace meshproof::harness
