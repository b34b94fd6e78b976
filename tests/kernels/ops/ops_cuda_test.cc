// CUDA kernels of the model's op families against the CPU reference on random inputs, float32
// and bfloat16. Bitwise where kernels/ops/ops_cuda.h promises it (cast, bias add, residual, scale,
// dropout, AdamW, bias/norm-weight gradients, embedding, relu, attention backward given the same
// probabilities); otherwise within the stated bound: 1 ulp of the stored dtype plus a tiny
// absolute slack for results that cancel (documented per test). Skips without a usable device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/attention/attention.h"
#include "kernels/attention/flash_attention.h"
#include "kernels/core/cuda_check.h"
#include "kernels/core/device.h"
#include "kernels/core/error.h"
#include "kernels/moe/moe_route.h"
#include "kernels/moe/moe_row.h"
#include "kernels/moe/moe_rows.h"
#include "kernels/ops/activation.h"
#include "kernels/ops/adamw.h"
#include "kernels/ops/cast.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/embedding.h"
#include "kernels/ops/layernorm.h"
#include "kernels/random/markov.h"
#include "tests/gpu_test.h"
#include "tests/kernels/attention/flash_attention_bound.h"
#include "tests/kernels/moe/moe_logits.h"
#include "tests/kernels/ops/column_reduce_oracle.h"

namespace meshproof::kernels {
namespace {

using column_oracle::random_tensor;

const Device kGpu = Device::cuda(0);
const DType kActDtypes[] = {DType::kFloat32, DType::kBFloat16};

Tensor on_gpu(const Tensor& t) { return t.to(kGpu); }

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.raw_data());
  return std::vector<uint8_t>(p, p + h.nbytes().value);
}

// Values as float32 on the host (bf16 widens exactly).
std::vector<float> floats_of(const Tensor& t) {
  const Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu());
  return cast_to(h, DType::kFloat32).to_vector<float>();
}

void expect_bitwise(const Tensor& cpu, const Tensor& gpu, const char* what) {
  EXPECT_EQ(bytes_of(cpu), bytes_of(gpu)) << what << " differs from the CPU reference bitwise";
}

// The spacing of `dtype` at |x| (float32: 2^-23 relative, bf16: 2^-7 relative; smallest normal
// spacing near zero).
double ulp_at(double x, DType dtype) {
  const int mant = dtype == DType::kBFloat16 ? 7 : 23;
  const double ax = std::max(std::fabs(x), 1.1754943508222875e-38);
  return std::ldexp(1.0, std::ilogb(ax) - mant);
}

