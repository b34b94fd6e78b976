// Gradient checks by central finite differences in float64 for every op family of the model, plus
// known-answer tests for Philox and AdamW. Each check compares the analytic gradient of
// L = sum(output * R) (R a fixed random tensor) with (L(x+h) - L(x-h)) / 2h per input element.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "kernels/attention/attention.h"
#include "kernels/ops/activation.h"
#include "kernels/ops/adamw.h"
#include "kernels/ops/cast.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/embedding.h"
#include "kernels/ops/layernorm.h"
#include "kernels/random/markov.h"
#include "kernels/random/philox.h"

namespace meshproof::kernels {
namespace {

Tensor random_f64(const Shape& shape, uint64_t seed, double scale = 1.0, double offset = 0.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> v(static_cast<size_t>(shape.numel().value));
  for (double& x : v) x = offset + scale * nd(rng);
  return Tensor::from_vector(shape, v);
}

double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel().value; ++i) s += a.data<double>()[i] * b.data<double>()[i];
  return s;
}

// Checks analytic gradient `grad` of scalar `loss()` with respect to every element of `x`.
// h = 1e-6 in float64: truncation error O(h^2) ~ 1e-12 and cancellation error ~ 1e-16/1e-6 =
// 1e-10 relative to the loss scale, so 1e-6 (abs + rel) leaves a wide margin while a wrong
// formula (errors of order 1e-1) fails.
void expect_fd(const std::function<double()>& loss, Tensor& x, const Tensor& grad,
               const char* what) {
  constexpr double kH = 1e-6, kTol = 1e-6;
  double* p = x.data<double>();
  for (int64_t i = 0; i < x.numel().value; ++i) {
    const double saved = p[i];
    p[i] = saved + kH;
    const double up = loss();
    p[i] = saved - kH;
    const double down = loss();
    p[i] = saved;
    const double fd = (up - down) / (2 * kH);
    const double an = grad.data<double>()[i];
    ASSERT_NEAR(an, fd, kTol * (1.0 + std::abs(fd))) << what << " element " << i;
  }
}

Tensor f64(const Shape& s) { return Tensor::zeros(s, DType::kFloat64, Device::cpu()); }

TEST(LayerNorm, FiniteDifferences) {
  const int64_t m = 3, h = 8;
  Tensor x = random_f64({m, h}, 1, 1.0, 0.3), w = random_f64({h}, 2, 0.5, 1.0),
         b = random_f64({h}, 3), r = random_f64({m, h}, 4);
  auto loss = [&] {
    Tensor y = f64({m, h}), mean = f64({m}), rstd = f64({m});
    layernorm_forward(x, w, b, 1e-5, y, mean, rstd);
    return dot(y, r);
  };
  Tensor y = f64({m, h}), mean = f64({m}), rstd = f64({m}), dx = f64({m, h}), dw = f64({h}),
         db = f64({h});
  layernorm_forward(x, w, b, 1e-5, y, mean, rstd);
  layernorm_backward(r, x, w, mean, rstd, dx, dw, db);
  expect_fd(loss, x, dx, "dx");
  expect_fd(loss, w, dw, "dweight");
  expect_fd(loss, b, db, "dbias");
}

TEST(RmsNorm, FiniteDifferences) {
  const int64_t m = 3, h = 8;
  Tensor x = random_f64({m, h}, 5, 1.0, 0.3), w = random_f64({h}, 6, 0.5, 1.0),
         r = random_f64({m, h}, 7);
  auto loss = [&] {
    Tensor y = f64({m, h}), rstd = f64({m});
    rmsnorm_forward(x, w, 1e-5, y, rstd);
    return dot(y, r);
  };
  Tensor y = f64({m, h}), rstd = f64({m}), dx = f64({m, h}), dw = f64({h});
  rmsnorm_forward(x, w, 1e-5, y, rstd);
  rmsnorm_backward(r, x, w, rstd, dx, dw);
  expect_fd(loss, x, dx, "dx");
  expect_fd(loss, w, dw, "dweight");
}

