// CPU GEMM operand decode and packing (docs/design.md sections 4 and 21): the exact fp32 decode of
// every operand format (the FP8 code and E8M0 power-of-two tables; per-tensor, MXFP8, block and
// NVFP4 scales; bf16 widened), the stored view of the copy a role reads, and the packing of a
// canonical [n, K] matrix into the micro-kernel's panels of w rows, transposing on the way (8 x 8
// AVX2 register blocks where the AVX2 kernel runs). Exact decodes and pure data movement: every
// packed element is the operand's exact fp32 value, so packing never changes a bit of the product
// (gemm.cc states the summation-order contract; gemm_cpu_kernel.cc multiplies the panels).
#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

#include "kernels/core/formats.h"
#include "kernels/gemm/gemm_cpu_internal.h"
#include "kernels/gemm/gemm_internal.h"
#include "kernels/quantize/nvfp4_rules.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace meshproof::kernels {

namespace {

using detail::StoredView;

// ---- exact element decodes (kernels/core/formats.h, shared bit for bit with the CUDA kernels)
// ----

float decode_fp8(DType format, uint8_t b) {
  return format == DType::kE4M3 ? fmt8::e4m3_to_float(b) : fmt8::e5m2_to_float(b);
}

// Exact fp32 value of every FP8 code (NaN codes decode to the format's NaN, as formats.h does).
struct Fp8Table {
  float v[256];
};
Fp8Table make_fp8_table(DType format) {
  Fp8Table t{};
  for (int b = 0; b < 256; ++b) t.v[b] = decode_fp8(format, static_cast<uint8_t>(b));
  return t;
}
}  // namespace

namespace detail {
const float* fp8_decode_table(DType format) {
  static const Fp8Table e4m3 = make_fp8_table(DType::kE4M3);
  static const Fp8Table e5m2 = make_fp8_table(DType::kE5M2);
  return format == DType::kE4M3 ? e4m3.v : e5m2.v;
}

const float* e8m0_pow2_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int e = 0; e < 255; ++e)
      t[e] = e == 0 ? fmt8::bits_float(0x00400000u) : fmt8::bits_float(uint32_t(e) << 23);
    t[255] = std::numeric_limits<float>::quiet_NaN();
    return t;
  }();
  return table.data();
}
}  // namespace detail

namespace {

using detail::e8m0_pow2_table;
const float* fp8_table(DType format) { return detail::fp8_decode_table(format); }

// Decodes stored row `r` (all `cols` elements) to fp32: the exact values of the previous decode
// (fp32 copied, bf16 widened, fp8 value times the fp32 scale_inv, fp8 value times 2^(e-127)).
void decode_stored_row(const StoredView& v, int64_t r, float* out) {
  const int64_t n = v.cols;
  const auto* codes = static_cast<const uint8_t*>(v.data) + r * n;
  switch (v.kind) {
    case StoredView::Kind::kF32:
      std::memcpy(out, static_cast<const float*>(v.data) + r * n, static_cast<size_t>(n) * 4);
      return;
    case StoredView::Kind::kBf16: {
      const auto* h = static_cast<const uint16_t*>(v.data) + r * n;
      for (int64_t c = 0; c < n; ++c) out[c] = fmt8::bf16_to_float(h[c]);
      return;
    }
    case StoredView::Kind::kPerTensor: {
      const float s = v.scale;
      for (int64_t c = 0; c < n; ++c) out[c] = v.table[codes[c]] * s;
      return;
    }
    case StoredView::Kind::kMxfp8Row:
    case StoredView::Kind::kMxfp8Col: {
      // Row r's scales: one per 32 columns (rowwise copy) or one per column (columnwise copy).
      const bool row_blocks = v.kind == StoredView::Kind::kMxfp8Row;
      const uint8_t* e = row_blocks ? v.e8 + r * v.scols : v.e8 + (r / 32) * v.scols;
      const float* p2 = e8m0_pow2_table();
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int64_t c = 0; c < n; ++c) {
        const uint8_t ec = row_blocks ? e[c / 32] : e[c];
        out[c] = ec == 0xFF ? nan : v.table[codes[c]] * p2[ec];
      }
      return;
    }
    case StoredView::Kind::kBlock: {
      const float* s = v.block + (r / v.rdiv) * v.scols;
      for (int64_t c = 0; c < n; ++c) out[c] = v.table[codes[c]] * s[c / 128];
      return;
    }
    case StoredView::Kind::kNvfp4: {
      // The quantizer's decode (kernels/quantize/nvfp4_rules.h): fp32(fp32(e2m1 * dec) * gds).
      const auto* packed = static_cast<const uint8_t*>(v.data) + r * n / 2;
      const uint8_t* dec = v.e8 + r * v.scols;
      // rules::nvfp4::decode per element, its block's scale decoded once per 16 elements.
      for (int64_t c0 = 0; c0 < n; c0 += 16) {
        const float d = fmt8::e4m3_to_float(dec[c0 / 16]);
        for (int64_t c = c0; c < std::min(n, c0 + 16); ++c) {
          const uint8_t b = packed[c / 2];
          const auto code = static_cast<uint8_t>((c & 1) ? b >> 4 : b & 0xFu);
          out[c] = (fmt8::e2m1_to_float(code) * d) * v.gds;
        }
      }
      return;
    }
  }
}

