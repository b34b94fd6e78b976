// CPU reference quantizers and the dispatch to the CUDA launchers (quantize.cu). The CPU loops
// compute, element for element, the scalar rules of quantize_rules.h that the CUDA kernels call
// (the same amax, scales, fp32 multiply and round-to-nearest-even cast), in a vectorisable form
// (docs/design.md section 21): amax as an unsigned max of sign-cleared bits, a branchless fp8
// encoder, per-column running maxima for column blocks, and the transposed copies written by a
// blocked byte transpose of codes cast in row order. Bitwise equal to the element-wise rules
// (tests/kernels/quantize/quantize_fast_test.cc, exhaustively for the encoder).
// Over 600 lines on purpose: one file per op family, and the five recipes' CPU quantizers share
// the encoder, the amax and the transpose blocks defined here (splitting them would export those).
#include "kernels/quantize/quantize.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels/ops/op_util.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/quantize_cuda.h"
#include "kernels/quantize/quantize_internal.h"
#include "kernels/quantize/quantize_rules.h"

namespace meshproof::kernels {

std::string_view scaling_mode_name(ScalingMode m) {
  switch (m) {
    case ScalingMode::kDelayedTensor:
      return "delayed_tensor";
    case ScalingMode::kCurrentTensor:
      return "current_tensor";
    case ScalingMode::kMxfp8:
      return "mxfp8";
    case ScalingMode::kBlock1x128:
      return "block_1x128";
    case ScalingMode::kBlock128x128:
      return "block_128x128";
    case ScalingMode::kNvfp4:
      return "nvfp4";
  }
  MP_FAIL("unknown ScalingMode {}", static_cast<int>(m));
}

std::string_view amax_algo_name(AmaxAlgo a) { return a == AmaxAlgo::kMax ? "max" : "most_recent"; }

namespace {

using rules::QLayout;

bool is_e5m2(DType format) {
  MP_CHECK_INPUT(format == DType::kE4M3 || format == DType::kE5M2,
                 "quantization format must be e4m3 or e5m2, got {}", dtype_name(format));
  return format == DType::kE5M2;
}

void check_scalar(const Tensor& t, const Tensor& x, std::string_view what) {
  MP_CHECK_INPUT(t.defined() && t.dtype() == DType::kFloat32 && t.numel().value == 1,
                 "{} must be float32[1], got {}", what, t.defined() ? t.describe() : "undefined");
  MP_CHECK_INPUT(!x.defined() || t.device() == x.device(), "{} {} is not on the input's device {}",
                 what, t.describe(), x.device().str());
}

// The CUDA launchers exist only when the backend is compiled; MP_CUDA_DISPATCH keeps the dispatch
// readable in both builds.
#if MESHPROOF_HAVE_CUDA
#define MP_CUDA_DISPATCH(call) cuda::call
#else
#define MP_CUDA_DISPATCH(call) detail::no_cuda_backend("quantize")
#endif

// ---- vectorisable CPU building blocks (bitwise equal to the rules:: element loops) ----------

// fp8 code of v (e4m3 when !kE5m2), equal to fmt8::float_to_e4m3 / float_to_e5m2 for every fp32
// input, in integer arithmetic without branches (so that it vectorises: a conditional fp32 op
// would not be if-converted under -ftrapping-math). Normal targets round to nearest even on the
// dropped mantissa bits with the exponent rebased (a carry correctly bumps the exponent);
// subnormal targets shift the significand right by a per-element amount with the same rounding;
// then saturation and NaN.
template <bool kE5m2>
inline __attribute__((always_inline)) uint8_t encode_fp8(float v) {
  constexpr uint32_t kMbits = kE5m2 ? 2 : 3;
  constexpr uint32_t kBias = kE5m2 ? 15 : 7;
  constexpr uint32_t kMaxCode = kE5m2 ? 0x7B : 0x7E;
  constexpr uint32_t kShift = 23 - kMbits;
  constexpr uint32_t kMinNormal = (127 - kBias + 1) << 23;  // bits of 2^(1-bias)
  constexpr uint32_t kRebase = (127 - kBias) << 23;
  const uint32_t u = fmt8::float_bits(v);
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t normal =
      (a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u) - kRebase) >> kShift;
  // Subnormal target: value = sig * 2^(e - 150) with e the (at least 1) biased exponent; the
  // code is sig / 2^(1 - bias - mbits + 150 - e) rounded to nearest even. The shift is >= 21
  // where this result is used; capped at 31, where every sig < 2^24 rounds to 0 as it must, and
  // kept >= 1 in the lanes whose result is discarded (normal inputs), so no shift is undefined.
  const uint32_t e = a >> 23;
  const uint32_t sig = (a & 0x7FFFFFu) | (e != 0 ? 0x800000u : 0u);
  const uint32_t e1 = e != 0 ? e : 1u;
  const uint32_t sh_raw = (151 - kBias - kMbits) - e1;  // wraps for normal inputs: capped below
  const uint32_t sh_hi = sh_raw < 31u ? sh_raw : 31u;
  const uint32_t sh = sh_hi > 0u ? sh_hi : 1u;
  const uint32_t sub = (sig + ((1u << (sh - 1)) - 1u) + ((sig >> sh) & 1u)) >> sh;
  uint32_t code = a < kMinNormal ? sub : normal;
  code = code > kMaxCode ? kMaxCode : code;
  code = a > 0x7F800000u ? 0x7Fu : code;
  return static_cast<uint8_t>(((u >> 24) & 0x80u) | code);
}

template <bool kBf16>
inline __attribute__((always_inline)) float load_at(const void* x, int64_t i) {
  if constexpr (kBf16) {
    return fmt8::bf16_to_float(static_cast<const uint16_t*>(x)[i]);
  } else {
    return static_cast<const float*>(x)[i];
  }
}

template <bool kBf16>
inline __attribute__((always_inline)) uint32_t amax_loop(const void* x, int64_t base, int64_t n) {
  uint32_t a = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = rules::abs_bits(load_at<kBf16>(x, base + i));
    a = b > a ? b : a;
  }
  return a;
}