TEST(LayerNorm, NormalisesRows) {
  Tensor x = random_f64({2, 16}, 8, 3.0, 5.0), w = random_f64({16}, 0, 0.0, 1.0), b = f64({16}),
         y = f64({2, 16}), mean = f64({2}), rstd = f64({2});
  layernorm_forward(x, w, b, 1e-5, y, mean, rstd);
  for (int r = 0; r < 2; ++r) {
    double s = 0, sq = 0;
    for (int c = 0; c < 16; ++c) s += y.data<double>()[r * 16 + c];
    for (int c = 0; c < 16; ++c) sq += std::pow(y.data<double>()[r * 16 + c], 2);
    EXPECT_NEAR(s / 16, 0.0, 1e-12);
    // Biased variance with eps 1e-5 added: 1 - eps/var up to rounding.
    EXPECT_NEAR(sq / 16, 1.0, 1e-5);
  }
}

void check_unary(void (*fwd)(const Tensor&, Tensor&),
                 void (*bwd)(const Tensor&, const Tensor&, Tensor&), const char* what) {
  const int64_t n = 40;
  Tensor x = random_f64({n}, 9, 1.5), r = random_f64({n}, 10);
  // Keep ReLU's kink out of reach of the finite-difference step.
  for (int64_t i = 0; i < n; ++i)
    if (std::abs(x.data<double>()[i]) < 1e-3) x.data<double>()[i] = 0.5;
  auto loss = [&] {
    Tensor y = f64({n});
    fwd(x, y);
    return dot(y, r);
  };
  Tensor dx = f64({n});
  bwd(r, x, dx);
  expect_fd(loss, x, dx, what);
}

TEST(Activation, GeluFiniteDifferences) {
  check_unary([](const Tensor& x, Tensor& y) { gelu_forward(x, y); },
              [](const Tensor& dy, const Tensor& x, Tensor& dx) { gelu_backward(dy, x, dx); },
              "gelu");
}

// The backward that reads the forward's saved tanh(u) writes the same bits as the one that
// computes it again, for every float dtype, over normal values, values where tanh saturates,
// subnormals, zeros, infinities and NaNs; the saved values are tanh(u) itself.
TEST(Activation, GeluSavedTanhIsBitwiseTheRecomputedOne) {
  std::mt19937 rng(5);
  std::normal_distribution<double> nd(0.0, 3.0);
  std::vector<double> values = {0.0,      -0.0,      1e-40, -1e-40, 30.0, -30.0, 1e30, -1e30,
                                INFINITY, -INFINITY, NAN,   -NAN,   4.0,  -4.0,  0.5};
  while (values.size() < 4096) values.push_back(nd(rng));
  const auto n = static_cast<int64_t>(values.size());
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat64}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x = cast_to(Tensor::from_vector<double>({n}, values), dt);
    std::vector<double> dys(values.size());
    for (double& d : dys) d = nd(rng);
    const Tensor dy = cast_to(Tensor::from_vector<double>({n}, dys), dt);
    Tensor y0 = Tensor::empty({n}, dt), y1 = Tensor::empty({n}, dt);
    Tensor th = Tensor::empty({n}, DType::kFloat64);
    gelu_forward(x, y0);
    gelu_forward(x, y1, &th);
    EXPECT_EQ(std::memcmp(y0.raw_data(), y1.raw_data(), y0.nbytes().value), 0);
    const Tensor xd = cast_to(x, DType::kFloat64);
    for (int64_t i = 0; i < n; ++i) {
      const double v = xd.data<double>()[i];
      const double want = std::tanh(0.79788456080286535588 * (v + 0.044715 * v * v * v));
      const double got = th.data<double>()[i];
      EXPECT_TRUE(std::memcmp(&want, &got, 8) == 0 || (std::isnan(want) && std::isnan(got)))
          << "x = " << v;
    }
    Tensor dx0 = Tensor::empty({n}, dt), dx1 = Tensor::empty({n}, dt);
    gelu_backward(dy, x, dx0);
    gelu_backward(dy, x, dx1, &th);
    EXPECT_EQ(std::memcmp(dx0.raw_data(), dx1.raw_data(), dx0.nbytes().value), 0);
  }
}

