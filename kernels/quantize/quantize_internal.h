// Internal to the quantizer family (quantize.cc, quantize_per_tensor.cc, quantize_mxfp8.cc,
// quantize_block.cc, quantize_cast.cc; tests, benchmarks): the element-format check, the dispatch
// to the CUDA launchers, the vectorisable CPU building blocks the recipes' CPU quantizers share
// (quantize_cast.cc), and which CPU cast kernel runs. The explicit AVX2 cast and the portable loop
// compute the same integer steps per element, so they are byte-equal; the switch exists for the
// tests that prove it (docs/design.md section 21).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/core/dtype.h"
#include "kernels/ops/op_util.h"
#include "kernels/quantize/quantize_cuda.h"

// The CUDA launchers exist only when the backend is compiled; MP_CUDA_DISPATCH keeps the dispatch
// readable in both builds.
#if MESHPROOF_HAVE_CUDA
#define MP_CUDA_DISPATCH(call) cuda::call
#else
#define MP_CUDA_DISPATCH(call) detail::no_cuda_backend("quantize")
#endif

namespace meshproof::kernels::detail {

// Whether the CPU quantizers may use the AVX2 cast (default: yes when the CPU has AVX2).
// Process-wide. Disabling always succeeds; enabling on a CPU without AVX2 keeps the portable loop.
void set_quantize_avx2(bool enabled);
// True when the AVX2 cast runs now.
bool quantize_avx2_active();

// True for e5m2, false for e4m3; an input error for any other format (defined in quantize.cc).
bool is_e5m2(DType format);

// ---- vectorisable CPU building blocks (quantize_cast.cc, which states each one's contract) ----

// rules::block_amax_bits over the contiguous x[base, base + n).
uint32_t amax_contiguous(const void* x, bool bf16, int64_t base, int64_t n);
// acc[k] = max(acc[k], abs_bits(x[base + k])) for k < n: one row of per-column running maxima.
void col_amax_row(const void* x, bool bf16, int64_t base, int64_t n, uint32_t* acc);
// out[i] = fp8(x[base + i] * mult[i or 0]) for i < n (per_element: the multiplier of element i is
// mult[i]).
void cast_contiguous(const void* x, bool bf16, int64_t base, int64_t n, const float* mult,
                     bool per_element, bool e5m2, uint8_t* out);
// out[b] = rules::block_amax_bits of block b of x[base, base + n), blocks of `bs` elements.
void block_amaxes(const void* x, bool bf16, int64_t base, int64_t n, int64_t bs, uint32_t* out);
// out[i] = fp8(x[base + i] * mult[i / bs]) for i < n: a row of 1 x bs blocks in one call.
void cast_blocks(const void* x, bool bf16, int64_t base, int64_t n, int64_t bs, const float* mult,
                 bool e5m2, uint8_t* out);
// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols.
void transpose_bytes(const uint8_t* src, int64_t src_stride, int64_t rows, int64_t cols,
                     uint8_t* dst, int64_t dst_stride);
// Per-thread byte scratch of at least n bytes.
uint8_t* scratch_bytes(size_t n);

}  // namespace meshproof::kernels::detail
