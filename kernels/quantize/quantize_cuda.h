// Launchers of the CUDA quantization kernels (quantize.cu), called by the dispatch in quantize*.cc.
// Plain pointers and sizes only, so this header has no CUDA dependency. All pointers are device
// pointers; `stream` is the rank's cudaStream_t (nullptr = legacy default stream). Kernels are
// enqueued asynchronously. Layouts are those of kernels/quantize/quantized_tensor.h.
#pragma once

#include <cstdint>

namespace meshproof::kernels::cuda {

// amax_out[0] = max over n elements of |x| (bit-pattern max, NaN-propagating).
void launch_amax(const void* x, bool bf16, int64_t n, float* amax_out, void* stream);
// scale_out[0] = rules::current_scale(amax[0], ...).
void launch_current_scale(const float* amax, float* scale_out, float fp8max, float eps, bool pow2,
                          void* stream);
// history[0] = max(history[0], amax[0]).
void launch_record_amax(float* history, const float* amax, void* stream);
// rules::delayed_update on the device state.
void launch_delayed_update(float* history, int64_t len, float* scale, bool algo_max, float fp8max,
                           float two_pow_margin, void* stream);
// Per-tensor: row [M,K] and/or col [K,M] (nullptr = skip), scale_inv_out[0] = 1/scale[0].
void launch_quantize_per_tensor(const void* x, bool bf16, int64_t M, int64_t K, const float* scale,
                                bool e5m2, uint8_t* row, uint8_t* col, float* scale_inv_out,
                                void* stream);
// MXFP8: row [M,K] + row_scale [M,K/32]; col [M,K] + col_scale [M/32,K] (nullptr = skip).
void launch_quantize_mxfp8(const void* x, bool bf16, int64_t M, int64_t K, bool e5m2, uint8_t* row,
                           uint8_t* row_scale, uint8_t* col, uint8_t* col_scale, void* stream);
// Block scaling (tile128 = 128x128 blocks, else 1x128): row [M,K] + row_scale_inv, col [K,M] +
// col_scale_inv (nullptr = skip); scales by rules::block_scale(amax, e5m2, eps, pow2).
void launch_quantize_block(const void* x, bool bf16, int64_t M, int64_t K, bool tile128, bool e5m2,
                           float eps, bool pow2, uint8_t* row, float* row_scale_inv, uint8_t* col,
                           float* col_scale_inv, void* stream);
// out[M,K] float32 = rules::dequant_at(layout, ...) for every (m, k).
void launch_dequantize(int layout, bool e5m2, const uint8_t* data, const void* scale, int64_t M,
                       int64_t K, float* out, void* stream);
// [R,C] -> [C,R] for 1- or 4-byte elements.
void launch_transpose(const void* in, void* out, int64_t R, int64_t C, int elem_bytes,
                      void* stream);

}  // namespace meshproof::kernels::cuda
