// Scalar rules of the NVFP4 recipe (docs/design.md section 25), shared by the CPU reference
// (nvfp4.cc) and the CUDA kernels (nvfp4.cu): the same fp32 operations in the same order, so both
// backends produce identical bytes. They follow TransformerEngine's NVFP4 reference quantizer:
// E2M1 elements, an fp32 per-tensor global scale and E4M3 scales per 1x16 block (or 16x16 tile).
#pragma once

#include <cstdint>

#include "kernels/core/formats.h"
#include "kernels/quantize/quantize_rules.h"
#include "kernels/random/philox.h"

namespace meshproof::kernels::rules::nvfp4 {

inline constexpr int kBlock = 16;
// fp8_max * fp4_max = 448 * 6: the global scale maps the tensor amax onto the largest product of a
// block scale and an element.
inline constexpr float kGlobalNumerator = 2688.0f;
inline constexpr float kInvFp4Max = 1.0f / 6.0f;  // fp32(1/6), rounded once at compile time

// min(v, FLT_MAX) with fminf's NaN rule (a NaN operand yields the other one): inf and NaN ->
// FLT_MAX.
MP_HOST_DEVICE inline float min_flt_max(float v) { return v <= kFltMax ? v : kFltMax; }

// S_enc = fp32(2688 / global_amax), capped at FLT_MAX (amax 0 or tiny), 1 where that gives 0 (an
// infinite amax).
MP_HOST_DEVICE inline float global_encode_scale(float global_amax) {
  float s = min_flt_max(kGlobalNumerator / global_amax);
  if (s == 0.0f) s = 1.0f;
  return s;
}
// gds = fp32(1 / S_enc).
MP_HOST_DEVICE inline float global_decode_scale(float s_enc) { return 1.0f / s_enc; }

// Power-of-two E4M3 code at or above v (v >= 0, finite): the scale the nvfp4_block_scale_pow2
// fault substitutes for the E4M3 rounding (a fault, never the recipe).
MP_HOST_DEVICE inline uint8_t e4m3_pow2_up(float v) {
  if (!(v > 0.0f)) return 0;
  const uint32_t b = fmt8::float_bits(v);
  uint32_t e = b >> 23;
  if ((b & 0x7FFFFFu) != 0) ++e;  // round the exponent up
  const float p = fmt8::bits_float(e << 23);
  return fmt8::float_to_e4m3(p < fmt8::kE4M3Max ? p : 256.0f);
}

// The block's scale code: dec = e4m3(clamp(min(fp32(block_amax * mult), FLT_MAX), -448, 448)) with
// mult = fp32(S_enc * fp32(1/6)); E4M3 round to nearest even. A NaN block amax gives 448.
MP_HOST_DEVICE inline uint8_t block_scale_code(float block_amax, float s_enc, bool pow2 = false) {
  const float mult = s_enc * kInvFp4Max;
  float v = min_flt_max(block_amax * mult);
  if (v > fmt8::kE4M3Max) v = fmt8::kE4M3Max;
  if (v < -fmt8::kE4M3Max) v = -fmt8::kE4M3Max;
  return pow2 ? e4m3_pow2_up(v) : fmt8::float_to_e4m3(v);
}

// enc = min(fp32(1 / fp32(float(dec) * gds)), FLT_MAX): a zero scale code gives FLT_MAX.
MP_HOST_DEVICE inline float block_encode_scale(uint8_t dec, float gds) {
  return min_flt_max(1.0f / (fmt8::e4m3_to_float(dec) * gds));
}

// clamp(v, -6, 6); NaN passes through (and is encoded by the rule below).
MP_HOST_DEVICE inline float clamp6(float v) {
  if (v > fmt8::kE2M1Max) return fmt8::kE2M1Max;
  if (v < -fmt8::kE2M1Max) return -fmt8::kE2M1Max;
  return v;
}

// E2M1 code of a clamped value, round to nearest, ties to the even mantissa. Sign: code 8 for
// every v < 0 (also when it rounds to zero), none for +0 and -0. NaN -> 0x7 (+6), as formats.h.
MP_HOST_DEVICE inline uint8_t e2m1_rne(float v) {
  if (is_nan(v)) return 0x7u;
  const uint32_t mag = fmt8::encode_magnitude(abs_bits(v), fmt8::e2m1_format());
  return static_cast<uint8_t>(mag | (v < 0.0f ? 0x8u : 0x0u));
}

// Stochastic rounding of a clamped value with the uniform draw u in [0, 1) (a multiple of 2^-24):
// between the neighbouring E2M1 magnitudes lo <= |v| < hi, round up iff u < f with
// f = (|v| - lo) / (hi - lo). Both operations are exact in fp32 (lo >= |v|/2 or lo = 0, and hi - lo
// is 0.5, 1 or 2), so P(up) = ceil(f * 2^24) / 2^24: the expectation is |v| to within
// 2^-24 * (hi - lo). Sign and NaN as e2m1_rne.
MP_HOST_DEVICE inline uint8_t e2m1_stochastic(float v, float u) {
  if (is_nan(v)) return 0x7u;
  const float a = fmt8::bits_float(abs_bits(v));
  uint32_t mag = 7;
  if (a < fmt8::kE2M1Max) {
    // Magnitude codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    uint32_t lo = 0;
    while (lo < 7 && fmt8::e2m1_to_float(static_cast<uint8_t>(lo + 1)) <= a) ++lo;
    const float lo_v = fmt8::e2m1_to_float(static_cast<uint8_t>(lo));
    const float hi_v = fmt8::e2m1_to_float(static_cast<uint8_t>(lo + 1));
    const float f = (a - lo_v) / (hi_v - lo_v);
    mag = lo + (u < f ? 1u : 0u);
  }
  return static_cast<uint8_t>(mag | (v < 0.0f ? 0x8u : 0x0u));
}

// Decode: fp32(fp32(e2m1 * float(dec)) * gds).
MP_HOST_DEVICE inline float decode(uint8_t code, uint8_t dec, float gds) {
  return (fmt8::e2m1_to_float(code) * fmt8::e4m3_to_float(dec)) * gds;
}

// Stochastic rounding key: the draw of element `index` is word 0 of philox_bits(seed, stream,
// index) >> 8, times 2^-24, with stream = (step << 32) | tensor_id. The engine passes the element's
// index in the unsharded tensor, so the draw does not depend on the mesh.
MP_HOST_DEVICE inline uint64_t sr_stream(uint64_t step, uint32_t tensor_id) {
  return (step << 32) | tensor_id;
}
MP_HOST_DEVICE inline float sr_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint32_t w = philox_bits(seed, stream, index)[0] >> 8;
  return static_cast<float>(w) * 0x1.0p-24f;
}