// rules::block_amax_bits over the contiguous x[base, base + n).
__attribute__((target_clones("avx2", "default"))) uint32_t amax_contiguous(const void* x, bool bf16,
                                                                           int64_t base,
                                                                           int64_t n) {
  return bf16 ? amax_loop<true>(x, base, n) : amax_loop<false>(x, base, n);
}

template <bool kBf16>
inline __attribute__((always_inline)) void col_amax_loop(const void* x, int64_t base, int64_t n,
                                                         uint32_t* acc) {
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t b = rules::abs_bits(load_at<kBf16>(x, base + k));
    acc[k] = b > acc[k] ? b : acc[k];
  }
}

// acc[k] = max(acc[k], abs_bits(x[base + k])) for k < n: one row of per-column running maxima.
__attribute__((target_clones("avx2", "default"))) void col_amax_row(const void* x, bool bf16,
                                                                    int64_t base, int64_t n,
                                                                    uint32_t* acc) {
  if (bf16) {
    col_amax_loop<true>(x, base, n, acc);
  } else {
    col_amax_loop<false>(x, base, n, acc);
  }
}

template <bool kBf16, bool kE5m2, bool kPerElementMult>
inline __attribute__((always_inline)) void cast_loop(const void* x, int64_t base, int64_t n,
                                                     const float* mult, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float m = kPerElementMult ? mult[i] : mult[0];
    const float v = load_at<kBf16>(x, base + i);
    const uint8_t code = encode_fp8<kE5m2>(v * m);
    // A NaN input keeps its sign even when the multiplier is NaN too (an MXFP8 NaN block): x86
    // returns the first operand's NaN for x * m, and a vectorised multiply may encode the operands
    // in either order, so the element-wise rule is made explicit.
    const uint32_t xb = fmt8::float_bits(v);
    out[i] = (xb & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint8_t>(((xb >> 24) & 0x80u) | 0x7Fu)
                                              : code;
  }
}

// detail::set_quantize_avx2 (tests): false forces the portable cast loop.
std::atomic<bool> g_avx2_allowed{true};

#if defined(__x86_64__)
#define MESHPROOF_QUANTIZE_AVX2 1

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has && g_avx2_allowed.load(std::memory_order_relaxed);
}

// encode_fp8 on 8 lanes (the same integer steps, lane by lane), with cast_loop's NaN-input rule:
// p = v * m, the codes as 8 uint32.
template <bool kE5m2>
__attribute__((target("avx2"))) inline __m256i encode8(__m256 v, __m256 p) {
  constexpr int kMbits = kE5m2 ? 2 : 3;
  constexpr int kBias = kE5m2 ? 15 : 7;
  constexpr int kShift = 23 - kMbits;
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i u = _mm256_castps_si256(p);
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i normal = _mm256_srli_epi32(
      _mm256_sub_epi32(
          _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((1 << (kShift - 1)) - 1)),
                           _mm256_and_si256(_mm256_srli_epi32(a, kShift), one)),
          _mm256_set1_epi32((127 - kBias) << 23)),
      kShift);
  // A subnormal target (|p| below the smallest normal, 2^(1 - bias)): the code is |p| in units of
  // the subnormal step 2^(1 - bias - mbits), rounded to nearest even. Adding C = 2^(24 - bias -
  // mbits), whose ulp is that step, makes the fp32 adder do exactly this rounding (C's mantissa
  // is zero, so the sum's low mantissa bits are the count and its ties go to the even count, in
  // the default round-to-nearest-even mode the whole library assumes), and the count is the
  // difference of the bit patterns: 0 .. 2^mbits, where 2^mbits is also the code of the smallest
  // normal. FTZ/DAZ cannot change it: the sum is near C, and an fp32 subnormal |p| (< 2^-126) is
  // far below half a step, so it gives 0 either way.
  constexpr float kSubnormalBias = static_cast<float>(1 << (24 - kBias - kMbits));
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(kSubnormalBias))),
      _mm256_castps_si256(_mm256_set1_ps(kSubnormalBias)));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((127 - kBias + 1) << 23), a);
  __m256i code = _mm256_blendv_epi8(normal, sub, is_sub);
  code = _mm256_min_epu32(code, _mm256_set1_epi32(kE5m2 ? 0x7B : 0x7E));
  const __m256i nan7f = _mm256_set1_epi32(0x7F);
  const __m256i inf = _mm256_set1_epi32(0x7F800000);
  code = _mm256_blendv_epi8(code, nan7f, _mm256_cmpgt_epi32(a, inf));
  const __m256i sign_mask = _mm256_set1_epi32(0x80);
  code = _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(u, 24), sign_mask));
  const __m256i xb = _mm256_castps_si256(v);
  const __m256i x_nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(xb, _mm256_set1_epi32(0x7FFFFFFF)), inf);
  const __m256i x_code =
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(xb, 24), sign_mask), nan7f);
  return _mm256_blendv_epi8(code, x_code, x_nan);
}

