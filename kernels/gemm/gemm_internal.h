// Internal to the GEMM family (gemm.cc, gemm_cpu_pack.cc, gemm_cpu_kernel.cc, gemm.cu, tests): the
// canonical "both operands K-major" form every role is reduced to, and the CUDA entry point.
//
// Every role computes C[R, S] = sum_k A[R, k] * B[S, k] (the "TN" form of cuBLAS, written
// row-major), with the operands as follows (docs/design.md section 4):
//   fprop  Y[M,N]  = X[M,K] W[N,K]^T   A = X   [M,K] rowwise      B = W   [N,K] rowwise
//   dgrad  dX[M,K] = dY[M,N] W[N,K]    A = dY  [M,N] rowwise      B = W^T [K,N] columnwise
//   wgrad  dW[N,K] = dY^T X            A = dY^T[N,M] columnwise   B = X^T [K,M] columnwise
// "columnwise" is the operand's columnwise copy: the stored transpose for per-tensor and block
// modes, the [M,K] 32x1-block copy for MXFP8 (transposed on the fly), the transpose of a
// high-precision tensor.
#pragma once

#include "kernels/gemm/cublaslt_plan.h"
#include "kernels/gemm/gemm.h"

namespace meshproof::kernels::detail {

// One operand of the canonical form: `op` used in its rowwise (transposed = false) or
// columnwise (transposed = true) orientation. `name` ("X", "W", "dY") is for error messages.
struct GemmSide {
  GemmOperand op;
  bool transposed = false;
  const char* name = "";
};

// The validated problem: C[r, s] = sum_k A[r, k] B[s, k], written into `out` ([r, s]).
struct GemmProblem {
  GemmRole role = GemmRole::kFprop;
  GemmSide a;
  GemmSide b;
  int64_t r = 0;  // rows of C
  int64_t s = 0;  // columns of C
  int64_t k = 0;  // reduction length
};

// Packing decode tables of the CPU GEMM: the exact fp32 value of every FP8 code of `format`
// (e4m3 or e5m2), and 2^(e-127) for every E8M0 scale e < 255 (index 255: NaN, but a NaN block is
// decoded to the canonical quiet NaN apart). An FP8 value times 2^(e-127) is exact (at most 4
// significant bits, the result is >= 2^-143 or overflows to inf), so table[q] * pow2[e] equals
// std::ldexp(decode(q), e - 127) bit for bit: tested exhaustively.
const float* fp8_decode_table(DType format);
const float* e8m0_pow2_table();

// The CPU micro-kernel (docs/design.md section 21). Every kernel sums each output element in the
// same k order, so they are bitwise equal; the choice is exposed for the tests that prove it and
// for the benchmarks. kAuto: AVX2 when the CPU has it, else the portable 4-lane vector loop.
enum class CpuGemmKernel : uint8_t { kAuto, kPortable, kAvx2 };
bool cpu_gemm_kernel_available(CpuGemmKernel k);
// Process-wide; input error when `k` is not available on this CPU.
void set_cpu_gemm_kernel(CpuGemmKernel k);
// The kernel the CPU GEMM uses now (never kAuto).
CpuGemmKernel cpu_gemm_kernel();

#if MESHPROOF_HAVE_CUDA
// Runs a validated problem whose operands and output all live on `out.device()` (CUDA), on the
// path gemm_cuda_path chooses.
void gemm_cuda(const GemmProblem& p, Tensor& out, const GemmOptions& options);
// lt::choose_gemm_path for this problem on CUDA device `device` (its compute capability and the
// loaded cuBLASLt's version): the path gemm_cuda runs (the gpu tests assert on it).
lt::PathDecision gemm_cuda_path(const GemmProblem& p, int device);
#endif

}  // namespace meshproof::kernels::detail