// Stored row `r` of `v` in fp32: an fp32 row in place, any other decoded into `row`.
const float* stored_row(const StoredView& v, int64_t r, float* row) {
  if (v.kind == StoredView::Kind::kF32) return static_cast<const float*>(v.data) + r * v.cols;
  decode_stored_row(v, r, row);
  return row;
}

#if defined(__x86_64__) || defined(__i386__)
// dst[j * ldd + i] = src[i][k + j] for i, j < 8: an 8 x 8 block of fp32 transposed in registers
// (pure data movement: the same bits as the scalar loop).
__attribute__((target("avx2"))) void transpose_8x8(const float* const* src, int64_t k, float* dst,
                                                   int64_t ldd) {
  const __m256 r0 = _mm256_loadu_ps(src[0] + k), r1 = _mm256_loadu_ps(src[1] + k);
  const __m256 r2 = _mm256_loadu_ps(src[2] + k), r3 = _mm256_loadu_ps(src[3] + k);
  const __m256 r4 = _mm256_loadu_ps(src[4] + k), r5 = _mm256_loadu_ps(src[5] + k);
  const __m256 r6 = _mm256_loadu_ps(src[6] + k), r7 = _mm256_loadu_ps(src[7] + k);
  // Pairs of rows interleaved, then pairs of pairs: lane l of 128-bit half h of u_c holds row
  // 4 h' + l's column ... (the standard unpack / shuffle / permute2f128 transpose).
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * ldd, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

}  // namespace