template <bool kBf16>
__attribute__((target("avx2"))) inline __m256 load8(const void* x, int64_t i) {
  if constexpr (kBf16) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  }
}

// cast_loop with explicit AVX2: 32 elements per iteration (four 8-lane encodes packed to bytes),
// the tail through cast_loop. Bitwise equal to it (the same integer steps per lane).
template <bool kBf16, bool kE5m2, bool kPerElementMult>
__attribute__((target("avx2"))) inline void cast_avx2(const void* x, int64_t base, int64_t n,
                                                      const float* mult, uint8_t* out) {
  const __m256 m0 = _mm256_set1_ps(mult[0]);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i c[4];
    for (int q = 0; q < 4; ++q) {
      const __m256 v = load8<kBf16>(x, base + i + 8 * q);
      const __m256 m = kPerElementMult ? _mm256_loadu_ps(mult + i + 8 * q) : m0;
      c[q] = encode8<kE5m2>(v, _mm256_mul_ps(v, m));
    }
    // packus interleaves the 128-bit lanes: dwords come out as elements 0-3, 8-11, 16-19,
    // 24-27, 4-7, 12-15, 20-23, 28-31; the permutation restores the order.
    const __m256i b =
        _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_permutevar8x32_epi32(b, order));
  }
  cast_loop<kBf16, kE5m2, kPerElementMult>(x, base + i, n - i, kPerElementMult ? mult + i : mult,
                                           out + i);
}

template <bool kBf16, bool kE5m2>
__attribute__((target("avx2"))) void cast_blocks_avx2(const void* x, int64_t base, int64_t n,
                                                      int64_t bs, const float* mult, uint8_t* out) {
  for (int64_t b = 0, i = 0; i < n; ++b, i += bs)
    cast_avx2<kBf16, kE5m2, false>(x, base + i, std::min(bs, n - i), mult + b, out + i);
}
#else
#define MESHPROOF_QUANTIZE_AVX2 0
#endif

template <bool kBf16, bool kE5m2, bool kPerElementMult>
void cast_dispatch(const void* x, int64_t base, int64_t n, const float* mult, uint8_t* out) {
#if MESHPROOF_QUANTIZE_AVX2
  if (cpu_has_avx2()) return cast_avx2<kBf16, kE5m2, kPerElementMult>(x, base, n, mult, out);
#endif
  cast_loop<kBf16, kE5m2, kPerElementMult>(x, base, n, mult, out);
}

// out[i] = fp8(x[base + i] * mult[i or 0]) for i < n (rules::cast_block with unit strides; with
// per_element, the multiplier of element i is mult[i]). AVX2 when the CPU has it.
void cast_contiguous(const void* x, bool bf16, int64_t base, int64_t n, const float* mult,
                     bool per_element, bool e5m2, uint8_t* out) {
  const int sel = (bf16 ? 4 : 0) | (e5m2 ? 2 : 0) | (per_element ? 1 : 0);
  switch (sel) {
    case 0:
      return cast_dispatch<false, false, false>(x, base, n, mult, out);
    case 1:
      return cast_dispatch<false, false, true>(x, base, n, mult, out);
    case 2:
      return cast_dispatch<false, true, false>(x, base, n, mult, out);
    case 3:
      return cast_dispatch<false, true, true>(x, base, n, mult, out);
    case 4:
      return cast_dispatch<true, false, false>(x, base, n, mult, out);
    case 5:
      return cast_dispatch<true, false, true>(x, base, n, mult, out);
    case 6:
      return cast_dispatch<true, true, false>(x, base, n, mult, out);
    default:
      return cast_dispatch<true, true, true>(x, base, n, mult, out);
  }
}

// out[b] = rules::block_amax_bits of block b of x[base, base + n), blocks of `bs` elements (the
// last one partial): one call per row instead of one per block.
__attribute__((target_clones("avx2", "default"))) void block_amaxes(const void* x, bool bf16,
                                                                    int64_t base, int64_t n,
                                                                    int64_t bs, uint32_t* out) {
  for (int64_t b = 0, i = 0; i < n; ++b, i += bs) {
    const int64_t len = std::min(bs, n - i);
    out[b] = bf16 ? amax_loop<true>(x, base + i, len) : amax_loop<false>(x, base + i, len);
  }
}

template <bool kBf16, bool kE5m2>
inline __attribute__((always_inline)) void cast_blocks_loop(const void* x, int64_t base, int64_t n,
                                                            int64_t bs, const float* mult,
                                                            uint8_t* out) {
  for (int64_t b = 0, i = 0; i < n; ++b, i += bs)
    cast_loop<kBf16, kE5m2, false>(x, base + i, std::min(bs, n - i), mult + b, out + i);
}