TEST(Activation, GeluSavedTanhMustBeFloat64OfTheInputsSize) {
  const Tensor x = Tensor::zeros({8}, DType::kFloat32);
  Tensor y = Tensor::empty({8}, DType::kFloat32);
  Tensor wrong_dtype = Tensor::empty({8}, DType::kFloat32);
  Tensor wrong_size = Tensor::empty({7}, DType::kFloat64);
  EXPECT_THROW(gelu_forward(x, y, &wrong_dtype), Error);
  EXPECT_THROW(gelu_forward(x, y, &wrong_size), Error);
  EXPECT_THROW(gelu_backward(x, x, y, &wrong_dtype), Error);
}
TEST(Activation, ReluFiniteDifferences) { check_unary(relu_forward, relu_backward, "relu"); }

TEST(Activation, GeluTanhValues) {
  // Expected values from PyTorch 1.13 gelu(approximate='tanh') in float64; 1e-15 allows a
  // last-bit difference in tanh between libm versions.
  Tensor x = Tensor::from_vector<double>({3}, {-1.0, 0.5, 2.0}), y = f64({3});
  gelu_forward(x, y);
  EXPECT_NEAR(y.data<double>()[0], -0.15880800939172324, 1e-15);
  EXPECT_NEAR(y.data<double>()[1], 0.34571400982514394, 1e-15);
  EXPECT_NEAR(y.data<double>()[2], 1.954597694087775, 1e-15);
}

TEST(Activation, SwiGluFiniteDifferences) {
  const int64_t n = 30;
  Tensor g = random_f64({n}, 11, 2.0), u = random_f64({n}, 12), r = random_f64({n}, 13);
  auto loss = [&] {
    Tensor y = f64({n});
    swiglu_forward(g, u, y);
    return dot(y, r);
  };
  Tensor dg = f64({n}), du = f64({n});
  swiglu_backward(r, g, u, dg, du);
  expect_fd(loss, g, dg, "dgate");
  expect_fd(loss, u, du, "dup");
}

TEST(Attention, FiniteDifferences) {
  const AttentionShape s{2, 5, 2, 3};
  const int64_t rows = s.batch * s.seq, h = s.heads * s.head_dim;
  Tensor qkv = random_f64({rows, 3 * h}, 14), r = random_f64({rows, h}, 15);
  auto loss = [&] {
    Tensor out = f64({rows, h}), probs = f64({s.batch, s.heads, s.seq, s.seq});
    attention_forward(qkv, s, out, probs);
    return dot(out, r);
  };
  Tensor out = f64({rows, h}), probs = f64({s.batch, s.heads, s.seq, s.seq}),
         dqkv = f64({rows, 3 * h});
  attention_forward(qkv, s, out, probs);
  attention_backward(r, qkv, probs, s, dqkv);
  expect_fd(loss, qkv, dqkv, "dqkv");
}

TEST(Attention, CausalAndInterleaved) {
  // One head, d = 1: out[i] = sum_{j<=i} softmax(q_i k_j)_j v_j. With k = 0 the weights are
  // uniform over the causal prefix, so out[i] = mean(v[0..i]); columns are (q, k, v).
  const AttentionShape s{1, 3, 1, 1};
  Tensor qkv = Tensor::from_vector<double>({3, 3}, {1, 0, 1, 2, 0, 2, 3, 0, 6});
  Tensor out = f64({3, 1}), probs = f64({1, 1, 3, 3});
  attention_forward(qkv, s, out, probs);
  EXPECT_DOUBLE_EQ(out.data<double>()[0], 1.0);
  EXPECT_DOUBLE_EQ(out.data<double>()[1], 1.5);
  EXPECT_DOUBLE_EQ(out.data<double>()[2], 3.0);
  EXPECT_EQ(probs.data<double>()[1], 0.0);  // above the diagonal
}

TEST(Embedding, BackwardIsAdjointOfForward) {
  const int64_t v = 5, p = 4, h = 3, b = 2, seq = 3;
  Tensor ids = Tensor::from_vector<int32_t>({b, seq}, {0, 4, 4, 2, 1, 0});
  Tensor tok = random_f64({v, h}, 16), pos = random_f64({p, h}, 17),
         r = random_f64({b * seq, h}, 18);
  auto loss = [&] {
    Tensor x = f64({b * seq, h});
    embedding_forward(ids, tok, pos, x);
    return dot(x, r);
  };
  Tensor dtok = f64({v, h}), dpos = f64({p, h});
  embedding_backward(r, ids, dtok, dpos);
  expect_fd(loss, tok, dtok, "dtok");
  expect_fd(loss, pos, dpos, "dpos");
}

