// Label cpu: the host logic of the CUDA GEMM path (kernels/gemm/cublaslt_plan.h, cublaslt_layout.h,
// cublaslt_resources.h), proven without a device: the path decision for every recipe operand pair,
// the algorithm-cache key and cache, alignment from a pointer, the heuristic failure message, the
// per-stream resource table, and the scale layouts against independent constructions.
#include "kernels/gemm/cublaslt_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <unordered_set>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/gemm/cublaslt_layout.h"
#include "kernels/gemm/cublaslt_resources.h"
#include "kernels/quantize/quantize.h"

namespace meshproof::kernels::lt {
namespace {

PathOperand hp(DType d) { return PathOperand{false, ScalingMode::kCurrentTensor, d}; }
PathOperand q(ScalingMode m, DType f = DType::kE4M3) { return PathOperand{true, m, f}; }

constexpr int kLt13 = 130100;  // the CUDA 13 cuBLASLt of this build machine's headers

PathDecision decide(PathOperand a, PathOperand b, int cc, int version = kLt13, int64_t r = 256,
                    int64_t s = 128, int64_t k = 384) {
  return choose_gemm_path(PathQuery{a, b, cc, version, r, s, k});
}

TEST(CublasLtPath, CpuIsAlwaysTheEmulation) {
  const PathDecision d = decide(hp(DType::kBFloat16), hp(DType::kBFloat16), 0);
  EXPECT_EQ(d.path, GemmPath::kCpu);
  EXPECT_EQ(d.emulation, "CPU emulation");
}

TEST(CublasLtPath, HighPrecision) {
  EXPECT_EQ(decide(hp(DType::kFloat32), hp(DType::kFloat32), 90).path, GemmPath::kNativeDirect);
  EXPECT_EQ(decide(hp(DType::kBFloat16), hp(DType::kBFloat16), 80).path, GemmPath::kNativeDirect);
  // bf16 x fp32 widens to fp32 exactly: an fp32 GEMM, nothing emulated.
  const PathDecision d = decide(hp(DType::kBFloat16), hp(DType::kFloat32), 90);
  EXPECT_EQ(d.path, GemmPath::kEmulatedF32);
  EXPECT_TRUE(d.native());
}

TEST(CublasLtPath, PerTensor) {
  const PathOperand e4 = q(ScalingMode::kCurrentTensor),
                    e5 = q(ScalingMode::kDelayedTensor, DType::kE5M2);
  PathDecision d = decide(e5, e4, 89);
  EXPECT_EQ(d.path, GemmPath::kNativeScaled);
  EXPECT_EQ(d.a_scale, ScaleMode::kScalar32F);
  EXPECT_EQ(d.b_scale, ScaleMode::kScalar32F);
  d = decide(e4, e4, 80);
  EXPECT_EQ(d.path, GemmPath::kEmulatedF32);
  EXPECT_EQ(d.emulation, "per-tensor FP8 as fp32 GEMMs below sm_89");
  d = decide(e5, e5, 90);
  EXPECT_EQ(d.path, GemmPath::kEmulatedF32);
  EXPECT_NE(d.emulation.find("e5m2 x e5m2"), std::string::npos);
}

TEST(CublasLtPath, Mxfp8) {
  const PathOperand mx = q(ScalingMode::kMxfp8);
  EXPECT_EQ(decide(mx, mx, 100).a_scale, ScaleMode::kVec32Ue8m0);
  EXPECT_EQ(decide(mx, mx, 103).path, GemmPath::kNativeScaled);
  EXPECT_EQ(decide(mx, mx, 90).emulation, "MXFP8 as bf16 GEMMs below sm_100");
  EXPECT_EQ(decide(mx, mx, 90).path, GemmPath::kEmulatedBf16);
  EXPECT_EQ(decide(mx, mx, 120).emulation, "MXFP8 as bf16 GEMMs outside sm_10x");
  EXPECT_EQ(decide(mx, mx, 100, 120700).emulation, "MXFP8 as bf16 GEMMs (cuBLASLt 120700 < 12.8)");
}

TEST(CublasLtPath, BlockScalingOnSm90) {
  const PathOperand v = q(ScalingMode::kBlock1x128), t = q(ScalingMode::kBlock128x128);
  // The three combinations cuBLASLt supports, each operand's mode kept.
  PathDecision d = decide(v, v, 90);
  EXPECT_EQ(d.path, GemmPath::kNativeScaled);
  EXPECT_EQ(d.a_scale, ScaleMode::kVec128_32F);
  EXPECT_EQ(d.b_scale, ScaleMode::kVec128_32F);
  d = decide(v, t, 90);
  EXPECT_TRUE(d.native());
  EXPECT_EQ(d.a_scale, ScaleMode::kVec128_32F);
  EXPECT_EQ(d.b_scale, ScaleMode::kBlk128x128_32F);
  d = decide(t, v, 90);
  EXPECT_TRUE(d.native());
  EXPECT_EQ(d.a_scale, ScaleMode::kBlk128x128_32F);
  EXPECT_EQ(d.b_scale, ScaleMode::kVec128_32F);
  // 2D x 2D: no cuBLASLt mode, the exact emulation.
  d = decide(t, t, 90);
  EXPECT_EQ(d.path, GemmPath::kEmulatedF32);
  EXPECT_NE(d.emulation.find("no 2D x 2D mode"), std::string::npos);
  // Older cuBLASLt, other devices, shapes the native kernels do not take.
  EXPECT_EQ(decide(v, t, 90, 120800).emulation,
            "block scaling as dequantized fp32 GEMMs (cuBLASLt 120800 < 12.9)");
  EXPECT_EQ(decide(v, t, 100).emulation, "block scaling as dequantized fp32 GEMMs");
  EXPECT_EQ(decide(v, t, 89).emulation, "block scaling as dequantized fp32 GEMMs");
  d = decide(v, t, 90, kLt13, 256, 128, 200);  // K not a multiple of 128
  EXPECT_EQ(d.path, GemmPath::kEmulatedF32);
  EXPECT_NE(d.emulation.find("[R, S, K] = [256, 128, 200]"), std::string::npos);
  EXPECT_FALSE(decide(v, t, 90, kLt13, 250, 128, 384).native());  // R not a multiple of 16
  EXPECT_FALSE(decide(v, v, 90, kLt13, 256, 120, 384).native());  // S not a multiple of 16
  // Block with any other kind: mixed operands, emulated.
  EXPECT_EQ(decide(v, q(ScalingMode::kCurrentTensor), 90).emulation,
            "mixed operand kinds as dequantized fp32 GEMMs");
}

TEST(CublasLtPath, Nvfp4) {
  const PathOperand f = q(ScalingMode::kNvfp4, DType::kE2M1);
  PathDecision d = decide(f, f, 100, kLt13, 64, 96, 128);
  EXPECT_EQ(d.path, GemmPath::kNativeScaled);
  EXPECT_EQ(d.a_scale, ScaleMode::kVec16Ue4m3);
  EXPECT_EQ(d.b_scale, ScaleMode::kVec16Ue4m3);
  EXPECT_EQ(decide(f, f, 90).emulation, "NVFP4 as dequantized fp32 GEMMs");
  EXPECT_EQ(decide(f, f, 120).emulation, "NVFP4 as dequantized fp32 GEMMs");
  EXPECT_FALSE(decide(f, f, 100, 120700).native());
  // Multiples of 16 (the recipe's rule) but not of 32: the emulation.
  d = decide(f, f, 100, kLt13, 48, 96, 128);
  EXPECT_EQ(d.path, GemmPath::kEmulatedF32);
  EXPECT_NE(d.emulation.find("multiples of 32"), std::string::npos);
}

AlgoKey sample_key() {
  AlgoKey k;
  k.device = 1;
  k.m = 128, k.n = 256, k.k = 384;
  k.type_a = 28, k.type_b = 28, k.type_c = 0;
  k.compute = 68;
  k.trans_a = 1, k.trans_b = 0;
  k.lda = 384, k.ldb = 384, k.ldc = 128;
  k.align_a = 256, k.align_b = 16, k.align_c = 256, k.align_d = 256;
  k.scale_a = 5, k.scale_b = 4;
  k.epilogue = 1;
  k.fast_accum = 0;
  k.workspace = 32u << 20;
  return k;
}

TEST(CublasLtAlgoKey, EveryFieldTakesPart) {
  const AlgoKey base = sample_key();
  AlgoKey same = sample_key();
  EXPECT_EQ(base, same);
  EXPECT_EQ(AlgoKeyHash{}(base), AlgoKeyHash{}(same));
  // Changing any one field makes a different key (and, for these, a different hash: FNV-1a over
  // the fields, so a one-field change flips the hash with overwhelming probability; asserted for
  // these values).
  std::vector<AlgoKey> variants;
  auto vary = [&](auto change) {
    AlgoKey k = base;
    change(k);
    variants.push_back(k);
  };
  vary([](AlgoKey& k) { k.device = 0; });
  vary([](AlgoKey& k) { k.m = 129; });
  vary([](AlgoKey& k) { k.n = 255; });
  vary([](AlgoKey& k) { k.k = 512; });
  vary([](AlgoKey& k) { k.type_a = 29; });
  vary([](AlgoKey& k) { k.type_b = 29; });
  vary([](AlgoKey& k) { k.type_c = 14; });
  vary([](AlgoKey& k) { k.compute = 77; });
  vary([](AlgoKey& k) { k.trans_a = 0; });
  vary([](AlgoKey& k) { k.trans_b = 1; });
  vary([](AlgoKey& k) { k.lda = 400; });
  vary([](AlgoKey& k) { k.ldb = 400; });
  vary([](AlgoKey& k) { k.ldc = 144; });
  vary([](AlgoKey& k) { k.align_a = 128; });
  vary([](AlgoKey& k) { k.align_b = 8; });
  vary([](AlgoKey& k) { k.align_c = 64; });
  vary([](AlgoKey& k) { k.align_d = 64; });
  vary([](AlgoKey& k) { k.scale_a = 4; });
  vary([](AlgoKey& k) { k.scale_b = 5; });
  vary([](AlgoKey& k) { k.epilogue = 2; });
  vary([](AlgoKey& k) { k.fast_accum = 1; });
  vary([](AlgoKey& k) { k.workspace = 0; });
  std::unordered_set<AlgoKey, AlgoKeyHash> set{base};
  std::set<size_t> hashes{AlgoKeyHash{}(base)};
  for (const AlgoKey& k : variants) {
    EXPECT_FALSE(k == base);
    EXPECT_TRUE(set.insert(k).second);
    hashes.insert(AlgoKeyHash{}(k));
  }
  EXPECT_EQ(set.size(), variants.size() + 1);
  EXPECT_EQ(hashes.size(), variants.size() + 1);
}

TEST(CublasLtAlgoCache, RunsTheHeuristicOncePerKey) {
  AlgoCache cache;
  const AlgoKey k = sample_key();
  EXPECT_FALSE(cache.find(k).has_value());  // a miss: the caller runs the heuristic
  const AlgoBlob algo{1, 2, 3, 4, 5, 6, 7, 8};
  cache.store(k, algo);
  for (int i = 0; i < 3; ++i) {
    const std::optional<AlgoBlob> hit = cache.find(k);
    ASSERT_TRUE(hit.has_value());
    EXPECT_EQ(*hit, algo);
  }
  AlgoKey other = k;
  other.align_b = 8;  // the same shape at a worse alignment is another key
  EXPECT_FALSE(cache.find(other).has_value());
  const LtAlgoCacheStats st = cache.stats();
  EXPECT_EQ(st.hits, 3);
  EXPECT_EQ(st.misses, 2);
  EXPECT_EQ(st.entries, 1);
}

TEST(CublasLtAlignment, LargestPowerOfTwoUpTo256) {
  EXPECT_EQ(address_alignment(0), 256u);
  EXPECT_EQ(address_alignment(0x7f0000001000u), 256u);
  EXPECT_EQ(address_alignment(0x7f0000001080u), 128u);
  EXPECT_EQ(address_alignment(0x7f0000001010u), 16u);
  EXPECT_EQ(address_alignment(0x7f0000001030u), 16u);
  EXPECT_EQ(address_alignment(0x7f0000001008u), 8u);
  EXPECT_EQ(address_alignment(0x7f0000001002u), 2u);
  EXPECT_EQ(address_alignment(0x7f0000001001u), 1u);
  alignas(256) static unsigned char buf[512];
  EXPECT_EQ(pointer_alignment(buf), 256u);
  EXPECT_EQ(pointer_alignment(buf + 48), 16u);
  EXPECT_EQ(pointer_alignment(buf + 3), 1u);
  // Exhaustively against the definition for the low 4096 addresses.
  for (uintptr_t a = 1; a < 4096; ++a) {
    const uint32_t got = address_alignment(a);
    EXPECT_EQ(a % got, 0u);
    EXPECT_TRUE(got == 256u || a % (2 * got) != 0) << a;
  }
}

TEST(CublasLtFailure, MessageNamesEverything) {
  LtFailure f;
  f.role = "wgrad";
  f.r = 384, f.s = 1024, f.k = 4096;
  f.a_dtype = "e4m3", f.b_dtype = "e5m2", f.out_dtype = "float32";
  f.trans_a = 'T', f.trans_b = 'N';
  f.align_a = 16, f.align_b = 256, f.align_c = 8;
  f.scale_a = ScaleMode::kVec128_32F, f.scale_b = ScaleMode::kBlk128x128_32F;
  f.compute_capability = 90;
  f.cublaslt_version = 130100;
  f.status = "CUBLAS_STATUS_NOT_SUPPORTED";
  EXPECT_EQ(describe_lt_failure(f),
            "gemm_wgrad: cuBLASLt found no algorithm (CUBLAS_STATUS_NOT_SUPPORTED) for [R, S, K] "
            "= [384, 1024, 4096]: A e4m3 (VEC128_32F scales, aligned 16 B) x B e5m2 "
            "(BLK128x128_32F scales, aligned 256 B) -> float32 (aligned 8 B), cuBLASLt ops TN on "
            "sm_90 with cuBLASLt 130100");
  f.scale_a = f.scale_b = ScaleMode::kNone;
  EXPECT_NE(describe_lt_failure(f).find("A e4m3 (no scales, aligned 16 B)"), std::string::npos);
}

TEST(CublasLtResources, TablePerDeviceAndStream) {
  StreamResourceTable t;
  int s1 = 0, s2 = 0;  // stand-ins for two cudaStream_t values
  t.insert({0, &s1, &s1, nullptr, 32 << 20});
  t.insert({0, &s2, &s2, nullptr, 32 << 20});
  t.insert({1, nullptr, &s1, nullptr, 32 << 20});  // the null stream of device 1
  t.insert({0, nullptr, &s2, nullptr, 16 << 20});  // and of device 0
  EXPECT_EQ(t.size(), 4u);
  EXPECT_EQ(t.bytes(0), (32 << 20) * 2 + (16 << 20));
  EXPECT_EQ(t.bytes(1), 32 << 20);
  EXPECT_EQ(t.bytes(2), 0);
  ASSERT_NE(t.find(0, &s1), nullptr);
  EXPECT_EQ(t.find(1, &s1), nullptr);
  EXPECT_THROW(t.insert({0, &s1, nullptr, nullptr, 1}), Error);  // one handle per stream
  const std::vector<StreamResources> gone = t.take(&s1);
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].stream, &s1);
  EXPECT_EQ(t.find(0, &s1), nullptr);
  EXPECT_EQ(t.bytes(0), (32 << 20) + (16 << 20));
  EXPECT_TRUE(t.take(&s1).empty());       // released twice: nothing left
  EXPECT_EQ(t.take(nullptr).size(), 2u);  // the null stream on both devices
  EXPECT_EQ(t.size(), 1u);
  EXPECT_EQ(t.bytes(1), 0);
}

