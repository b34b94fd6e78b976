// `meshproof env`: compiled backends, CUDA runtime/driver, cuBLASLt and NCCL versions, each GPU's
// name, compute capability and memory, MPI availability.
#pragma once

#include <ostream>

#include "reports/record/environment.h"

namespace meshproof::harness {

// `open_cublaslt`: open cuBLASLt to report its version (the `env` verb; runs pass whether a GPU is
// usable, since their GEMMs open it anyway). Otherwise it reads "not loaded": opening it costs a
// CPU-only process about 0.15 s (kernels/gemm/cublaslt_api.h).
reports::EnvironmentRecord collect_environment(bool open_cublaslt);
void print_environment(const reports::EnvironmentRecord& env, std::ostream& out);

}  // namespace meshproof::harness