TEST(Embedding, RejectsOutOfRangeIds) {
  Tensor ids = Tensor::from_vector<int32_t>({1, 2}, {0, 7});
  Tensor tok = f64({5, 2}), pos = f64({4, 2}), x = f64({2, 2});
  try {
    embedding_forward(ids, tok, pos, x);
    FAIL() << "expected an input error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(e.message().find("token id 7"), std::string::npos) << e.message();
  }
}

TEST(CrossEntropy, FiniteDifferencesAndValue) {
  const int64_t m = 4, v = 6;
  Tensor logits = random_f64({m, v}, 19, 2.0);
  Tensor targets = Tensor::from_vector<int32_t>({m}, {0, 5, 2, 2});
  const double scale = 1.0 / m;
  auto loss = [&] { return scale * cross_entropy_forward(logits, targets); };
  Tensor d = f64({m, v});
  const double sum = cross_entropy_forward_backward(logits, targets, scale, d);
  expect_fd(loss, logits, d, "dlogits");
  // Uniform logits: loss ln(V) per row.
  Tensor flat = f64({m, v});
  EXPECT_NEAR(cross_entropy_forward(flat, targets), m * std::log(6.0), 1e-12);
  EXPECT_GT(sum, 0.0);
}

// The column shard [begin, end) of a float64 [m, v] tensor.
Tensor columns(const Tensor& t, int64_t begin, int64_t end) {
  const int64_t m = t.shape()[0], v = t.shape()[1];
  Tensor out = f64({m, end - begin});
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = begin; c < end; ++c)
      out.data<double>()[r * (end - begin) + c - begin] = t.data<double>()[r * v + c];
  return out;
}

// The tp ranks' per-row values gathered in rank order, as the model's all-gather lays them out.
Tensor gathered(const std::vector<Tensor>& per_rank) {
  std::vector<double> all;
  for (const Tensor& t : per_rank)
    for (int64_t i = 0; i < t.numel().value; ++i) all.push_back(t.data<double>()[i]);
  return Tensor::from_vector<double>({static_cast<int64_t>(all.size())}, all);
}

