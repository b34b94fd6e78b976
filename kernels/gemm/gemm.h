// GEMMs of a linear layer Y = X·Wᵀ in their three roles (docs/design.md section 4):
//   fprop  Y[M,N]  = X[M,K]  · W[N,K]ᵀ   operands: X rowwise,  W rowwise
//   dgrad  dX[M,K] = dY[M,N] · W[N,K]    operands: dY rowwise, W columnwise
//   wgrad  dW[N,K] = dY[M,N]ᵀ · X[M,K]   operands: dY columnwise, X columnwise
// Operands are high-precision tensors (fp32/bf16) or quantized tensors carrying the needed copy.
// Copies used: "rowwise" = the rowwise copy; "columnwise" = the columnwise copy (the stored
// transpose [K,M] for per-tensor/block modes, the [M,K] 32x1-block copy for MXFP8). A missing copy
// is an input error naming the operand and the Usage to quantize it with. Operands may mix kinds
// (a bf16 tensor with a quantized one); leading dims of rank > 2 tensors are flattened into M.
// CPU: dequantize exactly to fp32 and multiply with fp32 accumulation in a fixed k order (bitwise
// reproducible), bf16 output rounded to nearest even. float64 operands and output (all three,
// CPU only) multiply in double: the model's fp64 mode for finite-difference gradient checks.
// CUDA (cuBLASLt, CUBLAS_COMPUTE_32F, no TF32), the path chosen by kernels::lt::choose_gemm_path
// (kernels/gemm/cublaslt_plan.h, docs/design.md section 31): fp32/bf16 natively; per-tensor FP8
// natively on sm_89+ in TN form (R, S, K multiples of 16, else an input error); MXFP8 natively on
// cc 10.x (same dims rule), elsewhere emulated (dequantize to bf16, bf16 GEMM); block scaling
// natively on sm_90 (1x128 / 128x128 cuBLASLt scale modes; not 128x128 x 128x128) and NVFP4 on
// cc 10.x; the rest (e5m2 x e5m2, mixed operand kinds, those recipes elsewhere) emulated exactly
// (dequantize to fp32, fp32 GEMM). Results differ from the CPU only by accumulation order (and
// the reduced-precision accumulators of fast accumulation and block-scaled kernels).
#pragma once

#include <variant>

#include "kernels/core/tensor.h"
#include "kernels/quantize/quantized_tensor.h"

namespace meshproof::kernels {

enum class GemmRole : uint8_t { kFprop, kDgrad, kWgrad };
std::string_view gemm_role_name(GemmRole r);

// A GEMM operand: a high-precision tensor or a quantized one (by reference; not owned).
using GemmOperand = std::variant<const Tensor*, const QuantizedTensor*>;

struct GemmOptions {
  // out += result instead of out = result (fp32 weight-gradient accumulation across micro-batches).
  bool accumulate = false;
  // FP8 fast accumulation (fprop on, dgrad/wgrad off for delayed/current; off for block scaling).
  // Ignored by the CPU backend, which always accumulates in fp32.
  bool fast_accumulation = false;
};

// Output dtype is the dtype of `out` (bf16 or fp32; fp32 required when accumulate is set;
// float64 with float64 operands on the CPU).
// All operands and `out` must be on the same device; shapes are checked with a clear error.
void gemm_fprop(GemmOperand x, GemmOperand w, Tensor& y, const GemmOptions& options = {});
void gemm_dgrad(GemmOperand dy, GemmOperand w, Tensor& dx, const GemmOptions& options = {});
void gemm_wgrad(GemmOperand dy, GemmOperand x, Tensor& dw, const GemmOptions& options = {});

}  // namespace meshproof::kernels