TEST(CublasLtResources, NoDeviceHoldsNothing) {
  EXPECT_EQ(cublaslt_reserved_bytes(Device::cpu()), 0);
  release_stream_resources(nullptr);  // nothing made for it: a no-op, never a throw
}

// ---- scale layouts, each against an independent construction in storage order ----

// A random source scale matrix [rows, cols] (row-major) with distinct values.
std::vector<float> distinct(int64_t rows, int64_t cols) {
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f + static_cast<float>(i);
  std::shuffle(v.begin(), v.end(), std::mt19937(static_cast<unsigned>(rows * 131 + cols)));
  return v;
}

TEST(CublasLtLayout, Vec128IsOuterContiguousPaddedToFour) {
  for (int64_t outer : {1, 3, 4, 5, 16, 130, 257}) {
    for (int64_t kb : {1, 2, 3, 7}) {
      const std::vector<float> src = distinct(outer, kb);  // [outer, kb] as stored
      // Scatter through the index function (what the device kernel does).
      std::vector<float> got(static_cast<size_t>(vec128_scale_elems(outer, kb)), 0.0f);
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t b = 0; b < kb; ++b) got[vec128_scale_offset(o, b, outer)] = src[o * kb + b];
      // Storage order written out: for each K block, the outer index 0..roundup(outer,4)-1.
      std::vector<float> want;
      const int64_t o4 = (outer + 3) / 4 * 4;
      for (int64_t b = 0; b < kb; ++b)
        for (int64_t o = 0; o < o4; ++o) want.push_back(o < outer ? src[o * kb + b] : 0.0f);
      EXPECT_EQ(got, want) << outer << " x " << kb;
    }
  }
}