// The vocabulary-parallel pieces over three uneven column shards (3, 3, 1 of 7: torch.chunk)
// reproduce the single-rank cross-entropy: the row maxima and target logits exactly (a max and a
// sum with one non-zero term are exact), the loss and the gradient up to the order of the exp sums
// (shard sums then the tp sum instead of one serial sum: a few ulp of double; 1e-13 relative is
// >100x that and far below a wrong formula's error).
TEST(CrossEntropy, VocabParallelPiecesEqualTheSingleRankLoss) {
  const int64_t m = 6, v = 7, seq = 3;
  const Tensor logits = random_f64({m, v}, 31, 2.0);
  const Tensor targets = Tensor::from_vector<int32_t>({m}, {0, 6, 3, 2, 5, 6});
  const int64_t bounds[] = {0, 3, 6, 7};
  std::vector<Tensor> shard, maxes;
  for (int t = 0; t < 3; ++t) {
    shard.push_back(columns(logits, bounds[t], bounds[t + 1]));
    maxes.push_back(cross_entropy_shard_max(shard.back()));
  }
  const Tensor row_max = cross_entropy_combine_ranks(gathered(maxes), 3, true);
  std::vector<Tensor> sums, tls;
  for (int t = 0; t < 3; ++t) {
    const CrossEntropyShardSums s =
        cross_entropy_shard_sums(shard[t], targets, bounds[t], v, row_max);
    sums.push_back(s.sum_exp);
    tls.push_back(s.target_logit);
  }
  const Tensor sum_exp = cross_entropy_combine_ranks(gathered(sums), 3, false);
  const Tensor target = cross_entropy_combine_ranks(gathered(tls), 3, false);
  for (int64_t r = 0; r < m; ++r) {
    double mx = -INFINITY;
    for (int64_t c = 0; c < v; ++c) mx = std::max(mx, logits.data<double>()[r * v + c]);
    EXPECT_EQ(row_max.data<double>()[r], mx) << "row " << r;
    EXPECT_EQ(target.data<double>()[r], logits.data<double>()[r * v + targets.data<int32_t>()[r]])
        << "row " << r;
  }
  Tensor log_z;
  const double loss =
      cross_entropy_shard_loss(row_max, sum_exp, target, targets, v, seq, 1, 0, log_z);
  Tensor d_ref = f64({m, v});
  const double ref = cross_entropy_forward_backward(logits, targets, 0.25, d_ref);
  EXPECT_NEAR(loss, ref, 1e-13 * std::fabs(ref));
  for (int t = 0; t < 3; ++t) {
    Tensor d = f64({m, bounds[t + 1] - bounds[t]});
    cross_entropy_shard_grad(shard[t], targets, bounds[t], v, log_z, 0.25, d);
    const Tensor want = columns(d_ref, bounds[t], bounds[t + 1]);
    for (int64_t i = 0; i < d.numel().value; ++i)
      EXPECT_NEAR(d.data<double>()[i], want.data<double>()[i], 1e-13) << "shard " << t << " " << i;
  }
  // Sequence parallelism: rank k of 3 counts the rows r with r % seq == k (seq 3: one position
  // each per sequence), added in row order; the three partial sums add up to the whole loss.
  double parts = 0;
  for (int k = 0; k < 3; ++k) {
    Tensor lz;
    const double part =
        cross_entropy_shard_loss(row_max, sum_exp, target, targets, v, seq, 3, k, lz);
    double want = 0;
    for (int64_t r = k; r < m; r += seq) want += lz.data<double>()[r] - target.data<double>()[r];
    EXPECT_EQ(part, want) << "sequence shard " << k;
    parts += part;
  }
  EXPECT_NEAR(parts, loss, 1e-13 * std::fabs(loss));
}

// The tp combine adds in rank order: 1 + 1e16 rounds to 1e16, which rank 2's -1e16 cancels to 0;
// any other order keeps the 1. The max keeps the largest.
TEST(CrossEntropy, CombineRanksAddsInRankOrder) {
  const Tensor every = Tensor::from_vector<double>({6}, {1.0, 2.0, 1e16, 5.0, -1e16, 3.0});
  const Tensor sum = cross_entropy_combine_ranks(every, 3, false);
  EXPECT_EQ(sum.data<double>()[0], 0.0);
  EXPECT_EQ(sum.data<double>()[1], 10.0);
  const Tensor mx = cross_entropy_combine_ranks(every, 3, true);
  EXPECT_EQ(mx.data<double>()[0], 1e16);
  EXPECT_EQ(mx.data<double>()[1], 5.0);
  EXPECT_THROW(cross_entropy_combine_ranks(every, 4, false), Error);  // 6 values over 4 ranks
}

TEST(CrossEntropy, ShardPiecesRejectTargetsOutsideTheVocabulary) {
  const Tensor logits = random_f64({2, 3}, 32);
  const Tensor targets = Tensor::from_vector<int32_t>({2}, {1, 9});
  const Tensor row_max = cross_entropy_shard_max(logits);
  try {
    cross_entropy_shard_sums(logits, targets, 0, 7, row_max);
    ADD_FAILURE() << "expected an input error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(e.message().find("target 9 at row 1 outside [0, 7)"), std::string::npos)
        << e.message();
  }
  Tensor log_z = Tensor::from_vector<double>({2}, {0.0, 0.0}), d = f64({2, 3});
  EXPECT_THROW(cross_entropy_shard_grad(logits, targets, 0, 7, log_z, 1.0, d), Error);
}

