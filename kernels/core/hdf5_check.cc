#include "kernels/core/hdf5_check.h"

namespace meshproof::kernels {

void silence_hdf5_errors() { H5::Exception::dontPrint(); }

}  // namespace meshproof::kernels