// The RHT sign vector d and the Sylvester Hadamard entry H16[i][j] = (-1)^popcount(i & j).
MP_HOST_DEVICE inline int rht_sign(int i) {
  // d = [1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1]: bit i set where d_i = -1.
  return ((0xD7E8u >> i) & 1u) ? -1 : 1;
}
MP_HOST_DEVICE inline int hadamard16(int i, int j) {
  // 0x6996 holds the parity of every 4-bit value: bit p is popcount(p) & 1.
  return ((0x6996u >> ((i & j) & 0xF)) & 1u) ? -1 : 1;
}

// One 16-group: y_j = fp32(0.25 * sum_i d_i H16[i][j] g_i), the sum in float64 in index order
// (each term is exact in float64), rounded once. g[i] = x[base + i * stride]. A NaN y_j (a NaN
// input, or inf - inf) is stored as 0x7FC00000: x86 keeps an operand's NaN (payload and sign) or
// makes its default -NaN, a GPU makes its canonical NaN 0x7FFFFFFF, and the columnwise amax, a
// max of these bits, must be the same on both.
MP_HOST_DEVICE inline void rht16(const void* x, bool bf16, int64_t base, int64_t stride, float* y) {
  double g[kBlock];
  for (int i = 0; i < kBlock; ++i)
    g[i] = static_cast<double>(load_input(x, bf16, base + i * stride));
  for (int j = 0; j < kBlock; ++j) {
    double s = 0.0;
    for (int i = 0; i < kBlock; ++i) {
      const double t = g[i];
      s = (rht_sign(i) * hadamard16(i, j) > 0) ? s + t : s - t;
    }
    const float v = static_cast<float>(0.25 * s);
    y[j] = is_nan(v) ? fmt8::bits_float(0x7FC00000u) : v;
  }
}

// Stochastic rounding of one quantization: whether it is on, and the key of element (m, k) of the
// logical [M, K] tensor: index = 2 * ((row0 + m) * ld + col0 + k) + copy (0 rowwise,
// 1 columnwise), so the two copies draw independently.
struct SrKey {
  bool on = false;
  uint64_t seed = 0;
  uint64_t stream = 0;
  int64_t row0 = 0;
  int64_t col0 = 0;
  int64_t ld = 0;
};

// Encodes the 16 values v[i] of one block (unscaled: the input, or its RHT) with the block's
// encode scale: q = e2m1(clamp(fp32(v * enc), -6, 6)), packed into out[0..8) with element 2j in
// the low nibble and 2j+1 in the high nibble. idx[i] is element i's SR index (unused without SR).
MP_HOST_DEVICE inline void encode_block(const float* v, float enc, const SrKey& sr,
                                        const int64_t* idx, uint8_t* out) {
  for (int j = 0; j < kBlock / 2; ++j) {
    uint8_t c[2];
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * j + h;
      const float s = clamp6(v[i] * enc);
      c[h] = sr.on
                 ? e2m1_stochastic(s, sr_uniform(sr.seed, sr.stream, static_cast<uint64_t>(idx[i])))
                 : e2m1_rne(s);
    }
    out[j] = static_cast<uint8_t>(c[0] | (c[1] << 4));
  }
}

// Max of abs_bits over 16 values.
MP_HOST_DEVICE inline uint32_t amax16_bits(const float* v) {
  uint32_t a = 0;
  for (int i = 0; i < kBlock; ++i) {
    const uint32_t b = abs_bits(v[i]);
    a = b > a ? b : a;
  }
  return a;
}