// out[i] = fp8(x[base + i] * mult[i / bs]) for i < n: a row of 1 x bs blocks in one call.
void cast_blocks(const void* x, bool bf16, int64_t base, int64_t n, int64_t bs, const float* mult,
                 bool e5m2, uint8_t* out) {
#if MESHPROOF_QUANTIZE_AVX2
  if (cpu_has_avx2()) {
    if (bf16) {
      if (e5m2) return cast_blocks_avx2<true, true>(x, base, n, bs, mult, out);
      return cast_blocks_avx2<true, false>(x, base, n, bs, mult, out);
    }
    if (e5m2) return cast_blocks_avx2<false, true>(x, base, n, bs, mult, out);
    return cast_blocks_avx2<false, false>(x, base, n, bs, mult, out);
  }
#endif
  if (bf16) {
    if (e5m2) return cast_blocks_loop<true, true>(x, base, n, bs, mult, out);
    return cast_blocks_loop<true, false>(x, base, n, bs, mult, out);
  }
  if (e5m2) return cast_blocks_loop<false, true>(x, base, n, bs, mult, out);
  return cast_blocks_loop<false, false>(x, base, n, bs, mult, out);
}

#if defined(__SSE2__)
// One 16 x 16 byte tile: four rounds of pairwise interleaves (8-, 16-, 32-, 64-bit unpacks) leave
// source column bitreverse4(i) in register i.
void transpose_tile16(const uint8_t* src, int64_t src_stride, uint8_t* dst, int64_t dst_stride) {
  __m128i x[16], t[16];
  for (int i = 0; i < 16; ++i)
    x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * src_stride));
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm_unpacklo_epi8(x[2 * i], x[2 * i + 1]);
    t[i + 8] = _mm_unpackhi_epi8(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm_unpacklo_epi16(t[2 * i], t[2 * i + 1]);
    x[i + 8] = _mm_unpackhi_epi16(t[2 * i], t[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    t[i + 8] = _mm_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm_unpacklo_epi64(t[2 * i], t[2 * i + 1]);
    x[i + 8] = _mm_unpackhi_epi64(t[2 * i], t[2 * i + 1]);
  }
  constexpr int kBitReverse4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  for (int i = 0; i < 16; ++i)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + kBitReverse4[i] * dst_stride), x[i]);
}
#endif

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols: 16 x 16 tiles in
// registers (SSE2), the edges element by element.
void transpose_bytes(const uint8_t* src, int64_t src_stride, int64_t rows, int64_t cols,
                     uint8_t* dst, int64_t dst_stride) {
  int64_t r_full = 0, c_full = 0;
#if defined(__SSE2__)
  r_full = rows / 16 * 16;
  c_full = cols / 16 * 16;
  for (int64_t r0 = 0; r0 < r_full; r0 += 16)
    for (int64_t c0 = 0; c0 < c_full; c0 += 16)
      transpose_tile16(src + r0 * src_stride + c0, src_stride, dst + c0 * dst_stride + r0,
                       dst_stride);
#endif
  for (int64_t r = 0; r < rows; ++r) {  // the right edge (c >= c_full) of every row
    for (int64_t c = c_full; c < cols; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
  }
  for (int64_t c = 0; c < c_full; ++c) {  // the bottom edge (r >= r_full) of the other columns
    for (int64_t r = r_full; r < rows; ++r) dst[c * dst_stride + r] = src[r * src_stride + c];
  }
}

// Per-thread byte scratch for the codes of a band of rows that a transposed copy needs.
uint8_t* scratch_bytes(size_t n) {
  thread_local std::vector<uint8_t> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace

float fp8_max(DType format) { return rules::fp8_max(is_e5m2(format)); }

Tensor compute_amax(const Tensor& x) {
  const bool bf16 = detail::check_quantizer_input(x, "compute_amax");
  Tensor out = Tensor::empty({1}, DType::kFloat32, x.device());
  if (x.device().is_cuda()) {
    MP_CUDA_DISPATCH(
        launch_amax(x.raw_data(), bf16, x.numel().value, out.data<float>(), detail::cuda_stream()));
    return out;
  }
  const uint32_t a = amax_contiguous(x.raw_data(), bf16, 0, x.numel().value);
  out.data<float>()[0] = fmt8::bits_float(a);
  return out;
}

Tensor compute_current_scale(const Tensor& amax, DType format, float eps, bool pow2) {
  check_scalar(amax, Tensor(), "compute_current_scale: amax");
  MP_CHECK_INPUT(eps >= 0.0f, "compute_current_scale: eps must be >= 0, got {}", eps);
  const float max = fp8_max(format);
  Tensor out = Tensor::empty({1}, DType::kFloat32, amax.device());
  if (amax.device().is_cuda()) {
    MP_CUDA_DISPATCH(launch_current_scale(amax.data<float>(), out.data<float>(), max, eps, pow2,
                                          detail::cuda_stream()));
    return out;
  }
  out.data<float>()[0] = rules::current_scale(amax.data<float>()[0], max, eps, pow2);
  return out;
}

DelayedScalingState make_delayed_scaling_state(int64_t history_len, Device device) {
  MP_CHECK_INPUT(history_len >= 1, "delayed scaling: amax history length must be >= 1, got {}",
                 history_len);
  DelayedScalingState s;
  s.scale = Tensor::from_vector<float>({1}, {1.0f}).to(device);
  s.amax_history = Tensor::zeros({history_len}, DType::kFloat32, device);
  return s;
}

void record_amax(DelayedScalingState& state, const Tensor& amax) {
  check_scalar(amax, state.amax_history, "record_amax: amax");
  float* hist = state.amax_history.data<float>();
  if (amax.device().is_cuda()) {
    MP_CUDA_DISPATCH(launch_record_amax(hist, amax.data<float>(), detail::cuda_stream()));
    return;
  }
  const uint32_t a = rules::abs_bits(hist[0]);
  const uint32_t b = rules::abs_bits(amax.data<float>()[0]);
  hist[0] = fmt8::bits_float(a > b ? a : b);
}

void update_delayed_scaling(DelayedScalingState& state, AmaxAlgo algo, int margin,
                            float fp8_max_value) {
  check_scalar(state.scale, state.amax_history, "update_delayed_scaling: scale");
  MP_CHECK_INPUT(
      state.amax_history.dtype() == DType::kFloat32 && state.amax_history.shape().rank() == 1,
      "update_delayed_scaling: amax_history must be float32[L], got {}",
      state.amax_history.describe());
  MP_CHECK_INPUT(margin >= 0 && margin < 127, "update_delayed_scaling: margin {} out of [0, 127)",
                 margin);
  const float two_pow_margin = std::ldexp(1.0f, margin);
  const int64_t len = state.amax_history.numel().value;
  if (state.scale.device().is_cuda()) {
    MP_CUDA_DISPATCH(launch_delayed_update(state.amax_history.data<float>(), len,
                                           state.scale.data<float>(), algo == AmaxAlgo::kMax,
                                           fp8_max_value, two_pow_margin, detail::cuda_stream()));
    return;
  }
  rules::delayed_update(state.amax_history.data<float>(), len, state.scale.data<float>(),
                        algo == AmaxAlgo::kMax, fp8_max_value, two_pow_margin);
}

QuantizedTensor quantize_per_tensor(const Tensor& x, const Tensor& scale, DType format, Usage usage,
                                    ScalingMode mode, const Tensor& amax) {
  const bool bf16 = detail::check_quantizer_input(x, "quantize_per_tensor");
  const bool e5m2 = is_e5m2(format);
  check_scalar(scale, x, "quantize_per_tensor: scale");
  MP_CHECK_INPUT(mode == ScalingMode::kDelayedTensor || mode == ScalingMode::kCurrentTensor,
                 "quantize_per_tensor: mode must be per-tensor, got {}", scaling_mode_name(mode));
  MP_CHECK_INPUT(usage.rowwise || usage.columnwise, "quantize_per_tensor: no copy requested");
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  const Device dev = x.device();
  QuantizedTensor q;
  q.mode = mode;
  q.format = format;
  q.logical_shape = Shape{M, K};
  q.scale = scale;
  if (amax.defined()) q.amax = amax;
  Tensor scale_inv = Tensor::empty({1}, DType::kFloat32, dev);
  if (usage.rowwise) q.rowwise_data = Tensor::empty({M, K}, format, dev);
  if (usage.columnwise) q.columnwise_data = Tensor::empty({K, M}, format, dev);
  auto* row = usage.rowwise ? static_cast<uint8_t*>(q.rowwise_data.raw_data()) : nullptr;
  auto* col = usage.columnwise ? static_cast<uint8_t*>(q.columnwise_data.raw_data()) : nullptr;
  if (dev.is_cuda()) {
    MP_CUDA_DISPATCH(launch_quantize_per_tensor(x.raw_data(), bf16, M, K, scale.data<float>(), e5m2,
                                                row, col, scale_inv.data<float>(),
                                                detail::cuda_stream()));
  } else {
    const float s = scale.data<float>()[0];
    scale_inv.data<float>()[0] = rules::reciprocal(s);
    const void* xp = x.raw_data();
    // The transposed copy holds the same codes as the rowwise one (same scale): cast bands of
    // 32 rows in row order (into the rowwise copy, or scratch) and transpose each band.
    constexpr int64_t kBand = 32;
    uint8_t* band = row ? nullptr : scratch_bytes(static_cast<size_t>(kBand * K));
    for (int64_t m0 = 0; m0 < M; m0 += kBand) {
      const int64_t rows = std::min(kBand, M - m0);
      uint8_t* codes = row ? row + m0 * K : band;
      for (int64_t m = m0; m < m0 + rows; ++m)
        cast_contiguous(xp, bf16, m * K, K, &s, false, e5m2, codes + (m - m0) * K);
      if (col) transpose_bytes(codes, K, rows, K, col + m0, M);
    }
  }
  if (usage.rowwise) q.rowwise_scale_inv = scale_inv;
  if (usage.columnwise) q.columnwise_scale_inv = scale_inv;
  return q;
}

QuantizedTensor quantize_current(const Tensor& x, DType format, Usage usage, float eps, bool pow2) {
  const Tensor amax = compute_amax(x);
  const Tensor scale = compute_current_scale(amax, format, eps, pow2);
  return quantize_per_tensor(x, scale, format, usage, ScalingMode::kCurrentTensor, amax);
}

QuantizedTensor quantize_mxfp8(const Tensor& x, DType format, Usage usage) {
  const bool bf16 = detail::check_quantizer_input(x, "quantize_mxfp8");
  const bool e5m2 = is_e5m2(format);
  MP_CHECK_INPUT(usage.rowwise || usage.columnwise, "quantize_mxfp8: no copy requested");
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  MP_CHECK_INPUT(K % 32 == 0 && M % 32 == 0,
                 "quantize_mxfp8: tensor {} (M={}, K={}) is not MXFP8-quantizable: needs the last "
                 "dim K and the product of the leading dims M to be multiples of 32",
                 x.describe(), M, K);
  const Device dev = x.device();
  QuantizedTensor q;
  q.mode = ScalingMode::kMxfp8;
  q.format = format;
  q.logical_shape = Shape{M, K};
  uint8_t* row = nullptr;
  uint8_t* row_s = nullptr;
  uint8_t* col = nullptr;
  uint8_t* col_s = nullptr;
  if (usage.rowwise) {
    q.rowwise_data = Tensor::empty({M, K}, format, dev);
    q.rowwise_scale_inv = Tensor::empty({M, K / 32}, DType::kE8M0, dev);
    row = static_cast<uint8_t*>(q.rowwise_data.raw_data());
    row_s = static_cast<uint8_t*>(q.rowwise_scale_inv.raw_data());
  }
  if (usage.columnwise) {
    q.columnwise_data = Tensor::empty({M, K}, format, dev);
    q.columnwise_scale_inv = Tensor::empty({M / 32, K}, DType::kE8M0, dev);
    col = static_cast<uint8_t*>(q.columnwise_data.raw_data());
    col_s = static_cast<uint8_t*>(q.columnwise_scale_inv.raw_data());
  }
  const void* xp = x.raw_data();
  if (dev.is_cuda()) {
    MP_CUDA_DISPATCH(
        launch_quantize_mxfp8(xp, bf16, M, K, e5m2, row, row_s, col, col_s, detail::cuda_stream()));
    return q;
  }
  if (row) {
    std::vector<uint32_t> amax(static_cast<size_t>(K / 32));
    std::vector<float> mult(static_cast<size_t>(K / 32));
    for (int64_t m = 0; m < M; ++m) {
      block_amaxes(xp, bf16, m * K, K, 32, amax.data());
      for (int64_t kb = 0; kb < K / 32; ++kb) {
        const uint8_t e = rules::mxfp8_scale_exponent(fmt8::bits_float(amax[kb]), e5m2);
        row_s[m * (K / 32) + kb] = e;
        mult[kb] = fmt8::e8m0_reciprocal(e);
      }
      cast_blocks(xp, bf16, m * K, K, 32, mult.data(), e5m2, row + m * K);
    }
  }
  if (col) {
    // 32x1 blocks: per-column running maxima over the band's 32 rows, then each row cast with
    // its column's multiplier (the data is not transposed, so every pass is contiguous).
    std::vector<uint32_t> amax(static_cast<size_t>(K));
    std::vector<float> mult(static_cast<size_t>(K));
    for (int64_t mb = 0; mb < M / 32; ++mb) {
      std::fill(amax.begin(), amax.end(), 0u);
      for (int64_t r = 0; r < 32; ++r) col_amax_row(xp, bf16, (mb * 32 + r) * K, K, amax.data());
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t e = rules::mxfp8_scale_exponent(fmt8::bits_float(amax[k]), e5m2);
        col_s[mb * K + k] = e;
        mult[k] = fmt8::e8m0_reciprocal(e);
      }
      for (int64_t r = 0; r < 32; ++r) {
        const int64_t base = (mb * 32 + r) * K;
        cast_contiguous(xp, bf16, base, K, mult.data(), true, e5m2, col + base);
      }
    }
  }
  return q;
}

QuantizedTensor quantize_block(const Tensor& x, ScalingMode mode, DType format, Usage usage,
                               bool pow2, float eps) {
  const bool bf16 = detail::check_quantizer_input(x, "quantize_block");
  const bool e5m2 = is_e5m2(format);
  MP_CHECK_INPUT(std::isfinite(eps) && eps >= 0.0f, "quantize_block: eps must be >= 0, got {}",
                 eps);
  MP_CHECK_INPUT(mode == ScalingMode::kBlock1x128 || mode == ScalingMode::kBlock128x128,
                 "quantize_block: mode must be block_1x128 or block_128x128, got {}",
                 scaling_mode_name(mode));
  MP_CHECK_INPUT(usage.rowwise || usage.columnwise, "quantize_block: no copy requested");
  const bool tile = mode == ScalingMode::kBlock128x128;
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  const int64_t mb = (M + 127) / 128;
  const int64_t kb = (K + 127) / 128;
  const Device dev = x.device();
  QuantizedTensor q;
  q.mode = mode;
  q.format = format;
  q.logical_shape = Shape{M, K};
  uint8_t* row = nullptr;
  float* row_s = nullptr;
  uint8_t* col = nullptr;
  float* col_s = nullptr;
  if (usage.rowwise) {
    q.rowwise_data = Tensor::empty({M, K}, format, dev);
    q.rowwise_scale_inv = Tensor::empty(tile ? Shape{mb, kb} : Shape{M, kb}, DType::kFloat32, dev);
    row = static_cast<uint8_t*>(q.rowwise_data.raw_data());
    row_s = q.rowwise_scale_inv.data<float>();
  }
  if (usage.columnwise) {
    q.columnwise_data = Tensor::empty({K, M}, format, dev);
    q.columnwise_scale_inv =
        Tensor::empty(tile ? Shape{kb, mb} : Shape{K, mb}, DType::kFloat32, dev);
    col = static_cast<uint8_t*>(q.columnwise_data.raw_data());
    col_s = q.columnwise_scale_inv.data<float>();
  }
  const void* xp = x.raw_data();
  if (dev.is_cuda()) {
    MP_CUDA_DISPATCH(launch_quantize_block(xp, bf16, M, K, tile, e5m2, eps, pow2, row, row_s, col,
                                           col_s, detail::cuda_stream()));
    return q;
  }
  if (tile) {
    // One scale per 128x128 tile, shared by the rowwise copy and the transposed copy.
    for (int64_t bi = 0; bi < mb; ++bi) {
      for (int64_t bj = 0; bj < kb; ++bj) {
        const int64_t m0 = bi * 128;
        const int64_t k0 = bj * 128;
        const int64_t rows = std::min<int64_t>(128, M - m0);
        const int64_t cols = std::min<int64_t>(128, K - k0);
        uint32_t a = 0;
        for (int64_t m = m0; m < m0 + rows; ++m) {
          const uint32_t b = amax_contiguous(xp, bf16, m * K + k0, cols);
          a = b > a ? b : a;
        }
        const float s = rules::block_scale(fmt8::bits_float(a), e5m2, eps, pow2);
        const float s_inv = rules::reciprocal(s);
        if (row) row_s[bi * kb + bj] = s_inv;
        if (col) col_s[bj * mb + bi] = s_inv;
        // Both copies share the tile's scale, so the transposed copy is the tile's codes
        // transposed: cast in row order (into the rowwise copy, or a 128x128 scratch tile).
        uint8_t* tile_codes = row ? row + m0 * K + k0 : scratch_bytes(128 * 128);
        const int64_t stride = row ? K : 128;
        for (int64_t m = m0; m < m0 + rows; ++m)
          cast_contiguous(xp, bf16, m * K + k0, cols, &s, false, e5m2,
                          tile_codes + (m - m0) * stride);
        if (col) transpose_bytes(tile_codes, stride, rows, cols, col + k0 * M + m0, M);
      }
    }
    return q;
  }
  if (row) {
    std::vector<uint32_t> amax(static_cast<size_t>(kb));
    std::vector<float> mult(static_cast<size_t>(kb));
    for (int64_t m = 0; m < M; ++m) {
      block_amaxes(xp, bf16, m * K, K, 128, amax.data());
      for (int64_t j = 0; j < kb; ++j) {
        mult[j] = rules::block_scale(fmt8::bits_float(amax[j]), e5m2, eps, pow2);
        row_s[m * kb + j] = rules::reciprocal(mult[j]);
      }
      cast_blocks(xp, bf16, m * K, K, 128, mult.data(), e5m2, row + m * K);
    }
  }
  if (col) {
    // 1x128 blocks of the transpose: 128 consecutive rows m of one column k. Per band of 128
    // rows: per-column running maxima, the column scales, the band cast in row order with its
    // column's multiplier into scratch, then transposed into the [K, M] copy.
    std::vector<uint32_t> amax(static_cast<size_t>(K));
    std::vector<float> mult(static_cast<size_t>(K));
    uint8_t* band = scratch_bytes(static_cast<size_t>(128 * K));
    for (int64_t i = 0; i < mb; ++i) {
      const int64_t m0 = i * 128;
      const int64_t n = std::min<int64_t>(128, M - m0);
      std::fill(amax.begin(), amax.end(), 0u);
      for (int64_t r = 0; r < n; ++r) col_amax_row(xp, bf16, (m0 + r) * K, K, amax.data());
      for (int64_t k = 0; k < K; ++k) {
        mult[k] = rules::block_scale(fmt8::bits_float(amax[k]), e5m2, eps, pow2);
        col_s[k * mb + i] = rules::reciprocal(mult[k]);
      }
      for (int64_t r = 0; r < n; ++r)
        cast_contiguous(xp, bf16, (m0 + r) * K, K, mult.data(), true, e5m2, band + r * K);
      transpose_bytes(band, K, n, K, col + m0, M);
    }
  }
  return q;
}

Tensor dequantize(const QuantizedTensor& q, QuantizedCopy which) {
  const bool rowwise = which == QuantizedCopy::kRowwise;
  const Tensor& data = rowwise ? q.rowwise_data : q.columnwise_data;
  const Tensor& scale = rowwise ? q.rowwise_scale_inv : q.columnwise_scale_inv;
  MP_CHECK_INPUT(
      data.defined() && scale.defined(), "dequantize: the {} copy of a {} tensor {} is absent",
      rowwise ? "rowwise" : "columnwise", scaling_mode_name(q.mode), q.logical_shape.str());
  if (q.mode == ScalingMode::kNvfp4) {
    // Stored [K, M] columnwise: transposed back to the logical layout like the other modes.
    const Tensor d = dequantize_nvfp4(q, rowwise);
    return rowwise ? d : transpose_2d(d);
  }
  const bool e5m2 = is_e5m2(q.format);
  QLayout layout;
  switch (q.mode) {
    case ScalingMode::kDelayedTensor:
    case ScalingMode::kCurrentTensor:
      layout = rowwise ? QLayout::kPerTensorRow : QLayout::kPerTensorCol;
      break;
    case ScalingMode::kMxfp8:
      layout = rowwise ? QLayout::kMxfp8Row : QLayout::kMxfp8Col;
      break;
    case ScalingMode::kBlock1x128:
      layout = rowwise ? QLayout::kBlock1dRow : QLayout::kBlock1dCol;
      break;
    case ScalingMode::kBlock128x128:
      layout = rowwise ? QLayout::kBlock2dRow : QLayout::kBlock2dCol;
      break;
    default:
      MP_FAIL_INPUT("dequantize: scaling mode {} is not supported", scaling_mode_name(q.mode));
  }
  const int64_t M = q.rows();
  const int64_t K = q.cols();
  Tensor out = Tensor::empty({M, K}, DType::kFloat32, data.device());
  const auto* d = static_cast<const uint8_t*>(data.raw_data());
  if (data.device().is_cuda()) {
    MP_CUDA_DISPATCH(launch_dequantize(static_cast<int>(layout), e5m2, d, scale.raw_data(), M, K,
                                       out.data<float>(), detail::cuda_stream()));
    return out;
  }
  float* o = out.data<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      o[m * K + k] = rules::dequant_at(layout, e5m2, d, scale.raw_data(), M, K, m, k);
    }
  }
  return out;
}