double max_abs_of(const Tensor& t) {
  double m = 0;
  for (float x : floats_of(t)) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

// |gpu - cpu| <= 1 ulp(cpu) + atol_rel * scale for every element; scale defaults to max|cpu|.
void expect_close(const Tensor& cpu, const Tensor& gpu, double atol_rel, const char* what,
                  double scale = -1.0) {
  const std::vector<float> a = floats_of(cpu), b = floats_of(gpu);
  ASSERT_EQ(a.size(), b.size());
  const double max_abs = scale >= 0 ? scale : max_abs_of(cpu);
  int bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double tol = ulp_at(a[i], cpu.dtype()) + atol_rel * max_abs;
    if (!(std::fabs(static_cast<double>(a[i]) - b[i]) <= tol) && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: cpu " << a[i] << " gpu " << b[i] << " tol " << tol;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements outside the bound";
}

TEST(OpsCuda, CastAllPairsBitwise) {
  MP_SKIP_WITHOUT_GPU();
  for (DType from : kActDtypes)
    for (DType to : kActDtypes) {
      const Tensor x = random_tensor({37, 41}, from, 1, 3.0);
      Tensor cpu = Tensor::empty(x.shape(), to, Device::cpu());
      Tensor gpu = Tensor::empty(x.shape(), to, kGpu);
      cast(x, cpu);
      cast(on_gpu(x), gpu);
      expect_bitwise(cpu, gpu, "cast");
    }
}

TEST(OpsCuda, Float64OnCudaIsAClearError) {
  MP_SKIP_WITHOUT_GPU();
  Tensor x = Tensor::zeros({4}, DType::kFloat64, kGpu);
  EXPECT_THROW(scale_(x, 2.0), Error);
}

TEST(OpsCuda, ElementwiseBitwise) {
  MP_SKIP_WITHOUT_GPU();
  for (DType dt : kActDtypes) {
    const Tensor y0 = random_tensor({33, 70}, dt, 2), bias = random_tensor({70}, dt, 3);
    const Tensor r = random_tensor({33, 70}, dt, 4);
    Tensor cpu = y0.clone(), gpu = on_gpu(y0);
    add_bias_(cpu, bias);
    add_bias_(gpu, on_gpu(bias));
    expect_bitwise(cpu, gpu, "add_bias_");
    add_(cpu, r);
    add_(gpu, on_gpu(r));
    expect_bitwise(cpu, gpu, "add_");
    scale_(cpu, 0.3);
    scale_(gpu, 0.3);
    expect_bitwise(cpu, gpu, "scale_");
    for (double p : {0.0, 0.1, 0.5}) {
      const DropoutKey key{.seed = 1234, .stream = 77, .first_index = 1000003};
      Tensor dc = Tensor::empty(y0.shape(), dt, Device::cpu());
      Tensor dg = Tensor::empty(y0.shape(), dt, kGpu);
      dropout_forward(y0, p, key, dc);
      dropout_forward(on_gpu(y0), p, key, dg);
      expect_bitwise(dc, dg, "dropout_forward");
      dropout_backward(r, p, key, dc);
      dropout_backward(on_gpu(r), p, key, dg);
      expect_bitwise(dc, dg, "dropout_backward");
    }
  }
}

// bias_grad is a parallel per-column reduction (kernels/ops/column_reduce.h): the device's bits are
// the host's fixed-order sum exactly, within column_reduce_bound of the CPU's serial sum (derived
// in that header; no device measurement exists yet), and a rerun gives the same bits. 777 rows:
// three full 256-row chunks and a partial one; 70 columns: a partial 32-column tile.
TEST(OpsCuda, BiasGradFixedOrder) {
  MP_SKIP_WITHOUT_GPU();
  const int64_t m = 777, n = 70;
  for (DType dt : kActDtypes) {
    const Tensor r = random_tensor({m, n}, dt, 4, 3.0);
    const Tensor db0 = random_tensor({n}, DType::kFloat32, 5);
    Tensor dbc = db0.clone(), dbg = on_gpu(db0), again = on_gpu(db0);
    bias_grad(r, dbc);
    bias_grad(on_gpu(r), dbg);
    bias_grad(on_gpu(r), again);
    const std::vector<float> g0 = db0.to_vector<float>();
    const column_oracle::ColumnGrads fixed = column_oracle::bias_grad(r, g0);
    EXPECT_EQ(floats_of(dbg), fixed.grad) << "bias_grad: not the fixed order's bits";
    column_oracle::expect_within_bound(floats_of(dbc), floats_of(dbg), g0, fixed, m, "bias_grad");
    expect_bitwise(dbg, again, "bias_grad rerun");
  }
}

TEST(OpsCuda, Activations) {
  MP_SKIP_WITHOUT_GPU();
  for (DType dt : kActDtypes) {
    const Tensor x = random_tensor({19, 130}, dt, 6, 2.0), u = random_tensor({19, 130}, dt, 7);
    const Tensor dy = random_tensor({19, 130}, dt, 8);
    auto out = [&](Device d) { return Tensor::empty(x.shape(), dt, d); };
    Tensor c1 = out(Device::cpu()), g1 = out(kGpu), c2 = out(Device::cpu()), g2 = out(kGpu);
    relu_forward(x, c1);
    relu_forward(on_gpu(x), g1);
    expect_bitwise(c1, g1, "relu_forward");
    relu_backward(dy, x, c1);
    relu_backward(on_gpu(dy), on_gpu(x), g1);
    expect_bitwise(c1, g1, "relu_backward");
    // Device tanh/exp in double differ from glibc by ~1 ulp of double (~1e-16 absolute on the
    // O(1) terms). Away from cancellation that is at most 1 ulp of the stored dtype; where terms
    // cancel (0.5 v (1 + tanh) for v << 0, 1 + g (1 - s) near g = -1.28) the absolute error stays
    // ~|v| 1e-16, so 1e-14 of max|out| (a 100x margin) is allowed on top.
    constexpr double kSlack = 1e-14;
    gelu_forward(x, c1);
    gelu_forward(on_gpu(x), g1);
    expect_close(c1, g1, kSlack, "gelu_forward");
    gelu_backward(dy, x, c1);
    gelu_backward(on_gpu(dy), on_gpu(x), g1);
    expect_close(c1, g1, kSlack, "gelu_backward");
    swiglu_forward(x, u, c1);
    swiglu_forward(on_gpu(x), on_gpu(u), g1);
    expect_close(c1, g1, kSlack, "swiglu_forward");
    swiglu_backward(dy, x, u, c1, c2);
    swiglu_backward(on_gpu(dy), on_gpu(x), on_gpu(u), g1, g2);
    expect_close(c1, g1, kSlack, "swiglu_backward dgate");
    expect_close(c2, g2, kSlack, "swiglu_backward dup");
  }
}

// Row statistics are block tree sums in double (CPU: serial double sums): ~1e-15 relative before
// rounding. y and dx can cancel (y = n w + b, dx = rstd (g - mean g - n mean gn)), so besides
// 1 ulp we allow 1e-9 of the tensor's largest magnitude: ~1e6 times the double error, far below
// any float32 ulp of a non-cancelled value.
constexpr double kCancelSlack = 1e-9;

TEST(OpsCuda, LayerNormAndRmsNorm) {
  MP_SKIP_WITHOUT_GPU();
  // h > block size: several columns per thread; m > 256: two row chunks of the column reductions.
  const int64_t m = 300, h = 300;
  for (DType dt : kActDtypes) {
    const Tensor x = random_tensor({m, h}, dt, 9, 2.0), w = random_tensor({h}, dt, 10);
    const Tensor b = random_tensor({h}, dt, 11), dy = random_tensor({m, h}, dt, 12);
    auto t = [&](const Shape& s, Device d) { return Tensor::empty(s, dt, d); };
    Tensor yc = t({m, h}, Device::cpu()), yg = t({m, h}, kGpu);
    Tensor mc = t({m}, Device::cpu()), mg = t({m}, kGpu), rc = t({m}, Device::cpu()),
           rg = t({m}, kGpu);
    layernorm_forward(x, w, b, 1e-5, yc, mc, rc);
    layernorm_forward(on_gpu(x), on_gpu(w), on_gpu(b), 1e-5, yg, mg, rg);
    expect_close(yc, yg, kCancelSlack, "layernorm y");
    expect_close(mc, mg, kCancelSlack, "layernorm mean");
    expect_close(rc, rg, 0.0, "layernorm rstd");
    // Backward from the CPU's saved statistics, so dweight/dbias sum the host oracle's terms.
    const Tensor dw0 = random_tensor({h}, DType::kFloat32, 13),
                 db0 = random_tensor({h}, DType::kFloat32, 14);
    Tensor dxc = t({m, h}, Device::cpu()), dxg = t({m, h}, kGpu);
    Tensor dwc = dw0.clone(), dwg = on_gpu(dw0), dbc = db0.clone(), dbg = on_gpu(db0);
    layernorm_backward(dy, x, w, mc, rc, dxc, dwc, dbc);
    layernorm_backward(on_gpu(dy), on_gpu(x), on_gpu(w), on_gpu(mc), on_gpu(rc), dxg, dwg, dbg);
    expect_close(dxc, dxg, kCancelSlack, "layernorm dx");
    // dweight/dbias: the fixed-order column reductions (kernels/ops/column_reduce.h), bit for bit
    // the host's order, within its bound of the CPU, and bitwise on a rerun.
    const std::vector<float> dw0v = dw0.to_vector<float>(), db0v = db0.to_vector<float>();
    const column_oracle::ColumnGrads fw = column_oracle::norm_grad(dy, x, &mc, rc, dw0v, 0);
    const column_oracle::ColumnGrads fb = column_oracle::norm_grad(dy, x, &mc, rc, db0v, 1);
    EXPECT_EQ(floats_of(dwg), fw.grad) << "layernorm dweight: not the fixed order's bits";
    EXPECT_EQ(floats_of(dbg), fb.grad) << "layernorm dbias: not the fixed order's bits";
    column_oracle::expect_within_bound(floats_of(dwc), floats_of(dwg), dw0v, fw, m, "ln dweight");
    column_oracle::expect_within_bound(floats_of(dbc), floats_of(dbg), db0v, fb, m, "ln dbias");
    Tensor dw2 = on_gpu(dw0), db2 = on_gpu(db0);
    layernorm_backward(on_gpu(dy), on_gpu(x), on_gpu(w), on_gpu(mc), on_gpu(rc), dxg, dw2, db2);
    expect_bitwise(dwg, dw2, "layernorm dweight rerun");
    expect_bitwise(dbg, db2, "layernorm dbias rerun");

    rmsnorm_forward(x, w, 1e-5, yc, rc);
    rmsnorm_forward(on_gpu(x), on_gpu(w), 1e-5, yg, rg);
    expect_close(yc, yg, 0.0, "rmsnorm y");
    expect_close(rc, rg, 0.0, "rmsnorm rstd");
    dwc = dw0.clone();
    dwg = on_gpu(dw0);
    rmsnorm_backward(dy, x, w, rc, dxc, dwc);
    rmsnorm_backward(on_gpu(dy), on_gpu(x), on_gpu(w), on_gpu(rc), dxg, dwg);
    expect_close(dxc, dxg, kCancelSlack, "rmsnorm dx");
    const column_oracle::ColumnGrads fr = column_oracle::norm_grad(dy, x, nullptr, rc, dw0v, 0);
    EXPECT_EQ(floats_of(dwg), fr.grad) << "rmsnorm dweight: not the fixed order's bits";
    column_oracle::expect_within_bound(floats_of(dwc), floats_of(dwg), dw0v, fr, m, "rms dweight");
  }
}

TEST(OpsCuda, Attention) {
  MP_SKIP_WITHOUT_GPU();
  const AttentionShape s{.batch = 2, .seq = 37, .heads = 3, .head_dim = 16};
  const int64_t rows = s.batch * s.seq, h = s.heads * s.head_dim;
  for (DType dt : kActDtypes) {
    const Tensor qkv = random_tensor({rows, 3 * h}, dt, 15),
                 dout = random_tensor({rows, h}, dt, 16);
    Tensor oc = Tensor::empty({rows, h}, dt, Device::cpu()),
           og = Tensor::empty({rows, h}, dt, kGpu);
    const Shape ps{s.batch, s.heads, s.seq, s.seq};
    Tensor pc = Tensor::empty(ps, dt, Device::cpu()), pg = Tensor::empty(ps, dt, kGpu);
    attention_forward(qkv, s, oc, pc);
    attention_forward(on_gpu(qkv), s, og, pg);
    // Only the device exp differs (a few ulp of double): probs within 1 ulp. out = sum_j p_j v_j
    // from the rounded probs, each at most 1 ulp (<= 2^(1-mant) p_j) off, so
    // |d out| <= 2^(1-mant) * sum_j p_j |v_j| <= 2^(1-mant) * max|v| (sum_j p_j = 1), on top of
    // out's own 1-ulp rounding; max|qkv| bounds max|v|.
    expect_close(pc, pg, 0.0, "attention probs");
    expect_close(oc, og, std::ldexp(1.0, dt == DType::kBFloat16 ? -6 : -22), "attention out",
                 max_abs_of(qkv));
    // Given the same (CPU) probabilities the backward repeats the CPU's double arithmetic.
    Tensor dc = Tensor::empty({rows, 3 * h}, dt, Device::cpu()),
           dg = Tensor::empty({rows, 3 * h}, dt, kGpu);
    attention_backward(dout, qkv, pc, s, dc);
    attention_backward(on_gpu(dout), on_gpu(qkv), on_gpu(pc), s, dg);
    expect_bitwise(dc, dg, "attention dqkv");
  }
}

// The fused attention (kernels/attention/flash_attention.cu) against the exact reference (the CPU
// kernel) within the bound derived in tests/kernels/attention/flash_attention_bound.h (no device
// measurement existed when it was written), on S not a multiple of the key tile, grouped-query
// heads, both key tiles and a sequence of several query blocks; a rerun gives the same bits (no
// atomics).
TEST(OpsCuda, FlashAttentionWithinTheDerivedBound) {
  MP_SKIP_WITHOUT_GPU();
  const AttentionShape shapes[] = {
      {.batch = 2, .seq = 37, .heads = 3, .head_dim = 16},
      {.batch = 1, .seq = 70, .heads = 4, .head_dim = 32, .kv_heads = 2},
      {.batch = 1, .seq = 21, .heads = 2, .head_dim = 160, .kv_heads = 1},
      {.batch = 2, .seq = 300, .heads = 4, .head_dim = 64, .kv_heads = 1},
  };
  for (const AttentionShape& s : shapes)
    for (DType dt : kActDtypes) {
      SCOPED_TRACE(testing::Message() << "S=" << s.seq << " A=" << s.heads << " KV=" << s.kv()
                                      << " d=" << s.head_dim << " " << dtype_name(dt));
      const int64_t rows = s.batch * s.seq, h = s.heads * s.head_dim, w = s.qkv_width();
      const Tensor qkv = random_tensor({rows, w}, dt, 41, 1.5),
                   dout = random_tensor({rows, h}, dt, 42);
      Tensor oc = Tensor::empty({rows, h}, dt, Device::cpu()),
             pc = Tensor::empty({s.batch, s.heads, s.seq, s.seq}, dt, Device::cpu()),
             dc = Tensor::empty({rows, w}, dt, Device::cpu());
      attention_forward(qkv, s, oc, pc);
      attention_backward(dout, qkv, pc, s, dc);
      auto fused = [&](Tensor& out, Tensor& lse, Tensor& dqkv) {
        out = Tensor::empty({rows, h}, dt, kGpu);
        lse = Tensor::empty({s.batch, s.heads, s.seq}, DType::kFloat32, kGpu);
        dqkv = Tensor::empty({rows, w}, dt, kGpu);
        flash_attention_forward(on_gpu(qkv), s, out, lse);
        flash_attention_backward(on_gpu(dout), on_gpu(qkv), out, lse, s, dqkv);
      };
      Tensor og, lg, dg, og2, lg2, dg2;
      fused(og, lg, dg);
      fused(og2, lg2, dg2);
      auto doubles = [](const Tensor& t) {
        const std::vector<float> f = floats_of(t);
        return std::vector<double>(f.begin(), f.end());
      };
      const flash_bound::Bounds tol =
          flash_bound::bounds(doubles(qkv), doubles(dout), doubles(oc), doubles(dc), s, dt);
      auto within = [&](const Tensor& ref, const Tensor& got, const std::vector<double>& t,
                        const char* what) {
        const std::vector<float> a = floats_of(ref), b = floats_of(got);
        ASSERT_EQ(a.size(), t.size());
        int bad = 0;
        for (size_t i = 0; i < a.size(); ++i)
          if (!(std::fabs(static_cast<double>(a[i]) - b[i]) <= t[i]) && ++bad <= 5)
            ADD_FAILURE() << what << "[" << i << "]: ref " << a[i] << " fused " << b[i] << " tol "
                          << t[i];
        EXPECT_EQ(bad, 0) << what << ": " << bad << " elements outside the bound";
      };
      within(oc, og, tol.out, "fused out");
      within(dc, dg, tol.dqkv, "fused dqkv");
      expect_bitwise(og, og2, "fused out rerun");
      expect_bitwise(lg, lg2, "fused lse rerun");
      expect_bitwise(dg, dg2, "fused dqkv rerun");
    }
}

TEST(OpsCuda, CrossEntropy) {
  MP_SKIP_WITHOUT_GPU();
  const int64_t m = 29, v = 1000;
  std::vector<int32_t> tg(m);
  for (int64_t r = 0; r < m; ++r) tg[static_cast<size_t>(r)] = static_cast<int32_t>((r * 97) % v);
  const Tensor targets = Tensor::from_vector<int32_t>({m}, tg);
  for (DType dt : kActDtypes) {
    const Tensor logits = random_tensor({m, v}, dt, 17, 3.0);
    Tensor dc = Tensor::empty({m, v}, dt, Device::cpu()), dg = Tensor::empty({m, v}, dt, kGpu);
    const double lc = cross_entropy_forward_backward(logits, targets, 1.0 / m, dc);
    const double lg = cross_entropy_forward_backward(on_gpu(logits), on_gpu(targets), 1.0 / m, dg);
    // Tree vs serial double sums of exp over V: ~V * 2^-53 relative; 1e-12 leaves a 100x margin.
    EXPECT_NEAR(lg, lc, 1e-12 * std::fabs(lc));
    EXPECT_NEAR(cross_entropy_forward(on_gpu(logits), on_gpu(targets)), lc, 1e-12 * std::fabs(lc));
    // dlogits = scale (p - onehot): cancels at the target column only by a bounded amount.
    expect_close(dc, dg, kCancelSlack, "dlogits");
  }
  // Out-of-range targets are an input error on CUDA too.
  const Tensor bad = Tensor::from_vector<int32_t>({1}, {static_cast<int32_t>(v)});
  Tensor l = on_gpu(random_tensor({1, v}, DType::kFloat32, 18));
  try {
    cross_entropy_forward(l, on_gpu(bad));
    ADD_FAILURE() << "expected an input error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
  }
}

TEST(OpsCuda, EmbeddingBitwise) {
  MP_SKIP_WITHOUT_GPU();
  const int64_t vocab = 50, positions = 40, hidden = 270, batch = 3, seq = 31;
  std::mt19937 gen(19);
  std::vector<int32_t> ids(batch * seq);
  // Few distinct ids so rows repeat (the accumulation order matters).
  for (int32_t& id : ids) id = static_cast<int32_t>(gen() % 7) * 3;
  const Tensor idt = Tensor::from_vector<int32_t>({batch, seq}, ids);
  for (DType dt : kActDtypes) {
    const Tensor tok = random_tensor({vocab, hidden}, dt, 20),
                 pos = random_tensor({positions, hidden}, dt, 21);
    Tensor xc = Tensor::empty({batch * seq, hidden}, dt, Device::cpu()),
           xg = Tensor::empty({batch * seq, hidden}, dt, kGpu);
    embedding_forward(idt, tok, pos, xc);
    embedding_forward(on_gpu(idt), on_gpu(tok), on_gpu(pos), xg);
    expect_bitwise(xc, xg, "embedding x");
    const Tensor dx = random_tensor({batch * seq, hidden}, dt, 22);
    const Tensor dt0 = random_tensor({vocab, hidden}, DType::kFloat32, 23),
                 dp0 = random_tensor({positions, hidden}, DType::kFloat32, 24);
    Tensor dtc = dt0.clone(), dtg = on_gpu(dt0), dpc = dp0.clone(), dpg = on_gpu(dp0);
    embedding_backward(dx, idt, dtc, dpc);
    embedding_backward(on_gpu(dx), on_gpu(idt), dtg, dpg);
    expect_bitwise(dtc, dtg, "embedding dtok");
    expect_bitwise(dpc, dpg, "embedding dpos");
  }
}

// The copies one call makes on this thread's rank context (the counter of kernels/core/runtime.h).
template <typename F>
CopyCounts copies_of(F&& f) {
  CopyCounter counter;
  ScopedRankContext ctx(RankContext{0, kGpu, nullptr, nullptr, &counter});
  f();
  synchronize_current();
  return counter.counts();
}

// The full cross-entropy on the device downloads its 8-byte loss and nothing else (the row
// losses are summed on the device in row order); a target outside the vocabulary is still the
// input error naming it (found by the device scan that a NaN total triggers).
TEST(OpsCuda, CrossEntropyMovesOnlyTheLoss) {
  MP_SKIP_WITHOUT_GPU();
  const int64_t m = 40, v = 300;
  std::vector<int32_t> tg(m);
  for (int64_t r = 0; r < m; ++r) tg[static_cast<size_t>(r)] = static_cast<int32_t>((r * 31) % v);
  const Tensor logits = on_gpu(random_tensor({m, v}, DType::kFloat32, 40, 3.0));
  const Tensor targets = on_gpu(Tensor::from_vector<int32_t>({m}, tg));
  Tensor d = Tensor::empty({m, v}, DType::kFloat32, kGpu);
  double loss = 0;
  const CopyCounts c =
      copies_of([&] { loss = cross_entropy_forward_backward(logits, targets, 1.0 / m, d); });
  EXPECT_GT(loss, 0.0);
  EXPECT_EQ(c.device_to_host, 8);
  EXPECT_EQ(c.host_to_device, 0);
  EXPECT_EQ(c.copies, 1);
  tg[17] = static_cast<int32_t>(v + 3);
  const Tensor bad = on_gpu(Tensor::from_vector<int32_t>({m}, tg));
  try {
    cross_entropy_forward_backward(logits, bad, 1.0 / m, d);
    ADD_FAILURE() << "expected an input error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(e.message().find("target 303 at row 17 outside [0, 300)"), std::string::npos)
        << e.message();
  }
}

// Per-rank float64 values gathered in rank order on the device (device-to-device copies, as the
// communicator's all-gather moves them).
Tensor gathered_on_gpu(const std::vector<Tensor>& per_rank) {
  int64_t n = 0;
  for (const Tensor& t : per_rank) n += t.numel().value;
  Tensor all = Tensor::empty({n}, DType::kFloat64, kGpu);
  int64_t at = 0;
  for (const Tensor& t : per_rank) {
    copy_bytes(static_cast<char*>(all.raw_data()) + at, kGpu, t.raw_data(), t.device(), t.nbytes());
    at += t.nbytes().value;
  }
  return all;
}

// A column shard [begin, end) of a [m, v] tensor (host), for the vocabulary-parallel pieces.
Tensor column_shard(const Tensor& t, int64_t begin, int64_t end) {
  const int64_t m = t.shape()[0], v = t.shape()[1], w = end - begin;
  const size_t es = static_cast<size_t>(dtype_bits(t.dtype()) / 8);
  Tensor out = Tensor::empty({m, w}, t.dtype(), Device::cpu());
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(static_cast<char*>(out.raw_data()) + r * w * es,
                static_cast<const char*>(t.raw_data()) + (r * v + begin) * es,
                static_cast<size_t>(w) * es);
  return out;
}

// The vocabulary-parallel pieces on the device against the same pieces on the CPU, three uneven
// shards (334, 334, 332 of 1000): row maxima, target logits and the rank-order combines bitwise
// (max, copies and an exact one-term sum); the exp sums, log_z and the loss within 1e-12 relative
// (tree vs serial double sums of ~330 terms and the device's log: ~1e-15; 1000x margin); dlogits
// within 1 ulp plus the cancellation slack. The whole chain moves one 8-byte scalar (the loss).
// Under sequence parallelism (3 shards of seq 8) each rank's partial loss is checked the same way.
TEST(OpsCuda, VocabParallelCrossEntropyStaysOnTheDevice) {
  MP_SKIP_WITHOUT_GPU();
  const int64_t m = 24, v = 1000, seq = 8;
  const int64_t bounds[] = {0, 334, 668, 1000};
  std::vector<int32_t> tg(m);
  for (int64_t r = 0; r < m; ++r) tg[static_cast<size_t>(r)] = static_cast<int32_t>((r * 89) % v);
  const Tensor targets = Tensor::from_vector<int32_t>({m}, tg);
  const Tensor targets_g = on_gpu(targets);
  for (DType dt : kActDtypes) {
    const Tensor logits = random_tensor({m, v}, dt, 41, 3.0);
    std::vector<Tensor> shard_c, shard_g;
    for (int t = 0; t < 3; ++t) {
      shard_c.push_back(column_shard(logits, bounds[t], bounds[t + 1]));
      shard_g.push_back(on_gpu(shard_c.back()));
    }
    // CPU chain.
    std::vector<Tensor> mc, sc, tc;
    for (const Tensor& s : shard_c) mc.push_back(cross_entropy_shard_max(s));
    Tensor all = Tensor::empty({3 * m}, DType::kFloat64, Device::cpu());
    for (int t = 0; t < 3; ++t)
      std::memcpy(all.data<double>() + t * m, mc[t].data<double>(), m * sizeof(double));
    const Tensor max_c = cross_entropy_combine_ranks(all, 3, true);
    for (int t = 0; t < 3; ++t) {
      const CrossEntropyShardSums s =
          cross_entropy_shard_sums(shard_c[t], targets, bounds[t], v, max_c);
      sc.push_back(s.sum_exp);
      tc.push_back(s.target_logit);
    }
    const auto host_gather = [&](const std::vector<Tensor>& parts) {
      Tensor a = Tensor::empty({3 * m}, DType::kFloat64, Device::cpu());
      for (int t = 0; t < 3; ++t)
        std::memcpy(a.data<double>() + t * m, parts[t].data<double>(), m * sizeof(double));
      return a;
    };
    const Tensor se_c = cross_entropy_combine_ranks(host_gather(sc), 3, false);
    const Tensor tl_c = cross_entropy_combine_ranks(host_gather(tc), 3, false);
    Tensor lz_c;
    const double loss_c = cross_entropy_shard_loss(max_c, se_c, tl_c, targets, v, seq, 1, 0, lz_c);
    // Device chain, counted.
    Tensor max_g, se_g, tl_g, lz_g;
    double loss_g = 0;
    const CopyCounts c = copies_of([&] {
      std::vector<Tensor> mg, sg, tlg;
      for (const Tensor& s : shard_g) mg.push_back(cross_entropy_shard_max(s));
      max_g = cross_entropy_combine_ranks(gathered_on_gpu(mg), 3, true);
      for (int t = 0; t < 3; ++t) {
        const CrossEntropyShardSums s =
            cross_entropy_shard_sums(shard_g[t], targets_g, bounds[t], v, max_g);
        sg.push_back(s.sum_exp);
        tlg.push_back(s.target_logit);
      }
      se_g = cross_entropy_combine_ranks(gathered_on_gpu(sg), 3, false);
      tl_g = cross_entropy_combine_ranks(gathered_on_gpu(tlg), 3, false);
      loss_g = cross_entropy_shard_loss(max_g, se_g, tl_g, targets_g, v, seq, 1, 0, lz_g);
    });
    EXPECT_EQ(c.device_to_host, 8) << dtype_name(dt);
    EXPECT_EQ(c.host_to_device, 0) << dtype_name(dt);
    EXPECT_EQ(max_c.to_vector<double>(), max_g.to_vector<double>()) << "row maxima";
    EXPECT_EQ(tl_c.to_vector<double>(), tl_g.to_vector<double>()) << "target logits";
    const std::vector<double> a = se_c.to_vector<double>(), b = se_g.to_vector<double>();
    const std::vector<double> la = lz_c.to_vector<double>(), lb = lz_g.to_vector<double>();
    for (int64_t r = 0; r < m; ++r) {
      EXPECT_NEAR(b[r], a[r], 1e-12 * a[r]) << "sum_exp row " << r;
      EXPECT_NEAR(lb[r], la[r], 1e-12 * std::fabs(la[r]) + 1e-15) << "log_z row " << r;
    }
    EXPECT_NEAR(loss_g, loss_c, 1e-12 * std::fabs(loss_c));
    for (int t = 0; t < 3; ++t) {
      const int64_t w = bounds[t + 1] - bounds[t];
      Tensor dc = Tensor::empty({m, w}, dt, Device::cpu()), dg = Tensor::empty({m, w}, dt, kGpu);
      cross_entropy_shard_grad(shard_c[t], targets, bounds[t], v, lz_c, 1.0 / m, dc);
      cross_entropy_shard_grad(shard_g[t], targets_g, bounds[t], v, lz_g, 1.0 / m, dg);
      expect_close(dc, dg, kCancelSlack, "vocab-parallel dlogits");
    }
    for (int k = 0; k < 3; ++k) {
      Tensor lzc, lzg;
      const double pc = cross_entropy_shard_loss(max_c, se_c, tl_c, targets, v, seq, 4, k, lzc);
      const double pg = cross_entropy_shard_loss(max_g, se_g, tl_g, targets_g, v, seq, 4, k, lzg);
      EXPECT_NEAR(pg, pc, 1e-12 * std::fabs(pc)) << "sequence shard " << k;
    }
  }
  // A target outside the vocabulary: the loss piece reports it (input error, its row).
  std::vector<int32_t> bad = tg;
  bad[5] = -2;
  const Tensor bad_g = on_gpu(Tensor::from_vector<int32_t>({m}, bad));
  const Tensor logits_g = on_gpu(random_tensor({m, v}, DType::kFloat32, 42));
  const Tensor mx = cross_entropy_shard_max(logits_g);
  const CrossEntropyShardSums s = cross_entropy_shard_sums(logits_g, bad_g, 0, v, mx);
  Tensor lz;
  try {
    cross_entropy_shard_loss(mx, s.sum_exp, s.target_logit, bad_g, v, seq, 1, 0, lz);
    ADD_FAILURE() << "expected an input error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(e.message().find("target -2 at row 5"), std::string::npos) << e.message();
  }
}

// The embedding on the device checks its ids with one 8-byte download per call and groups the
// backward's rows on the device (nothing else crosses); dtok is bitwise the CPU's for a
// vocabulary shard (ids outside it left out) with 2000 rows (the scan's 1024 chunks, two rows
// each) and 1200 positions (38 warp chunks) over few distinct ids; an id outside the vocabulary is
// the input error naming its flat index.
TEST(OpsCuda, EmbeddingChecksAndGroupsOnTheDevice) {
  MP_SKIP_WITHOUT_GPU();
  const int64_t vocab = 5000, begin = 1500, rows = 2000, hidden = 40, batch = 4, seq = 300;
  std::mt19937 gen(43);
  std::vector<int32_t> ids(batch * seq);
  for (int32_t& id : ids)
    id = static_cast<int32_t>(1000 + (gen() % 23) * 150);  // 23 ids, ~half held
  const Tensor idt = Tensor::from_vector<int32_t>({batch, seq}, ids), idg = on_gpu(idt);
  const Tensor tok = random_tensor({rows, hidden}, DType::kFloat32, 44);
  const Tensor dx = random_tensor({batch * seq, hidden}, DType::kFloat32, 45);
  const Tensor tok_g = on_gpu(tok), dx_g = on_gpu(dx);
  Tensor xc = Tensor::empty({batch * seq, hidden}, DType::kFloat32, Device::cpu());
  Tensor xg = Tensor::empty({batch * seq, hidden}, DType::kFloat32, kGpu);
  embedding_forward(idt, tok, nullptr, begin, vocab, xc);
  const CopyCounts f = copies_of([&] { embedding_forward(idg, tok_g, nullptr, begin, vocab, xg); });
  expect_bitwise(xc, xg, "sharded embedding x");
  EXPECT_EQ(f.device_to_host, 8);
  EXPECT_EQ(f.host_to_device, 0);
  const Tensor d0 = random_tensor({rows, hidden}, DType::kFloat32, 46);
  Tensor dc = d0.clone(), dg = on_gpu(d0);
  embedding_backward(dx, idt, begin, vocab, &dc, nullptr);
  const CopyCounts b =
      copies_of([&] { embedding_backward(dx_g, idg, begin, vocab, &dg, nullptr); });
  expect_bitwise(dc, dg, "sharded embedding dtok");
  EXPECT_EQ(b.device_to_host, 8);
  EXPECT_EQ(b.host_to_device, 0);
  Tensor dg2 = on_gpu(d0);
  embedding_backward(dx_g, idg, begin, vocab, &dg2, nullptr);
  expect_bitwise(dg, dg2, "embedding dtok rerun");
  ids[7] = static_cast<int32_t>(vocab);
  try {
    embedding_forward(on_gpu(Tensor::from_vector<int32_t>({batch, seq}, ids)), tok_g, nullptr,
                      begin, vocab, xg);
    ADD_FAILURE() << "expected an input error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(e.message().find("token id 5000 at flat index 7 outside [0, 5000)"),
              std::string::npos)
        << e.message();
  }
}

// The Markov source's rows made on the device are bitwise the host's (same row function), for
// orders 1 and 2, and making them moves nothing across PCIe.
TEST(OpsCuda, MarkovRowsBitwiseTheHostWithoutCopies) {
  MP_SKIP_WITHOUT_GPU();
  const int64_t vocab = 11, batch = 6, width = 65;
  std::vector<double> cdf(vocab);
  double acc = 0;
  for (int64_t r = 0; r < vocab; ++r) cdf[r] = (acc += std::ldexp(1.0, -static_cast<int>(r) - 1));
  cdf.back() = 1.0;
  for (int64_t order : {1, 2}) {
    const int64_t contexts = order == 1 ? vocab : vocab * vocab;
    std::vector<int32_t> ranked(static_cast<size_t>(contexts * vocab));
    for (size_t i = 0; i < ranked.size(); ++i)
      ranked[i] = static_cast<int32_t>((i * 5 + i / vocab) % vocab);
    const MarkovTables host{Tensor::from_vector<double>({vocab}, cdf),
                            Tensor::from_vector<int32_t>({contexts * vocab}, ranked)};
    const MarkovTables dev{on_gpu(host.cdf), on_gpu(host.ranked)};
    const MarkovShape shape{
        .vocab = vocab, .order = order, .batch = batch, .width = width, .seed = 9, .stream = 4};
    Tensor hc = Tensor::empty({4, width}, DType::kInt32, Device::cpu());
    Tensor hg = Tensor::empty({4, width}, DType::kInt32, kGpu);
    markov_rows(host, shape, 5, 2, hc);
    const CopyCounts c = copies_of([&] { markov_rows(dev, shape, 5, 2, hg); });
    EXPECT_EQ(c.total(), 0);
    expect_bitwise(hc, hg, "markov rows");
  }
}

// The MoE router tests' logits (tests/kernels/moe/moe_logits.h), from their own seed.
std::vector<float> moe_logits(int64_t n, uint32_t seed) {
  std::mt19937 g(seed);
  return moe_testing::tied_logits(g, n);
}

// The router on the device runs the host's row function: the choices equal the CPU's (ties to
// the lower index included) and the router moves nothing across PCIe. The probabilities and
// weights use the device's double exp (CUDA's, within 1 ulp of double, against glibc's 0.51 ulp;
// kernels/moe/moe_row.h), so they are not guaranteed bitwise: the float-rounded probability can
// differ by 1 float ulp where the double lands within an ulp or two of a rounding boundary
// (of the order of 2^-27 of the elements, estimated), and a weight p / S by 2 ulps (its own
// rounding plus one ulp of p or S). The number of differing bits is recorded.
TEST(OpsCuda, MoeRouteChoicesEqualTheCpuOnTheDevice) {
  MP_SKIP_WITHOUT_GPU();
  constexpr int64_t kT = 1000, kE = 8;
  const Tensor logits = Tensor::from_vector<float>({kT, kE}, moe_logits(kT * kE, 61));
  const Tensor dl = on_gpu(logits);
  for (bool sigmoid : {false, true})
    for (int64_t k : {1, 2, 3}) {
      const MoeRouteOut cpu = moe_route(logits, k, sigmoid);
      MoeRouteOut gpu;
      Tensor counts;
      const CopyCounts c = copies_of([&] {
        gpu = moe_route(dl, k, sigmoid);
        counts = moe_expert_counts(gpu.expert, kE);
      });
      EXPECT_EQ(c.total(), 0) << "the router and its counts stay on the device";
      expect_bitwise(cpu.expert, gpu.expert, "moe experts");
      expect_bitwise(moe_expert_counts(cpu.expert, kE), counts, "moe counts");
      const std::vector<double> pc = cpu.probs.to_vector<double>(),
                                pg = gpu.probs.to_vector<double>();
      const std::vector<double> wc = cpu.weight.to_vector<double>(),
                                wg = gpu.weight.to_vector<double>();
      int differ = 0;
      for (size_t i = 0; i < pc.size(); ++i) {
        differ += pc[i] != pg[i];
        EXPECT_LE(std::fabs(pc[i] - pg[i]), ulp_at(pc[i], DType::kFloat32)) << "prob " << i;
      }
      for (size_t i = 0; i < wc.size(); ++i) {
        differ += wc[i] != wg[i];
        EXPECT_LE(std::fabs(wc[i] - wg[i]), 2 * ulp_at(wc[i], DType::kFloat32)) << "weight " << i;
      }
      RecordProperty("moe_route_differing_values_" + std::string(sigmoid ? "sigmoid" : "softmax") +
                         "_k" + std::to_string(k),
                     std::to_string(differ));
      // Given the same probabilities the device's probability sums are the host's, bitwise.
      expect_bitwise(moe_prob_sums(cpu.probs), moe_prob_sums(on_gpu(cpu.probs)), "prob sums");
    }
}

// The rest of the MoE layer on the device, fed the CPU's routing: the counts, the dispatch
// (several 256-pair chunks per expert, an expert nobody picks, keep_empty), the permutation
// (row widths that take the 16-, 4- and 1-byte copy paths), the combine, the unpermute sum, the
// combine backward and the router backward are bitwise the CPU's, and none of it copies a byte
// between the host and the device.
TEST(OpsCuda, MoeRowsAndBackwardBitwiseTheCpuWithoutCopies) {
  MP_SKIP_WITHOUT_GPU();
  constexpr int64_t kT = 300, kE = 8, kK = 2;
  std::vector<float> lv = moe_logits(kT * kE, 62);
  for (int64_t t = 0; t < kT; ++t) lv[static_cast<size_t>(t * kE + kE - 1)] = -30.0f;  // unused
  const MoeRouteOut r = moe_route(Tensor::from_vector<float>({kT, kE}, lv), kK, false);
  const Tensor d_expert = on_gpu(r.expert), d_weight_in = on_gpu(r.weight),
               d_probs = on_gpu(r.probs);
  const Tensor counts = moe_expert_counts(r.expert, kE);
  for (int64_t align : {1, 32})
    for (bool keep : {false, true}) {
      int64_t padded = 0;
      for (int64_t c : counts.to_vector<int64_t>()) padded += moe_row::padded_block(c, align, keep);
      const MoeDispatchOut cd = moe_dispatch(r.expert, counts, align, keep, padded);
      for (int64_t h : {64, 37, 3})
        for (DType dt : kActDtypes) {
          const Tensor x = random_tensor({kT, h}, dt, 63);
          const Tensor y = random_tensor({padded, h}, dt, 64);
          const Tensor dout = random_tensor({kT, h}, dt, 65);
          const Tensor gx = on_gpu(x), gy = on_gpu(y), gdout = on_gpu(dout);
          // CPU reference.
          const Tensor xp = moe_permute(x, cd.token);
          Tensor out = Tensor::empty({kT, h}, dt, Device::cpu()),
                 sum = Tensor::empty({kT, h}, dt, Device::cpu()),
                 dy = Tensor::empty({padded, h}, dt, Device::cpu());
          moe_combine(y, cd.slot, r.weight, out);
          moe_combine(y, cd.slot, Tensor(), sum);
          const Tensor dw = moe_combine_backward(dout, y, cd.slot, r.weight, dy);
          const Tensor dl =
              moe_route_backward(r.probs, r.expert, r.weight, dw, Tensor(), false, dt);
          // Device.
          Tensor g_counts, g_xp, g_dw, g_dl;
          MoeDispatchOut gd;
          Tensor g_out = Tensor::empty({kT, h}, dt, kGpu), g_sum = Tensor::empty({kT, h}, dt, kGpu),
                 g_dy = Tensor::empty({padded, h}, dt, kGpu);
          const CopyCounts c = copies_of([&] {
            g_counts = moe_expert_counts(d_expert, kE);
            gd = moe_dispatch(d_expert, g_counts, align, keep, padded);
            g_xp = moe_permute(gx, gd.token);
            moe_combine(gy, gd.slot, d_weight_in, g_out);
            moe_combine(gy, gd.slot, Tensor(), g_sum);
            g_dw = moe_combine_backward(gdout, gy, gd.slot, d_weight_in, g_dy);
            g_dl = moe_route_backward(d_probs, d_expert, d_weight_in, g_dw, Tensor(), false, dt);
          });
          EXPECT_EQ(c.total(), 0) << "align " << align << " width " << h;
          expect_bitwise(counts, g_counts, "counts");
          expect_bitwise(cd.token, gd.token, "dispatch token");
          expect_bitwise(cd.slot, gd.slot, "dispatch slot");
          expect_bitwise(xp, g_xp, "permute");
          expect_bitwise(out, g_out, "combine");
          expect_bitwise(sum, g_sum, "unpermute sum");
          expect_bitwise(dy, g_dy, "combine backward dy");
          expect_bitwise(dw, g_dw, "combine backward d_weight");
          expect_bitwise(dl, g_dl, "route backward");
        }
    }
  // The router backward with the load-balancing term (uploaded once, before the counting).
  std::vector<double> aux(kE);
  for (int64_t e = 0; e < kE; ++e) aux[static_cast<size_t>(e)] = 1e-3 * static_cast<double>(e + 1);
  std::vector<double> dwv(kT * kK);
  for (size_t i = 0; i < dwv.size(); ++i) dwv[i] = std::sin(static_cast<double>(i));
  const Tensor a = Tensor::from_vector<double>({kE}, aux),
               dw = Tensor::from_vector<double>({kT, kK}, dwv);
  const Tensor ga = on_gpu(a), gdw = on_gpu(dw);
  for (bool sigmoid : {false, true}) {
    const Tensor cpu =
        moe_route_backward(r.probs, r.expert, r.weight, dw, a, sigmoid, DType::kFloat32);
    Tensor gpu;
    const CopyCounts c = copies_of([&] {
      gpu = moe_route_backward(d_probs, d_expert, d_weight_in, gdw, ga, sigmoid, DType::kFloat32);
    });
    EXPECT_EQ(c.total(), 0);
    expect_bitwise(cpu, gpu, "route backward with the aux term");
  }
}

// RoPE's (cos, sin) table is uploaded once per process: a second call with the same positions
// moves nothing, and both calls give the same bits.
TEST(OpsCuda, RopeTableIsUploadedOnce) {
  MP_SKIP_WITHOUT_GPU();
  const AttentionShape s{.batch = 2, .seq = 19, .heads = 4, .head_dim = 8, .kv_heads = 2};
  std::vector<int64_t> positions(s.seq);
  for (int64_t t = 0; t < s.seq; ++t) positions[t] = 1000 + 3 * t;  // unlike any other test's
  const Tensor x = random_tensor({s.batch * s.seq, s.qkv_width()}, DType::kFloat32, 47);
  Tensor a = on_gpu(x), b = on_gpu(x);
  const CopyCounts first = copies_of([&] { rope_forward(a, s, 10000.0, positions); });
  const CopyCounts second = copies_of([&] { rope_forward(b, s, 10000.0, positions); });
  EXPECT_EQ(first.bulk_copies, 1);
  EXPECT_EQ(second.total(), 0);
  expect_bitwise(a, b, "rope with the cached table");
}

TEST(OpsCuda, AdamWBitwise) {
  MP_SKIP_WITHOUT_GPU();
  const int64_t n = 5003;
  const Tensor p0 = random_tensor({n}, DType::kFloat32, 25),
               g = random_tensor({n}, DType::kFloat32, 26, 0.01);
  const Tensor m0 = random_tensor({n}, DType::kFloat32, 27, 0.01);
  Tensor v0 = random_tensor({n}, DType::kFloat32, 28, 0.001);
  std::vector<float> vv = v0.to_vector<float>();
  for (float& x : vv) x = x * x;  // second moments are non-negative
  v0 = Tensor::from_vector<float>({n}, vv);
  for (double wd : {0.0, 0.1}) {
    const AdamWHyper hp{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = wd};
    Tensor pc = p0.clone(), mc = m0.clone(), vc = v0.clone();
    Tensor pg = on_gpu(p0), mg = on_gpu(m0), vg = on_gpu(v0);
    const Tensor gg = on_gpu(g);
    for (int64_t step = 1; step <= 3; ++step) {
      adamw_step(pc, g, mc, vc, step, hp);
      adamw_step(pg, gg, mg, vg, step, hp);
    }
    expect_bitwise(pc, pg, "adamw param");
    expect_bitwise(mc, mg, "adamw exp_avg");
    expect_bitwise(vc, vg, "adamw exp_avg_sq");
  }
  // Tree vs serial double sum of n squares: ~n * 2^-53 relative; 1e-12 is a 1000x margin.
  EXPECT_NEAR(sum_of_squares(on_gpu(p0)), sum_of_squares(p0), 1e-12 * sum_of_squares(p0));
}

// The grad norm's per-rank part on the device: the serial per-tensor sums and their running total
// (kernels::sum_of_squares_total) are bitwise the host's (EXPECT_EQ on doubles), over 130
// tensors (two launches of the 128-tensor kernel) of mixed sizes, empty ones included, and only
// the 8-byte result crosses to the host.
TEST(OpsCuda, SumOfSquaresTotalBitwiseAndOneScalarDownload) {
  MP_SKIP_WITHOUT_GPU();
  std::vector<Tensor> host, dev;
  for (int k = 0; k < 130; ++k) {
    const int64_t n = k % 17 == 0 ? 0 : (k * 977) % 4099 + 1;
    host.push_back(random_tensor({n}, DType::kFloat32, 100 + static_cast<uint32_t>(k), 0.05));
    dev.push_back(on_gpu(host.back()));
  }
  std::vector<const Tensor*> hp, dp;
  for (size_t k = 0; k < host.size(); ++k) {
    hp.push_back(&host[k]);
    dp.push_back(&dev[k]);
  }
  CopyCounter counter;
  double got = 0;
  {
    ScopedRankContext ctx(RankContext{0, kGpu, nullptr, nullptr, &counter});
    got = sum_of_squares_total(dp);
  }
  EXPECT_EQ(got, sum_of_squares_total(hp));
  EXPECT_EQ(counter.counts().device_to_host, 8);
  EXPECT_EQ(counter.counts().host_to_device, 0);
}

// A checkpoint's transfers: to_host_batched downloads device tensors of mixed dtypes and sizes
// bitwise in one bulk copy; copy_batched uploads them back in one bulk copy.
TEST(OpsCuda, BatchedDownloadAndUploadAreOneCopyEachAndBitwise) {
  MP_SKIP_WITHOUT_GPU();
  CopyCounter counter;
  ScopedRankContext ctx(RankContext{0, kGpu, nullptr, nullptr, &counter});
  const std::vector<Tensor> host = {random_tensor({3, 5}, DType::kFloat32, 1),
                                    random_tensor({7}, DType::kBFloat16, 2),
                                    Tensor::zeros({0}, DType::kFloat32, Device::cpu()),
                                    random_tensor({1000}, DType::kFloat32, 3)};
  std::vector<Tensor> dev;
  for (const Tensor& t : host) dev.push_back(on_gpu(t));
  const CopyCounts before = counter.counts();
  const std::vector<Tensor> down = to_host_batched(dev);
  const CopyCounts after_down = counter.counts() - before;
  EXPECT_EQ(after_down.bulk_copies, 1);
  EXPECT_EQ(after_down.host_to_device, 0);
  for (size_t k = 0; k < host.size(); ++k) {
    EXPECT_TRUE(down[k].device().is_cpu());
    expect_bitwise(host[k], down[k], "to_host_batched");
  }
  std::vector<Tensor> back;
  std::vector<Tensor*> dsts;
  for (const Tensor& t : host) back.push_back(Tensor::zeros(t.shape(), t.dtype(), kGpu));
  for (Tensor& t : back) dsts.push_back(&t);
  const CopyCounts before_up = counter.counts();
  copy_batched(dsts, host);
  const CopyCounts up = counter.counts() - before_up;
  EXPECT_EQ(up.bulk_copies, 1);
  EXPECT_EQ(up.device_to_host, 0);
  for (size_t k = 0; k < host.size(); ++k) expect_bitwise(host[k], back[k], "copy_batched");
}

#if MESHPROOF_HAVE_CUDA  // the CUDA runtime's own calls (no such API in a CPU-only build)
// Storage honours the device index: a tensor on the last visible device is allocated there and
// reads back (a no-op difference with one GPU, where it is device 0).
TEST(OpsCuda, AllocationOnTheTensorsDevice) {
  MP_SKIP_WITHOUT_GPU();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  const Device last = Device::cuda(count - 1);
  const Tensor h = random_tensor({257}, DType::kFloat32, 9);
  const Tensor d = h.to(last);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, d.raw_data()), cudaSuccess);
  EXPECT_EQ(attr.device, count - 1);
  expect_bitwise(h, d, "tensor on the last device");
}
#endif

}  // namespace
}  // namespace meshproof::kernels
