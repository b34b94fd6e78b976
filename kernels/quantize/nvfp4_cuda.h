// Launchers of the NVFP4 CUDA kernels (nvfp4.cu), called by the dispatch in nvfp4.cc. Plain
// pointers and sizes only, so this header has no CUDA dependency. Device pointers; `stream` is
// the rank's cudaStream_t. Layouts are those of kernels/quantize/nvfp4.h.
#pragma once

#include <cstdint>

namespace meshproof::kernels::cuda {

// amax_out[0] = max|x|; amax_out[1] = the max over the RHT of every columnwise 16-group of x
// [M, K] with rht, else amax_out[0] (abs_bits maxima, NaN-propagating).
void launch_nvfp4_global_amax(const void* x, bool bf16, int64_t M, int64_t K, bool rht,
                              float* amax_out, void* stream);
// global_amax: device float32[2]. row/row_scale, col/col_scale: nullptr = skip that copy.
// sr_*: stochastic rounding key (sr_on false = round to nearest even).
void launch_quantize_nvfp4(const void* x, bool bf16, int64_t M, int64_t K, bool tile, bool rht,
                           bool pow2, bool sr_on, uint64_t sr_seed, uint64_t sr_stream,
                           int64_t sr_row0, int64_t sr_col0, int64_t sr_ld,
                           const float* global_amax, uint8_t* row, uint8_t* row_scale, uint8_t* col,
                           uint8_t* col_scale, void* stream);
// out [R, C] float32 = decode of packed data [R, C/2] with codes [R, C/16] and global amax *amax.
void launch_dequantize_nvfp4(const uint8_t* data, const uint8_t* scale, const float* amax,
                             int64_t R, int64_t C, float* out, void* stream);

// The columnwise copy and the rowwise codes of a 16x16-tiled tensor from its rowwise data
// (packed e2m1 [M, K/2] bytes, element 2j in the low nibble) and tile codes tiles [M/16, K/16]:
// row_scale [M, K/16] = tiles[m/16, b]; col_scale [K, M/16] = tiles[g, k/16]; col_data
// [K, M/2] bytes = the nibble transpose (element (k, m) = rowwise element (m, k)).
void launch_nvfp4_tiled_from_rowwise(const uint8_t* rowwise, const uint8_t* tiles, int64_t M,
                                     int64_t K, uint8_t* row_scale, uint8_t* col_data,
                                     uint8_t* col_scale, void* stream);

}  // namespace meshproof::kernels::cuda
