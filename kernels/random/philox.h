// Counter-based random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC'11). A value depends only on (seed, stream, index), never on call order or on
// which rank computes it, so any shard of a parameter, a dropout mask or a data batch can be
// materialised alone and recompute regenerates identical values (docs/design.md section 3).
//   key     = seed (64 bits)
//   counter = (index low, index high, stream low, stream high)
// Header-only and constexpr-friendly so a CUDA kernel can include the same code.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string_view>

// The generator and the uniform draw are __host__ __device__ so the CUDA dropout kernel
// (elementwise.cu) derives bit-identical masks from the same code.
#if defined(__CUDACC__)
#define MP_PHILOX_HD __host__ __device__
#else
#define MP_PHILOX_HD
#endif

namespace meshproof::kernels {

using PhiloxBlock = std::array<uint32_t, 4>;

MP_PHILOX_HD inline PhiloxBlock philox4x32_10(PhiloxBlock ctr, uint64_t seed) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * ctr[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ k0, static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ k1, static_cast<uint32_t>(p0)};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// The 128 random bits of element `index` of `stream`.
MP_PHILOX_HD inline PhiloxBlock philox_bits(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox4x32_10({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                        static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)},
                       seed);
}

// A uniform double in (0, 1): 53 random bits from words 0 and 1, offset by half an ulp so that
// log() in Box-Muller never sees 0.
MP_PHILOX_HD inline double philox_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  const PhiloxBlock b = philox_bits(seed, stream, index);
  const uint64_t bits = ((static_cast<uint64_t>(b[0]) << 32) | b[1]) >> 11;
  return (static_cast<double>(bits) + 0.5) * 0x1.0p-53;
}

// A standard normal sample by Box-Muller from one counter: u1 from words 0-1, u2 from words 2-3
// (in double, so the result is the same on every platform with IEEE double and correctly
// rounded sqrt; log/cos come from the C library).
inline double philox_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  const PhiloxBlock b = philox_bits(seed, stream, index);
  const uint64_t bits1 = ((static_cast<uint64_t>(b[0]) << 32) | b[1]) >> 11;
  const uint64_t bits2 = ((static_cast<uint64_t>(b[2]) << 32) | b[3]) >> 11;
  const double u1 = (static_cast<double>(bits1) + 0.5) * 0x1.0p-53;
  const double u2 = static_cast<double>(bits2) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * 3.14159265358979323846 * u2);
}

// A stream id from a name (FNV-1a 64), e.g. the design.md parameter name
// "layers.0.attn.qkv.weight".
constexpr uint64_t philox_stream(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace meshproof::kernels