TEST(CublasLtLayout, Blk128IsKContiguousPaddedToFour) {
  for (int64_t outer : {1, 128, 129, 300}) {
    for (int64_t kb : {1, 3, 4, 5, 9}) {
      const int64_t ob = (outer + 127) / 128;
      const std::vector<float> src = distinct(ob, kb);  // [ceil(outer/128), kb] as stored
      std::vector<float> got(static_cast<size_t>(blk128_scale_elems(outer, kb)), 0.0f);
      for (int64_t t = 0; t < ob; ++t)
        for (int64_t b = 0; b < kb; ++b) got[blk128_scale_offset(t, b, kb)] = src[t * kb + b];
      std::vector<float> want;
      const int64_t kb4 = (kb + 3) / 4 * 4;
      for (int64_t t = 0; t < ob; ++t)
        for (int64_t b = 0; b < kb4; ++b) want.push_back(b < kb ? src[t * kb + b] : 0.0f);
      EXPECT_EQ(got, want) << outer << " x " << kb;
    }
  }
}

// The 128x4 swizzle against the layout built tile by tile in storage order (cuBLASLt's
// documented 512-byte tile: 32 lines of 16 bytes, line i holding rows i, i+32, i+64, i+96 of the
// tile, 4 scale columns each).
TEST(CublasLtLayout, Swizzle128x4MatchesTileConstruction) {
  for (int64_t rows : {1, 32, 128, 160, 300}) {
    for (int64_t cols : {1, 4, 6, 9}) {
      std::vector<uint8_t> src(static_cast<size_t>(rows * cols));
      for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(1 + i % 251);
      const int64_t n = swizzled_128x4_bytes(rows, cols);
      std::vector<uint8_t> got(static_cast<size_t>(n), 0);
      std::vector<int> hits(static_cast<size_t>(n), 0);
      const int64_t prow = (rows + 127) / 128 * 128, pcol = (cols + 3) / 4 * 4;
      for (int64_t r = 0; r < prow; ++r)
        for (int64_t c = 0; c < pcol; ++c) {
          const int64_t off = swizzled_128x4_offset(r, c, cols);
          ASSERT_GE(off, 0);
          ASSERT_LT(off, n);
          ++hits[static_cast<size_t>(off)];
          got[static_cast<size_t>(off)] = (r < rows && c < cols) ? src[r * cols + c] : 0;
        }
      EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }))
          << "not a bijection for " << rows << " x " << cols;
      std::vector<uint8_t> want;
      for (int64_t tr = 0; tr < prow / 128; ++tr)
        for (int64_t tc = 0; tc < pcol / 4; ++tc)
          for (int64_t line = 0; line < 32; ++line)
            for (int64_t group = 0; group < 4; ++group)
              for (int64_t c4 = 0; c4 < 4; ++c4) {
                const int64_t r = tr * 128 + group * 32 + line, c = tc * 4 + c4;
                want.push_back((r < rows && c < cols) ? src[r * cols + c] : 0);
              }
      EXPECT_EQ(got, want) << rows << " x " << cols;
    }
  }
}

