// Internal to the CPU GEMM (gemm.cc, gemm_cpu_pack.cc, gemm_cpu_kernel.cc): the micro-tile and
// blocking constants, the stored-matrix view an operand is decoded through, the panel packing
// (gemm_cpu_pack.cc) and the packed product (gemm_cpu_kernel.cc) that gemm.cc dispatches to.
#pragma once

#include <cstdint>

#include "kernels/gemm/gemm_internal.h"

namespace meshproof::kernels::detail {

// ---- CPU reference: packed operands, register tiles, the same per-element order ----
//
// Both operands are packed once per call into panels (docs/design.md section 21): A's canonical
// matrix [R, K] into panels of kMr rows, element (i, k) of panel p at [k * kMr + i]; B's [S, K]
// into panels of kNr rows. Packing decodes every element exactly to fp32 (a 256-entry table per
// FP8 format times the copy's scale: the exact power of two 2^(e-127) for MXFP8, the fp32
// scale_inv otherwise) and performs the transposes the role needs, so the micro-kernel reads
// contiguous fp32 only. A kMr x kNr tile of C is held in registers; K is cut into kKc-long
// blocks so that a B panel stays in L1 and an A block in L2. The tile is stored back between
// K blocks and reloaded, which changes no bit: each c[i][j] is still +0.0f plus a[i][k] * b[j][k]
// (multiply rounded, then add rounded, never fused) for k = 0, 1, ..., K-1 in order, exactly the
// sum of the previous "i-k-j" loop. The tile shape, the vector width, the K blocking and the ISA
// therefore never change the result.

constexpr int kMr = 6;        // rows of A per micro-tile
constexpr int kNr = 16;       // rows of B (columns of C) per micro-tile: two 8-lane vectors
constexpr int64_t kKc = 256;  // K block: a B panel slice is kKc * kNr * 4 = 16 KiB (L1)
constexpr int64_t kMc = 96;   // rows of A per block: kMc * kKc * 4 = 96 KiB (L2)
static_assert(kMc % kMr == 0);

// One stored matrix (`rows` x `cols`, row-major) of an operand and how to decode it.
struct StoredView {
  enum class Kind : uint8_t { kF32, kBf16, kPerTensor, kMxfp8Row, kMxfp8Col, kBlock, kNvfp4 };
  Kind kind = Kind::kF32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  const float* table = nullptr;  // FP8 decode table
  float scale = 0.0f;            // per-tensor scale_inv
  const uint8_t* e8 = nullptr;   // MXFP8 scales
  const float* block = nullptr;  // block scales
  int64_t scols = 0;             // columns of the scale matrix
  int64_t rdiv = 1;              // block rows (1 or 128)
  float gds = 0.0f;              // NVFP4 global decode scale (e4m3 block codes in e8)
  bool canonical = true;         // stored = canonical [n, K]; else stored = canonical^T
};

// The stored matrix of the copy of its operand that `side` reads (gemm_cpu_pack.cc).
StoredView stored_view(const GemmSide& side);

// Packs the canonical matrix [n, K] of `v` into panels of `w` rows (gemm_cpu_pack.cc states the
// layout).
void pack_panels(const StoredView& v, int64_t n, int64_t K, int w, float* dst, float* row,
                 bool avx2);

// Runs a validated problem with a float32 or bfloat16 output on the CPU (gemm_cpu_kernel.cc):
// the packed, register-tiled product in the summation order stated in gemm.cc.
void gemm_cpu(const GemmProblem& p, Tensor& out, const GemmOptions& options);

}  // namespace meshproof::kernels::detail
