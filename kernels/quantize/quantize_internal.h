// Internal to the quantizer family (quantize.cc, tests, benchmarks): which CPU cast kernel runs.
// The explicit AVX2 cast and the portable loop compute the same integer steps per element, so
// they are byte-equal; the switch exists for the tests that prove it (docs/design.md section 21).
#pragma once

namespace meshproof::kernels::detail {

// Whether the CPU quantizers may use the AVX2 cast (default: yes when the CPU has AVX2).
// Process-wide. Disabling always succeeds; enabling on a CPU without AVX2 keeps the portable loop.
void set_quantize_avx2(bool enabled);
// True when the AVX2 cast runs now.
bool quantize_avx2_active();

}  // namespace meshproof::kernels::detail
