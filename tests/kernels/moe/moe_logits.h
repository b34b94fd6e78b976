// MoE router logits for the routing tests: drawn from a few values (exact ties) or those values
// + 0.001 j, so two logits of a row are equal or at least ~1e-3 apart: their probabilities are
// equal on every backend (the same exp of the same argument) or far more than an ulp apart, and
// many of them tie. Used by the CPU test (moe_kernels_test.cc) and the gpu test
// (ops_cuda_test.cc).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace meshproof::kernels::moe_testing {

inline std::vector<float> tied_logits(std::mt19937& g, int64_t n) {
  const float values[] = {-2.0f, -0.5f, 0.0f, 0.25f, 1.0f, 3.0f};
  std::uniform_int_distribution<int> pick(0, 5), noise(0, 3);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v)
    x = noise(g) == 0 ? values[pick(g)] + 0.001f * static_cast<float>(pick(g)) : values[pick(g)];
  return v;
}

}  // namespace meshproof::kernels::moe_testing