// ---- block workers: one CPU loop iteration or one CUDA thread each ---------------------------

// One quantization of an [M, K] input (M, K multiples of 16).
struct Job {
  const void* x = nullptr;
  bool bf16 = false;
  int64_t M = 0;
  int64_t K = 0;
  bool tile = false;  // 16x16 tiles (weights) instead of 1x16 blocks
  bool rht = false;   // RHT on the columnwise copy
  bool pow2 = false;  // fault nvfp4_block_scale_pow2 only
  SrKey sr;
  float s_enc_row = 1.0f;  // global_encode_scale of the rowwise / columnwise global amax
  float s_enc_col = 1.0f;
  // With `tile`: the abs_bits max of every 16x16 tile, [M/16, K/16], computed once before the
  // blocks (the CPU driver); null: each block computes its tile's (a CUDA thread per block).
  const uint32_t* tile_amax = nullptr;
};

// abs_bits max over the 16x16 tile at rows m0.., columns k0.. (multiples of 16) of j.x.
MP_HOST_DEVICE inline uint32_t compute_tile_amax_bits(const Job& j, int64_t m0, int64_t k0) {
  uint32_t a = 0;
  for (int64_t r = m0; r < m0 + kBlock; ++r) {
    const uint32_t b = block_amax_bits(j.x, j.bf16, r * j.K + k0, 1, kBlock);
    a = b > a ? b : a;
  }
  return a;
}

// abs_bits max over the 16x16 tile holding element (m, k).
MP_HOST_DEVICE inline uint32_t tile_amax_bits(const Job& j, int64_t m, int64_t k) {
  if (j.tile_amax != nullptr) return j.tile_amax[(m / kBlock) * (j.K / kBlock) + k / kBlock];
  const int64_t m0 = m / kBlock * kBlock;
  return compute_tile_amax_bits(j, m0, k / kBlock * kBlock);
}

MP_HOST_DEVICE inline int64_t sr_index(const SrKey& sr, int64_t m, int64_t k, int copy) {
  return 2 * ((sr.row0 + m) * sr.ld + sr.col0 + k) + copy;
}

// Rowwise block b of row m: data row [M, K/2] bytes, scale codes [M, K/16].
MP_HOST_DEVICE inline void row_block(const Job& j, int64_t m, int64_t b, uint8_t* data,
                                     uint8_t* scale) {
  float v[kBlock];
  int64_t idx[kBlock];
  const int64_t k0 = b * kBlock;
  for (int i = 0; i < kBlock; ++i) {
    v[i] = load_input(j.x, j.bf16, m * j.K + k0 + i);
    idx[i] = j.sr.on ? sr_index(j.sr, m, k0 + i, 0) : 0;
  }
  const uint32_t a = j.tile ? tile_amax_bits(j, m, k0) : amax16_bits(v);
  const uint8_t dec = block_scale_code(fmt8::bits_float(a), j.s_enc_row, j.pow2);
  const float enc = block_encode_scale(dec, global_decode_scale(j.s_enc_row));
  scale[m * (j.K / kBlock) + b] = dec;
  encode_block(v, enc, j.sr, idx, data + (m * j.K + k0) / 2);
}

// Columnwise group g of column k: elements m = 16g..16g+15 of column k, i.e. block g of row k of
// the transpose [K, M] (its RHT with rht): data [K, M/2] bytes, scale codes [K, M/16].
MP_HOST_DEVICE inline void col_group(const Job& j, int64_t k, int64_t g, uint8_t* data,
                                     uint8_t* scale) {
  float v[kBlock];
  int64_t idx[kBlock];
  const int64_t m0 = g * kBlock;
  if (j.rht) {
    rht16(j.x, j.bf16, m0 * j.K + k, j.K, v);
  } else {
    for (int i = 0; i < kBlock; ++i) v[i] = load_input(j.x, j.bf16, (m0 + i) * j.K + k);
  }
  for (int i = 0; i < kBlock; ++i) idx[i] = j.sr.on ? sr_index(j.sr, m0 + i, k, 1) : 0;
  const uint32_t a = j.tile ? tile_amax_bits(j, m0, k) : amax16_bits(v);
  const uint8_t dec = block_scale_code(fmt8::bits_float(a), j.s_enc_col, j.pow2);
  const float enc = block_encode_scale(dec, global_decode_scale(j.s_enc_col));
  scale[k * (j.M / kBlock) + g] = dec;
  encode_block(v, enc, j.sr, idx, data + (k * j.M + m0) / 2);
}

// abs_bits max of the RHT of columnwise group g of column k (the columnwise global amax with rht).
MP_HOST_DEVICE inline uint32_t rht_group_amax_bits(const void* x, bool bf16, int64_t K, int64_t k,
                                                   int64_t g) {
  float v[kBlock];
  rht16(x, bf16, g * kBlock * K + k, K, v);
  return amax16_bits(v);
}

}  // namespace meshproof::kernels::rules::nvfp4
