// The tiled CPU attention (kernels/attention/attention.cc, docs/design.md section 21) against the
// element-wise loops it replaced (attention_oracle.h): out, probs and dqkv bit for bit, through
// both tile kernels (the AVX2 compilation and the portable one, chosen with
// detail::set_cpu_gemm_kernel), in fp32, bf16 and fp64, on odd shapes (S and d not multiples of the
// 4 x 8 tile, one row, one key, grouped-query heads) and with infinities, NaNs and overflowing
// scores.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention/attention.h"
#include "kernels/gemm/gemm_internal.h"
#include "kernels/ops/cast.h"
#include "tests/kernels/attention/attention_oracle.h"

namespace meshproof::kernels {
namespace {

using detail::CpuGemmKernel;

struct KernelGuard {
  explicit KernelGuard(CpuGemmKernel k) { detail::set_cpu_gemm_kernel(k); }
  ~KernelGuard() { detail::set_cpu_gemm_kernel(CpuGemmKernel::kAuto); }
};

std::vector<CpuGemmKernel> kernels() {
  std::vector<CpuGemmKernel> v{CpuGemmKernel::kPortable};
  if (detail::cpu_gemm_kernel_available(CpuGemmKernel::kAvx2)) v.push_back(CpuGemmKernel::kAvx2);
  return v;
}

// Normal values times `scale`; with `specials`, a few elements +-inf, NaN or huge.
Tensor random_tensor(const Shape& shape, DType dt, uint64_t seed, double scale, bool specials) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> v(static_cast<size_t>(shape.numel().value));
  for (double& x : v) x = scale * nd(rng);
  if (specials && v.size() > 8) {
    const double special[] = {INFINITY, -INFINITY, NAN, 3e38, -3e38};
    for (size_t i = 0; i < std::size(special); ++i) v[(i * 7919 + seed) % v.size()] = special[i];
  }
  const Tensor t = Tensor::from_vector(shape, v);
  return dt == DType::kFloat64 ? t : cast_to(t, dt);
}

// Bitwise equality with the NaN rule of section 21: every non-NaN element equal bit for bit, NaN
// exactly where the oracle has NaN (which NaN an x86 operation returns for two NaN operands
// depends on the operand order the compiler encodes).
template <typename T>
void expect_same_bits(const Tensor& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.numel().value, static_cast<int64_t>(want.size())) << what;
  const T* g = got.data<T>();
  int64_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double gv = static_cast<double>(g[i]), wv = static_cast<double>(want[i]);
    const bool same =
        std::isnan(wv) ? std::isnan(gv) : std::memcmp(&g[i], &want[i], sizeof(T)) == 0;
    if (!same && bad++ < 5)
      ADD_FAILURE() << what << " element " << i << ": got " << gv << ", oracle " << wv;
  }
  EXPECT_EQ(bad, 0) << what;
}

struct Case {
  AttentionShape shape;
  bool specials = false;
  double scale = 1.0;
};

std::string describe(const Case& c, DType dt, CpuGemmKernel k) {
  const AttentionShape& s = c.shape;
  return std::string(dtype_name(dt)) + (k == CpuGemmKernel::kAvx2 ? " avx2" : " portable") +
         " B=" + std::to_string(s.batch) + " S=" + std::to_string(s.seq) +
         " A=" + std::to_string(s.heads) + " d=" + std::to_string(s.head_dim) +
         " KV=" + std::to_string(s.kv()) + (c.specials ? " specials" : "") +
         " scale=" + std::to_string(c.scale);
}

template <typename T>
void check_case(const Case& c, DType dt, CpuGemmKernel k, uint64_t seed) {
  const AttentionShape& s = c.shape;
  const std::string what = describe(c, dt, k);
  const int64_t rows = s.batch * s.seq, h = s.heads * s.head_dim, w = s.qkv_width();
  const Tensor qkv = random_tensor({rows, w}, dt, seed, c.scale, c.specials);
  const Tensor dout = random_tensor({rows, h}, dt, seed + 1, 1.0, c.specials);
  Tensor out = Tensor::zeros({rows, h}, dt, Device::cpu());
  Tensor probs = Tensor::zeros({s.batch, s.heads, s.seq, s.seq}, dt, Device::cpu());
  Tensor dqkv = Tensor::zeros({rows, w}, dt, Device::cpu());
  {
    KernelGuard guard(k);
    attention_forward(qkv, s, out, probs);
    attention_backward(dout, qkv, probs, s, dqkv);
  }
  std::vector<T> o_out(static_cast<size_t>(rows * h)),
      o_probs(static_cast<size_t>(s.batch * s.heads * s.seq * s.seq)),
      o_dqkv(static_cast<size_t>(rows * w));
  attention_oracle::forward<T>(qkv.data<T>(), s, o_out.data(), o_probs.data());
  // The backward from the oracle's own probabilities (equal to the new ones when the forward is).
  attention_oracle::backward<T>(dout.data<T>(), qkv.data<T>(), o_probs.data(), s, o_dqkv.data());
  expect_same_bits<T>(out, o_out, what + ": out");
  expect_same_bits<T>(probs, o_probs, what + ": probs");
  expect_same_bits<T>(dqkv, o_dqkv, what + ": dqkv");
}

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {{1, 1, 1, 1, 0}},                // one row, one key, d = 1
      {{2, 7, 3, 5, 0}},                // S and d below one tile
      {{1, 33, 4, 17, 2}},              // GQA (2 heads per group), S = 4 * 8 + 1, d = 2 * 8 + 1
      {{2, 13, 6, 3, 3}},               // 3 groups of 2
      {{1, 9, 4, 8, 1}},                // one group of 4 heads (multi-query)
      {{1, 64, 4, 32, 0}},              // the engine_bench shape (per batch row)
      {{3, 5, 2, 64, 1}},               // d wider than S
      {{1, 130, 2, 16, 0}},             // S past a power of two
      {{2, 11, 2, 9, 0}, true},         // infinities, NaN, huge values
      {{1, 21, 3, 6, 0}, false, 40.0},  // large scores: the softmax saturates, exp underflows
  };
  return c;
}

TEST(AttentionFast, Float32BitwiseEqualToOracle) {
  uint64_t seed = 100;
  for (CpuGemmKernel k : kernels())
    for (const Case& c : cases()) check_case<float>(c, DType::kFloat32, k, seed++);
}

TEST(AttentionFast, BFloat16BitwiseEqualToOracle) {
  uint64_t seed = 200;
  for (CpuGemmKernel k : kernels())
    for (const Case& c : cases()) check_case<BFloat16>(c, DType::kBFloat16, k, seed++);
}

TEST(AttentionFast, Float64BitwiseEqualToOracle) {
  uint64_t seed = 300;
  for (CpuGemmKernel k : kernels())
    for (const Case& c : cases()) check_case<double>(c, DType::kFloat64, k, seed++);
}

// The scratch buffers persist per thread: a smaller call after a larger one (stale contents beyond
// the new shape's padding) still gives the oracle's bits.
TEST(AttentionFast, ReusedScratchAfterLargerCall) {
  for (CpuGemmKernel k : kernels()) {
    check_case<float>({{1, 130, 2, 16, 0}, true}, DType::kFloat32, k, 400);
    check_case<float>({{2, 3, 2, 5, 0}}, DType::kFloat32, k, 401);
  }
}

}  // namespace
}  // namespace meshproof::kernels
