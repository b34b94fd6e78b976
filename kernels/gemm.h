// GEMMs of a linear layer Y = X·Wᵀ in their three roles (DESIGN.md section 4):
//   fprop  Y[M,N]  = X[M,K]  · W[N,K]ᵀ   operands: X rowwise,  W rowwise
//   dgrad  dX[M,K] = dY[M,N] · W[N,K]    operands: dY rowwise, W columnwise
//   wgrad  dW[N,K] = dY[M,N]ᵀ · X[M,K]   operands: dY columnwise, X columnwise
// Operands are high-precision tensors (fp32/bf16) or quantized tensors carrying the needed copy.
// CPU: dequantize exactly to fp32 and multiply with fp32 accumulation in a fixed order.
// CUDA: cuBLASLt (fp32/bf16; per-tensor FP8 in TN form; MXFP8 native on cc 10.x, emulated
// elsewhere; block scaling where supported, emulated elsewhere).
#pragma once

#include <variant>

#include "kernels/quantized_tensor.h"
#include "kernels/tensor.h"

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

// Output dtype is the dtype of `out` (bf16 or fp32; fp32 required when accumulate is set).
// All operands and `out` must be on the same device; shapes are checked with a clear error.
void gemm_fprop(GemmOperand x, GemmOperand w, Tensor& y, const GemmOptions& options = {});
void gemm_dgrad(GemmOperand dy, GemmOperand w, Tensor& dx, const GemmOptions& options = {});
void gemm_wgrad(GemmOperand dy, GemmOperand x, Tensor& dw, const GemmOptions& options = {});

}  // namespace meshproof::kernels