namespace detail {

StoredView stored_view(const GemmSide& side) {
  StoredView v;
  if (const auto* tp = std::get_if<const Tensor*>(&side.op)) {
    const Tensor& t = **tp;
    v.kind = t.dtype() == DType::kFloat32 ? StoredView::Kind::kF32 : StoredView::Kind::kBf16;
    v.data = t.raw_data();
    v.rows = t.shape().leading();
    v.cols = t.shape().last();
    v.canonical = !side.transposed;
    return v;
  }
  const QuantizedTensor& q = *std::get<const QuantizedTensor*>(side.op);
  const Tensor& data = side.transposed ? q.columnwise_data : q.rowwise_data;
  const Tensor& sinv = side.transposed ? q.columnwise_scale_inv : q.rowwise_scale_inv;
  v.data = data.raw_data();
  v.rows = data.shape().leading();
  v.cols = data.shape().last();
  v.table = fp8_table(q.format);
  // Per-tensor and block columnwise copies are stored transposed already (= canonical); the
  // MXFP8 columnwise copy is stored in the logical layout and transposed while packing.
  v.canonical = !(side.transposed && q.mode == ScalingMode::kMxfp8);
  switch (q.mode) {
    case ScalingMode::kDelayedTensor:
    case ScalingMode::kCurrentTensor:
      v.kind = StoredView::Kind::kPerTensor;
      v.scale = *sinv.data<float>();
      break;
    case ScalingMode::kMxfp8:
      v.kind = side.transposed ? StoredView::Kind::kMxfp8Col : StoredView::Kind::kMxfp8Row;
      v.e8 = static_cast<const uint8_t*>(sinv.raw_data());
      v.scols = sinv.shape()[1];
      break;
    case ScalingMode::kBlock1x128:
    case ScalingMode::kBlock128x128:
      v.kind = StoredView::Kind::kBlock;
      v.block = sinv.data<float>();
      v.scols = sinv.shape()[1];
      v.rdiv = q.mode == ScalingMode::kBlock1x128 ? 1 : 128;
      break;
    case ScalingMode::kNvfp4: {
      // Both copies are stored K-major (rowwise [M, K], columnwise the transpose), packed two
      // codes per byte; the block codes sit where MXFP8's e8m0 scales do.
      namespace nv = rules::nvfp4;
      const Tensor& amax = side.transposed ? q.columnwise_amax : q.amax;
      v.kind = StoredView::Kind::kNvfp4;
      v.e8 = static_cast<const uint8_t*>(sinv.raw_data());
      v.scols = sinv.shape()[1];
      v.gds = nv::global_decode_scale(nv::global_encode_scale(*amax.data<float>()));
      break;
    }
  }
  return v;
}

// Packs the canonical matrix [n, K] of `v` into panels of `w` rows (rows >= n zero): panel p
// starts at dst + p * K * w and holds element (p * w + i, k) at [k * w + i]. `avx2`: full panels
// of a multiple of 8 rows are transposed in 8 x 8 register blocks (the AVX2 GEMM kernel's packing;
// the portable kernel's is the scalar loop, so forcing it tests that loop).
void pack_panels(const StoredView& v, int64_t n, int64_t K, int w, float* dst, float* row,
                 bool avx2) {
  const int64_t panels = (n + w - 1) / w;
  if (v.canonical) {  // stored [n, K]: a transpose, the panel written in order
    // `row` holds w decoded rows ([w, K]); an fp32 row is read in place. Reading the panel's w
    // rows column by column (w read streams) writes the panel contiguously; a row at a time wrote
    // one float per cache line across the whole panel (K * w * 4 bytes: 64 KiB at K = 1024), which
    // made this pack most of the driver's time when a virtual rank multiplies few rows by a whole
    // weight.
    const float* src[kNr > kMr ? kNr : kMr];
    MP_CHECK(w > 0 && w <= static_cast<int>(std::size(src)), "gemm: panels of {} rows (at most {})",
             w, std::size(src));
    for (int64_t p = 0; p < panels; ++p) {
      float* panel = dst + p * K * w;
      const int live = static_cast<int>(std::min<int64_t>(w, n - p * w));
      for (int i = 0; i < live; ++i) src[i] = stored_row(v, p * w + i, row + i * K);
      int64_t k = 0;
#if defined(__x86_64__) || defined(__i386__)
      if (avx2 && live == w && w % 8 == 0)
        for (; k + 8 <= K; k += 8)
          for (int h = 0; h < w; h += 8) transpose_8x8(src + h, k, panel + k * w + h, w);
#else
      (void)avx2;
#endif
      for (; k < K; ++k) {
        float* dk = panel + k * w;
        for (int i = 0; i < live; ++i) dk[i] = src[i][k];
        for (int i = live; i < w; ++i) dk[i] = 0.0f;
      }
    }
    return;
  }
  // stored [K, n]: stored row k is column k of the canonical matrix, contiguous in every panel
  for (int64_t k = 0; k < K; ++k) {
    const float* src = stored_row(v, k, row);
    for (int64_t p = 0; p < panels; ++p) {
      float* dk = dst + p * K * w + k * w;
      const int64_t r0 = p * w;
      const int64_t m = std::min<int64_t>(w, n - r0);
      std::memcpy(dk, src + r0, static_cast<size_t>(m) * 4);
      for (int64_t i = m; i < w; ++i) dk[i] = 0.0f;
    }
  }
}

}  // namespace detail

}  // namespace meshproof::kernels
