// Host-only planning of the CUDA GEMM path (docs/design.md section 31), compiled in every build so
// that the CPU suite proves it: which path a GEMM takes (native cuBLASLt or the exact emulation)
// and why, the algorithm-cache key and its hash, operand alignment from a pointer, the heuristic
// failure message, and the scale-layout index functions the device conversion kernels call
// (MP_HOST_DEVICE: the same functions run on the CPU in the tests and on the device in gemm.cu).
//
// Terms. Every GEMM is reduced to C[R, S] = sum_k A[R, k] B[S, k] with both operands K-major
// (gemm_internal.h). An operand's "outer" index o runs over its non-reduction dimension (R for A,
// S for B) and its scale blocks along K are indexed kb.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/core/dtype.h"
#include "kernels/gemm/cublaslt_layout.h"
#include "kernels/quantize/quantized_tensor.h"

namespace meshproof::kernels::lt {

// ---- path decision ----

// cuBLASLt's per-operand scale modes (cublasLtMatmulMatrixScale_t), by our name; mapped to the
// library's values in gemm_cublaslt.cc.
enum class ScaleMode : uint8_t {
  kNone,            // high-precision operand, no scale
  kScalar32F,       // one fp32 scale (per-tensor FP8)
  kVec32Ue8m0,      // MXFP8: E8M0 per 1x32 block, 128x4-swizzled
  kVec128_32F,      // block scaling 1x128: fp32 per 1x128 block
  kBlk128x128_32F,  // block scaling 128x128: fp32 per 128x128 tile
  kVec16Ue4m3,      // NVFP4: E4M3 per 1x16 block, 128x4-swizzled, global scales in alpha
};
std::string_view scale_mode_name(ScaleMode m);

// Lowest cuBLASLt versions (cublasLtGetVersion(): major*10000 + minor*100 + patch) that define a
// scale mode: VEC32_UE8M0 and VEC16_UE4M3 arrived in 12.8, VEC128_32F and BLK128x128_32F in 12.9.
inline constexpr int kLtVersionMxNvfp4 = 120800;
inline constexpr int kLtVersionBlock = 120900;

// One operand as the path decision sees it: a high-precision tensor (dtype float32/bfloat16) or a
// quantized one (mode, element format).
struct PathOperand {
  bool quantized = false;
  ScalingMode mode = ScalingMode::kCurrentTensor;  // quantized only
  DType dtype = DType::kFloat32;                   // tensor dtype, or the quantized element format
};

struct PathQuery {
  PathOperand a;
  PathOperand b;
  int compute_capability = 0;  // major*10 + minor; 0: no device (CPU backend)
  int cublaslt_version = 0;    // cublasLtGetVersion(); 0 when the build has no cuBLASLt
  int64_t r = 0, s = 0, k = 0;
};

enum class GemmPath : uint8_t {
  kCpu,           // the CPU backend's reference GEMM
  kNativeDirect,  // fp32 x fp32 or bf16 x bf16 straight to cuBLASLt
  kNativeScaled,  // FP8/FP4 operands with cuBLASLt scale modes (a_scale, b_scale)
  kEmulatedBf16,  // decode exactly to bf16 (lossless for MXFP8), bf16 GEMM
  kEmulatedF32,   // decode exactly to fp32, fp32 GEMM
};

struct PathDecision {
  GemmPath path = GemmPath::kCpu;
  ScaleMode a_scale = ScaleMode::kNone;
  ScaleMode b_scale = ScaleMode::kNone;
  // "" when native, else why this GEMM is an emulation (the label of every emulated figure).
  std::string emulation;
  bool native() const { return emulation.empty(); }
};

// The one decision: gemm_cublaslt.cc runs the path it returns and engine::recipe_emulation labels
// figures with its `emulation`. Native scaled paths:
//   per-tensor FP8   cc >= 8.9 (not e5m2 x e5m2: cuBLASLt has no such kernel); dims are then an
//                    input error when not multiples of 16 (as before: the recipe's shape rule);
//   MXFP8            cc 10.x, cuBLASLt >= 12.8 (same dims rule);
//   block scaling    cc 9.0, cuBLASLt >= 12.9, 1x128 x 1x128, 1x128 x 128x128 or 128x128 x 1x128
//                    (cuBLASLt has no 128x128 x 128x128), R, S multiples of 16 and K of 128;
//   NVFP4            cc 10.x, cuBLASLt >= 12.8, R, S, K multiples of 32.
// Everything else is the exact emulation. Pure: no device, no library call.
PathDecision choose_gemm_path(const PathQuery& q);

// ---- algorithm cache key ----

// Everything the heuristic's answer depends on. Fields are plain integers (the cuBLASLt enum
// values, cast) so the key is host-testable.
struct AlgoKey {
  int device = 0;
  uint64_t m = 0, n = 0, k = 0;                // cuBLASLt's m, n, k (column-major view)
  int32_t type_a = 0, type_b = 0, type_c = 0;  // cudaDataType_t
  int32_t compute = 0;                         // cublasComputeType_t
  int32_t trans_a = 0, trans_b = 0;            // cublasOperation_t
  int64_t lda = 0, ldb = 0, ldc = 0;
  uint32_t align_a = 0, align_b = 0, align_c = 0, align_d = 0;  // bytes
  int32_t scale_a = 0, scale_b = 0;                             // cublasLtMatmulMatrixScale_t
  int32_t epilogue = 0;                                         // cublasLtEpilogue_t
  int8_t fast_accum = 0;
  uint64_t workspace = 0;  // bytes offered to the heuristic

  friend bool operator==(const AlgoKey&, const AlgoKey&) = default;
};

struct AlgoKeyHash {
  size_t operator()(const AlgoKey& key) const;
};

// ---- alignment ----

// The largest power of two <= 256 dividing `ptr` (256 for null, which is never passed): what
// CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES is set to, so the heuristic only returns algorithms
// that are valid for these pointers (a view at an odd offset gets a slower but correct kernel).
uint32_t pointer_alignment(const void* ptr);
uint32_t address_alignment(uintptr_t address);

// ---- the heuristic's failure message ----

struct LtFailure {
  std::string_view role;  // "fprop", "dgrad", "wgrad"
  int64_t r = 0, s = 0, k = 0;
  std::string_view a_dtype, b_dtype, out_dtype;
  char trans_a = 'N', trans_b = 'N';               // cuBLASLt's ops on its A (our B) and B (our A)
  uint32_t align_a = 0, align_b = 0, align_c = 0;  // our A's, our B's, the output's
  ScaleMode scale_a = ScaleMode::kNone, scale_b = ScaleMode::kNone;  // our A's, our B's
  int compute_capability = 0;
  int cublaslt_version = 0;
  std::string_view status;  // cublasLtGetStatusName of the heuristic call, or "no algorithm"
};
// "gemm_wgrad: cuBLASLt found no algorithm (CUBLAS_STATUS_NOT_SUPPORTED) for [R, S, K] =
// [..]: A e4m3 (VEC128_32F scales, aligned 256 B) x B ... -> float32 (aligned .. B), cuBLASLt ops
// TN on sm_90 with cuBLASLt 130000".
std::string describe_lt_failure(const LtFailure& f);

}  // namespace meshproof::kernels::lt