Tensor transpose_2d(const Tensor& t) {
  MP_CHECK_INPUT(t.defined() && t.shape().rank() == 2, "transpose_2d: {} is not 2-D",
                 t.defined() ? t.describe() : "undefined tensor");
  const int bits = dtype_bits(t.dtype());
  MP_CHECK_INPUT(bits == 8 || bits == 32, "transpose_2d: {} must have 1- or 4-byte elements",
                 t.describe());
  const int64_t R = t.shape()[0];
  const int64_t C = t.shape()[1];
  Tensor out = Tensor::empty({C, R}, t.dtype(), t.device());
  if (t.device().is_cuda()) {
    MP_CUDA_DISPATCH(
        launch_transpose(t.raw_data(), out.raw_data(), R, C, bits / 8, detail::cuda_stream()));
    return out;
  }
  const auto* in = static_cast<const uint8_t*>(t.raw_data());
  auto* o = static_cast<uint8_t*>(out.raw_data());
  const size_t eb = static_cast<size_t>(bits / 8);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      std::memcpy(o + (c * R + r) * eb, in + (r * C + c) * eb, eb);
    }
  }
  return out;
}

namespace {
int64_t roundup(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
}  // namespace

Tensor mxfp8_pad_scales(const Tensor& compact, QuantizedCopy which) {
  MP_CHECK_INPUT(compact.defined() && compact.shape().rank() == 2 &&
                     (compact.dtype() == DType::kE8M0 || compact.dtype() == DType::kUInt8),
                 "mxfp8_pad_scales: scales must be e8m0 2-D, got {}",
                 compact.defined() ? compact.describe() : "undefined");
  const Tensor host = compact.on(Device::cpu());
  const int64_t R = host.shape()[0];
  const int64_t C = host.shape()[1];
  const bool rowwise = which == QuantizedCopy::kRowwise;
  const int64_t PR = rowwise ? roundup(R, 128) : roundup(R, 4);
  const int64_t PC = rowwise ? roundup(C, 4) : roundup(C, 128);
  Tensor out = Tensor::zeros({PR, PC}, compact.dtype(), Device::cpu());
  const auto* in = static_cast<const uint8_t*>(host.raw_data());
  auto* o = static_cast<uint8_t*>(out.raw_data());
  for (int64_t r = 0; r < R; ++r) std::memcpy(o + r * PC, in + r * C, static_cast<size_t>(C));
  return out.on(compact.device());
}

int64_t mxfp8_swizzle_offset(int64_t r, int64_t c, int64_t cols) {
  return ((r / 128) * ((cols + 3) / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 +
         c % 4;
}

Tensor mxfp8_swizzle_scales(const Tensor& padded, QuantizedCopy which) {
  MP_CHECK_INPUT(padded.defined() && padded.shape().rank() == 2 &&
                     (padded.dtype() == DType::kE8M0 || padded.dtype() == DType::kUInt8),
                 "mxfp8_swizzle_scales: scales must be e8m0 2-D, got {}",
                 padded.defined() ? padded.describe() : "undefined");
  const bool rowwise = which == QuantizedCopy::kRowwise;
  const Tensor host = padded.on(Device::cpu());
  // (r, c) in the formula's orientation: r along the 128-padded dim, c along the 4-padded one.
  const int64_t R = rowwise ? host.shape()[0] : host.shape()[1];
  const int64_t C = rowwise ? host.shape()[1] : host.shape()[0];
  MP_CHECK_INPUT(R % 128 == 0 && C % 4 == 0,
                 "mxfp8_swizzle_scales: {} scales {} are not padded to 128x4 tiles",
                 rowwise ? "rowwise" : "columnwise", host.describe());
  Tensor out = Tensor::empty({R * C}, padded.dtype(), Device::cpu());
  const auto* in = static_cast<const uint8_t*>(host.raw_data());
  auto* o = static_cast<uint8_t*>(out.raw_data());
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      const int64_t src = rowwise ? r * C + c : c * R + r;
      o[mxfp8_swizzle_offset(r, c, C)] = in[src];
    }
  }
  return out.on(padded.device());
}

namespace detail {

void set_quantize_avx2(bool enabled) { g_avx2_allowed.store(enabled); }

bool quantize_avx2_active() {
#if MESHPROOF_QUANTIZE_AVX2
  return cpu_has_avx2();
#else
  return false;
#endif
}

}  // namespace detail

}  // namespace meshproof::kernels