// The same index function against the quantizer's own CPU MXFP8 swizzle
// (kernels/quantize/quantize.h mxfp8_pad_scales + mxfp8_swizzle_scales, written independently), for
// the rowwise copy: S[r, c] = scale[r, c].
TEST(CublasLtLayout, Swizzle128x4MatchesQuantizerMxfp8Swizzle) {
  const int64_t m = 160, k = 192;  // partial 128-row tile, partial 4-column tile (k/32 = 6)
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::vector<float> v(static_cast<size_t>(m * k));
  for (auto& x : v) x = nd(rng);
  const QuantizedTensor qt =
      quantize_mxfp8(Tensor::from_vector<float>(Shape{m, k}, v), DType::kE4M3, Usage{true, false});
  const Tensor want_t = mxfp8_swizzle_scales(
      mxfp8_pad_scales(qt.rowwise_scale_inv, QuantizedCopy::kRowwise), QuantizedCopy::kRowwise);
  const auto* compact = static_cast<const uint8_t*>(qt.rowwise_scale_inv.raw_data());
  const int64_t cols = k / 32;
  std::vector<uint8_t> got(static_cast<size_t>(swizzled_128x4_bytes(m, cols)), 0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < cols; ++c)
      got[static_cast<size_t>(swizzled_128x4_offset(r, c, cols))] = compact[r * cols + c];
  const auto* w = static_cast<const uint8_t*>(want_t.raw_data());
  ASSERT_EQ(want_t.nbytes().value, static_cast<int64_t>(got.size()));
  EXPECT_EQ(got, std::vector<uint8_t>(w, w + got.size()));
}

}  // namespace
}  // namespace meshproof::kernels::lt