// The Markov rows (kernels::markov_rows on the host; the CUDA kernel runs the same row function)
// against the source's definition written out independently here: uniform first `order` tokens,
// then the ranked token of the first cdf bucket above u. Rows of a sub-range equal those rows of
// the whole batch (each row depends on its global index only).
TEST(Markov, RowsFollowTheDefinition) {
  const int64_t vocab = 5, batch = 4, width = 9;
  std::vector<double> cdf{0.5, 0.75, 0.875, 0.9375, 1.0};
  for (int64_t order : {0, 1, 2}) {
    int64_t contexts = 1;
    for (int64_t i = 0; i < order; ++i) contexts *= vocab;
    std::vector<int32_t> ranked(static_cast<size_t>(contexts * vocab));
    for (size_t i = 0; i < ranked.size(); ++i)
      ranked[i] = static_cast<int32_t>((i * 7 + i / vocab) % vocab);
    const MarkovTables tables{Tensor::from_vector<double>({vocab}, cdf),
                              Tensor::from_vector<int32_t>({contexts * vocab}, ranked)};
    const MarkovShape shape{.vocab = vocab,
                            .order = order,
                            .batch = batch,
                            .width = width,
                            .seed = 77,
                            .stream = philox_stream("test.tokens")};
    const int64_t step = 3;
    Tensor all = Tensor::empty({batch, width}, DType::kInt32, Device::cpu());
    markov_rows(tables, shape, step, 0, all);
    for (int64_t r = 0; r < batch; ++r) {
      std::vector<int32_t> want(static_cast<size_t>(width));
      for (int64_t s = 0; s < width; ++s) {
        const double u =
            philox_uniform(77, shape.stream, static_cast<uint64_t>((step * batch + r) * width + s));
        if (s < order) {
          want[s] =
              static_cast<int32_t>(std::min<int64_t>(vocab - 1, static_cast<int64_t>(u * vocab)));
          continue;
        }
        int64_t context = 0;
        for (int64_t j = s - order; j < s; ++j) context = context * vocab + want[j];
        int64_t rank = vocab - 1;
        for (int64_t k = 0; k < vocab; ++k)
          if (u < cdf[static_cast<size_t>(k)]) {
            rank = k;
            break;
          }
        want[s] = ranked[static_cast<size_t>(context * vocab + rank)];
      }
      for (int64_t s = 0; s < width; ++s)
        EXPECT_EQ(all.data<int32_t>()[r * width + s], want[s])
            << "order " << order << " row " << r << " token " << s;
    }
    Tensor part = Tensor::empty({2, width}, DType::kInt32, Device::cpu());
    markov_rows(tables, shape, step, 1, part);
    for (int64_t i = 0; i < 2 * width; ++i)
      EXPECT_EQ(part.data<int32_t>()[i], all.data<int32_t>()[width + i]);
    Tensor too_many = Tensor::empty({2, width}, DType::kInt32, Device::cpu());
    EXPECT_THROW(markov_rows(tables, shape, step, 3, too_many), Error);  // rows 3, 4 of 4
  }
}

TEST(Elementwise, BiasGradIsAdjointOfAddBias) {
  const int64_t m = 3, n = 4;
  Tensor b = random_f64({n}, 20), r = random_f64({m, n}, 21), base = random_f64({m, n}, 22);
  auto loss = [&] {
    Tensor y = base.clone();
    add_bias_(y, b);
    return dot(y, r);
  };
  Tensor db = f64({n});
  bias_grad(r, db);
  expect_fd(loss, b, db, "dbias");
}

TEST(Elementwise, DropoutMaskIsCounterBased) {
  const int64_t n = 20000;
  Tensor x = random_f64({n}, 23, 0.0, 1.0);  // all ones
  Tensor y = f64({n}), dx = f64({n});
  const DropoutKey key{7, philox_stream("test"), 1000};
  dropout_forward(x, 0.25, key, y);
  dropout_backward(x, 0.25, key, dx);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = y.data<double>()[i];
    ASSERT_TRUE(v == 0.0 || std::abs(v - 1.0 / 0.75) < 1e-15);
    ASSERT_EQ(v, dx.data<double>()[i]);  // backward regenerates the same mask
    kept += v != 0.0;
  }
  // Binomial(20000, 0.75): sd = sqrt(n p (1-p)) ~ 61; 5 sd = 306.
  EXPECT_NEAR(static_cast<double>(kept), 0.75 * n, 306);
  // A slice with the matching first_index reproduces the same elements.
  Tensor part = x.slice_rows(500, 600).clone(), ypart = f64({100});
  dropout_forward(part, 0.25, {7, key.stream, 1500}, ypart);
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(ypart.data<double>()[i], y.data<double>()[500 + i]);
}

