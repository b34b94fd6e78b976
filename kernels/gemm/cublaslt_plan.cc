// Host-only planning of the CUDA GEMM path (kernels/gemm/cublaslt_plan.h; docs/design.md section
// 31).
#include "kernels/gemm/cublaslt_plan.h"

#include <fmt/format.h>

#include <functional>

namespace meshproof::kernels::lt {

std::string_view scale_mode_name(ScaleMode m) {
  switch (m) {
    case ScaleMode::kNone:
      return "none";
    case ScaleMode::kScalar32F:
      return "SCALAR_32F";
    case ScaleMode::kVec32Ue8m0:
      return "VEC32_UE8M0";
    case ScaleMode::kVec128_32F:
      return "VEC128_32F";
    case ScaleMode::kBlk128x128_32F:
      return "BLK128x128_32F";
    case ScaleMode::kVec16Ue4m3:
      return "VEC16_UE4M3";
  }
  return "unknown";
}

namespace {

bool is_per_tensor(const PathOperand& o) {
  return o.quantized &&
         (o.mode == ScalingMode::kDelayedTensor || o.mode == ScalingMode::kCurrentTensor);
}
bool is_mode(const PathOperand& o, ScalingMode m) { return o.quantized && o.mode == m; }
bool is_block(const PathOperand& o) {
  return is_mode(o, ScalingMode::kBlock1x128) || is_mode(o, ScalingMode::kBlock128x128);
}
ScaleMode block_scale(const PathOperand& o) {
  return o.mode == ScalingMode::kBlock128x128 ? ScaleMode::kBlk128x128_32F : ScaleMode::kVec128_32F;
}
bool cc_10x(int cc) { return cc >= 100 && cc < 110; }

PathDecision native(ScaleMode a, ScaleMode b) {
  return PathDecision{GemmPath::kNativeScaled, a, b, ""};
}
PathDecision emulated(GemmPath p, std::string why) {
  return PathDecision{p, ScaleMode::kNone, ScaleMode::kNone, std::move(why)};
}

}  // namespace

PathDecision choose_gemm_path(const PathQuery& q) {
  if (q.compute_capability == 0) return emulated(GemmPath::kCpu, "CPU emulation");
  const PathOperand& a = q.a;
  const PathOperand& b = q.b;
  if (!a.quantized && !b.quantized) {
    if (a.dtype == b.dtype) return PathDecision{GemmPath::kNativeDirect, {}, {}, ""};
    // A bf16 x fp32 product is exact in fp32: nothing is emulated, only widened.
    return PathDecision{GemmPath::kEmulatedF32, {}, {}, ""};
  }
  const bool both_e5m2 =
      a.quantized && b.quantized && a.dtype == DType::kE5M2 && b.dtype == DType::kE5M2;
  const int cc = q.compute_capability;
  if (is_per_tensor(a) && is_per_tensor(b)) {
    if (cc < 89)
      return emulated(GemmPath::kEmulatedF32, "per-tensor FP8 as fp32 GEMMs below sm_89");
    if (both_e5m2) {
      return emulated(GemmPath::kEmulatedF32,
                      "e5m2 x e5m2 as fp32 GEMMs (cuBLASLt has no such FP8 kernel)");
    }
    return native(ScaleMode::kScalar32F, ScaleMode::kScalar32F);
  }
  if (is_mode(a, ScalingMode::kMxfp8) && is_mode(b, ScalingMode::kMxfp8)) {
    if (cc < 100) return emulated(GemmPath::kEmulatedBf16, "MXFP8 as bf16 GEMMs below sm_100");
    if (!cc_10x(cc)) return emulated(GemmPath::kEmulatedBf16, "MXFP8 as bf16 GEMMs outside sm_10x");
    if (q.cublaslt_version < kLtVersionMxNvfp4) {
      return emulated(GemmPath::kEmulatedBf16,
                      fmt::format("MXFP8 as bf16 GEMMs (cuBLASLt {} < 12.8)", q.cublaslt_version));
    }
    if (both_e5m2) {
      return emulated(GemmPath::kEmulatedBf16,
                      "e5m2 x e5m2 MXFP8 as bf16 GEMMs (cuBLASLt has no such kernel)");
    }
    return native(ScaleMode::kVec32Ue8m0, ScaleMode::kVec32Ue8m0);
  }
  if (is_block(a) && is_block(b)) {
    if (cc != 90)
      return emulated(GemmPath::kEmulatedF32, "block scaling as dequantized fp32 GEMMs");
    if (q.cublaslt_version < kLtVersionBlock) {
      return emulated(GemmPath::kEmulatedF32,
                      fmt::format("block scaling as dequantized fp32 GEMMs (cuBLASLt {} < 12.9)",
                                  q.cublaslt_version));
    }
    if (a.mode == ScalingMode::kBlock128x128 && b.mode == ScalingMode::kBlock128x128) {
      return emulated(GemmPath::kEmulatedF32,
                      "128x128 x 128x128 block scaling as dequantized fp32 GEMMs (cuBLASLt has "
                      "no 2D x 2D mode)");
    }
    if (both_e5m2) {
      return emulated(GemmPath::kEmulatedF32,
                      "e5m2 x e5m2 block scaling as dequantized fp32 GEMMs");
    }
    if (q.r % 16 != 0 || q.s % 16 != 0 || q.k % 128 != 0) {
      return emulated(GemmPath::kEmulatedF32,
                      fmt::format("block scaling as dequantized fp32 GEMMs ([R, S, K] = [{}, {}, "
                                  "{}]: native needs R, S multiples of 16 and K of 128)",
                                  q.r, q.s, q.k));
    }
    return native(block_scale(a), block_scale(b));
  }
  if (is_mode(a, ScalingMode::kNvfp4) && is_mode(b, ScalingMode::kNvfp4)) {
    if (!cc_10x(cc)) return emulated(GemmPath::kEmulatedF32, "NVFP4 as dequantized fp32 GEMMs");
    if (q.cublaslt_version < kLtVersionMxNvfp4) {
      return emulated(
          GemmPath::kEmulatedF32,
          fmt::format("NVFP4 as dequantized fp32 GEMMs (cuBLASLt {} < 12.8)", q.cublaslt_version));
    }
    if (q.r % 32 != 0 || q.s % 32 != 0 || q.k % 32 != 0) {
      return emulated(GemmPath::kEmulatedF32,
                      fmt::format("NVFP4 as dequantized fp32 GEMMs ([R, S, K] = [{}, {}, {}]: "
                                  "native needs multiples of 32)",
                                  q.r, q.s, q.k));
    }
    return native(ScaleMode::kVec16Ue4m3, ScaleMode::kVec16Ue4m3);
  }
  return emulated(GemmPath::kEmulatedF32, "mixed operand kinds as dequantized fp32 GEMMs");
}

size_t AlgoKeyHash::operator()(const AlgoKey& key) const {
  // FNV-1a over the fields (not the struct bytes: padding is indeterminate).
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xFFu;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(key.device));
  mix(key.m), mix(key.n), mix(key.k);
  mix(static_cast<uint64_t>(key.type_a)), mix(static_cast<uint64_t>(key.type_b));
  mix(static_cast<uint64_t>(key.type_c)), mix(static_cast<uint64_t>(key.compute));
  mix(static_cast<uint64_t>(key.trans_a)), mix(static_cast<uint64_t>(key.trans_b));
  mix(static_cast<uint64_t>(key.lda)), mix(static_cast<uint64_t>(key.ldb));
  mix(static_cast<uint64_t>(key.ldc));
  mix(key.align_a), mix(key.align_b), mix(key.align_c), mix(key.align_d);
  mix(static_cast<uint64_t>(key.scale_a)), mix(static_cast<uint64_t>(key.scale_b));
  mix(static_cast<uint64_t>(key.epilogue)), mix(static_cast<uint64_t>(key.fast_accum));
  mix(key.workspace);
  return static_cast<size_t>(h);
}

uint32_t address_alignment(uintptr_t address) {
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

uint32_t pointer_alignment(const void* ptr) {
  return address_alignment(reinterpret_cast<uintptr_t>(ptr));
}

std::string describe_lt_failure(const LtFailure& f) {
  auto scales = [](ScaleMode m) {
    return m == ScaleMode::kNone ? std::string("no scales")
                                 : fmt::format("{} scales", scale_mode_name(m));
  };
  return fmt::format(
      "gemm_{}: cuBLASLt found no algorithm ({}) for [R, S, K] = [{}, {}, {}]: A {} ({}, "
      "aligned {} B) x B {} ({}, aligned {} B) -> {} (aligned {} B), cuBLASLt ops {}{} on sm_{} "
      "with cuBLASLt {}",
      f.role, f.status, f.r, f.s, f.k, f.a_dtype, scales(f.scale_a), f.align_a, f.b_dtype,
      scales(f.scale_b), f.align_b, f.out_dtype, f.align_c, f.trans_a, f.trans_b,
      f.compute_capability, f.cublaslt_version);
}

}  // namespace meshproof::kernels::lt
