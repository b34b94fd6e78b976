// Vectorisable CPU building blocks of the quantizers (quantize_per_tensor.cc, quantize_mxfp8.cc,
// quantize_block.cc; declared in quantize_internal.h). They compute, element for element, the
// scalar rules of quantize_rules.h that the CUDA kernels call (the same amax, scales, fp32
// multiply and round-to-nearest-even cast), in a vectorisable form (docs/design.md section 21):
// amax as an unsigned max of sign-cleared bits, a branchless fp8 encoder (and its explicit AVX2
// form), per-column running maxima for column blocks, and a blocked byte transpose for the
// transposed copies, whose codes are cast in row order. Bitwise equal to the element-wise rules
// (tests/kernels/quantize/quantize_fast_test.cc, exhaustively for the encoder). Also the
// process-wide switch between the AVX2 cast and the portable loop.
#include <algorithm>
#include <atomic>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels/quantize/quantize_internal.h"
#include "kernels/quantize/quantize_rules.h"

namespace meshproof::kernels {

namespace {

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

template <bool kBf16>
inline __attribute__((always_inline)) void col_amax_loop(const void* x, int64_t base, int64_t n,
                                                         uint32_t* acc) {
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t b = rules::abs_bits(load_at<kBf16>(x, base + k));
    acc[k] = b > acc[k] ? b : acc[k];
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

template <bool kBf16, bool kE5m2>
inline __attribute__((always_inline)) void cast_blocks_loop(const void* x, int64_t base, int64_t n,
                                                            int64_t bs, const float* mult,
                                                            uint8_t* out) {
  for (int64_t b = 0, i = 0; i < n; ++b, i += bs)
    cast_loop<kBf16, kE5m2, false>(x, base + i, std::min(bs, n - i), mult + b, out + i);
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

}  // namespace

namespace detail {

// rules::block_amax_bits over the contiguous x[base, base + n).
__attribute__((target_clones("avx2", "default"))) uint32_t amax_contiguous(const void* x, bool bf16,
                                                                           int64_t base,
                                                                           int64_t n) {
  return bf16 ? amax_loop<true>(x, base, n) : amax_loop<false>(x, base, n);
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