TEST(Philox, KnownAnswerVectors) {
  // Random123 kat_vectors for philox4x32_10 (counter, key) -> output.
  const PhiloxBlock zero = philox4x32_10({0, 0, 0, 0}, 0);
  EXPECT_EQ(zero, (PhiloxBlock{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  const PhiloxBlock ones =
      philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffffffffffull);
  EXPECT_EQ(ones, (PhiloxBlock{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  const PhiloxBlock pi = philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                                       (uint64_t{0x299f31d0u} << 32) | 0xa4093822u);
  EXPECT_EQ(pi, (PhiloxBlock{0xd16cfe09u, 0x94fdcceb, 0x5001e420u, 0x24126ea1u}));
}

TEST(Philox, NormalMoments) {
  const int n = 200000;
  double s = 0, sq = 0;
  for (int i = 0; i < n; ++i) {
    const double z = philox_normal(42, philox_stream("w"), static_cast<uint64_t>(i));
    s += z;
    sq += z * z;
  }
  // Standard errors: mean 1/sqrt(n) = 0.0022, variance sqrt(2/n) = 0.0032; allow 5 sigma.
  EXPECT_NEAR(s / n, 0.0, 0.011);
  EXPECT_NEAR(sq / n, 1.0, 0.016);
}

TEST(AdamW, MatchesPyTorchFormulaInDouble) {
  // Three steps on a 3-element tensor against the PyTorch AdamW formula evaluated in double;
  // the fp32 implementation agrees to fp32 rounding (rel 1e-6).
  std::vector<double> p{0.5, -1.0, 2.0}, m(3, 0), v(3, 0);
  const std::vector<std::vector<double>> grads{
      {0.1, -0.2, 0.3}, {0.05, 0.4, -0.1}, {-0.3, 0.0, 0.2}};
  Tensor tp = Tensor::from_vector<float>({3}, {0.5f, -1.0f, 2.0f});
  Tensor tm = Tensor::zeros({3}, DType::kFloat32, Device::cpu());
  Tensor tv = Tensor::zeros({3}, DType::kFloat32, Device::cpu());
  const AdamWHyper hp{0.01, 0.9, 0.95, 1e-8, 0.1};
  for (int t = 1; t <= 3; ++t) {
    const auto& g = grads[static_cast<size_t>(t - 1)];
    Tensor tg = Tensor::from_vector<float>({3}, {float(g[0]), float(g[1]), float(g[2])});
    adamw_step(tp, tg, tm, tv, t, hp);
    for (int i = 0; i < 3; ++i) {
      p[i] *= 1 - hp.lr * hp.weight_decay;
      m[i] = hp.beta1 * m[i] + (1 - hp.beta1) * g[i];
      v[i] = hp.beta2 * v[i] + (1 - hp.beta2) * g[i] * g[i];
      const double mhat = m[i] / (1 - std::pow(hp.beta1, t));
      const double vhat = v[i] / (1 - std::pow(hp.beta2, t));
      p[i] -= hp.lr * mhat / (std::sqrt(vhat) + hp.eps);
    }
  }
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(tp.data<float>()[i], p[i], 1e-6 * std::abs(p[i]));
}

TEST(Ops, RejectWrongSizes) {
  Tensor x = f64({2, 4}), y = f64({2, 3});
  EXPECT_THROW(gelu_forward(x, y), Error);
  Tensor w = f64({3}), b = f64({4}), mean = f64({2}), rstd = f64({2}), out = f64({2, 4});
  EXPECT_THROW(layernorm_forward(x, w, b, 1e-5, out, mean, rstd), Error);
}

TEST(Cast, RoundTripsFloat32ThroughFloat64) {
  Tensor a = Tensor::from_vector<float>({3}, {1.5f, -2.25f, 1e-30f});
  Tensor d = cast_to(a, DType::kFloat64);
  Tensor back = cast_to(d, DType::kFloat32);
  EXPECT_EQ(back.to_vector<float>(), a.to_vector<float>());
  EXPECT_EQ(d.data<double>()[1], -2.25);
}

// sum_of_squares_total (the grad norm's per-rank part) is exactly the running host sum of the
// per-tensor sums in list order (bitwise: EXPECT_EQ on doubles), 0 for no tensors, and rejects
// non-float32 tensors by name.
TEST(SumOfSquaresTotal, IsTheRunningSumOfPerTensorSumsInOrder) {
  std::vector<Tensor> ts;
  for (int64_t n : {0, 1, 7, 1000, 33}) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      v[static_cast<size_t>(i)] =
          std::ldexp(static_cast<float>((i * 37 + n) % 101) - 50.0f, static_cast<int>(i % 13) - 6);
    ts.push_back(Tensor::from_vector(Shape{n}, v));
  }
  std::vector<const Tensor*> ptrs;
  double want = 0;
  for (const Tensor& t : ts) {
    ptrs.push_back(&t);
    want += sum_of_squares(t);
  }
  EXPECT_EQ(sum_of_squares_total(ptrs), want);
  EXPECT_GT(want, 0.0);
  EXPECT_EQ(sum_of_squares_total({}), 0.0);
  const Tensor bf = Tensor::zeros(Shape{4}, DType::kBFloat16, Device::cpu());
  try {
    sum_of_squares_total({&ts[1], &bf});
    ADD_FAILURE() << "a bfloat16 tensor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not float32"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshproof::kernels

namespace meshproof::kernels {
namespace {

TEST(BFloat16, RoundsToNearestEven) {
  EXPECT_EQ(BFloat16(1.0f).bits, 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 0x1p-8f)), 1.0f);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
  Tensor a = Tensor::from_vector<float>({2}, {3.0f, -0.1f});
  Tensor b = cast_to(a, DType::kBFloat16);
  EXPECT_EQ(b.dtype(), DType::kBFloat16);
  EXPECT_EQ(cast_to(b, DType::kFloat32).to_vector<float>()[0], 3.0f);
}

TEST(BFloat16, OpsRoundOnceFromHigherPrecision) {
  // A bf16 LayerNorm equals the float64 LayerNorm of the same (bf16-representable) inputs rounded
  // once to bf16: every output within half a bf16 ulp (8 significant bits: 2^-8 relative) of the
  // float64 result.
  const int64_t m = 4, h = 16;
  Tensor x64 = cast_to(cast_to(random_f64({m, h}, 30), DType::kBFloat16), DType::kFloat64);
  Tensor w64 = cast_to(cast_to(random_f64({h}, 31, 0.3, 1.0), DType::kBFloat16), DType::kFloat64);
  Tensor b64 = cast_to(cast_to(random_f64({h}, 32), DType::kBFloat16), DType::kFloat64);
  Tensor y64 = f64({m, h}), mean64 = f64({m}), rstd64 = f64({m});
  layernorm_forward(x64, w64, b64, 1e-5, y64, mean64, rstd64);
  auto bf = [](const Tensor& t) { return cast_to(t, DType::kBFloat16); };
  Tensor x = bf(x64), w = bf(w64), b = bf(b64);
  Tensor y = Tensor::empty({m, h}, DType::kBFloat16, Device::cpu());
  Tensor mean = Tensor::empty({m}, DType::kBFloat16, Device::cpu());
  Tensor rstd = Tensor::empty({m}, DType::kBFloat16, Device::cpu());
  layernorm_forward(x, w, b, 1e-5, y, mean, rstd);
  const auto yv = cast_to(y, DType::kFloat32).to_vector<float>();
  for (int64_t i = 0; i < m * h; ++i) {
    const double ref = y64.data<double>()[i];
    EXPECT_LE(std::abs(yv[static_cast<size_t>(i)] - ref), std::abs(ref) * 0x1p-8 + 1e-30) << i;
  }
  // Parameter gradients stay float32 with bf16 activations.
  Tensor dx = Tensor::empty({m, h}, DType::kBFloat16, Device::cpu());
  Tensor dw = Tensor::zeros({h}, DType::kFloat32, Device::cpu());
  Tensor db = Tensor::zeros({h}, DType::kFloat32, Device::cpu());
  layernorm_backward(y, x, w, mean, rstd, dx, dw, db);
  EXPECT_GT(sum_of_squares(dw), 0.0);
}

}  // namespace
}  // namespace meshproof::kernels
