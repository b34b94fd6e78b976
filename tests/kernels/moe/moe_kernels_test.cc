// The MoE kernels' CPU reference (kernels/moe/moe_route.h, kernels/moe/moe_rows.h, docs/design.md
// section 37) against independent formulations: the router's row function against the stable
// sort of the probabilities as engine/moe/moe.cc computed it before (ties by value to the lower
// index, with many ties), its backward against the per-token formula written with a separate dp
// vector, the dispatch against std::stable_sort of the pairs by expert with the padded offsets, and
// the permute / combine / combine backward / unpermute sum against plain loops. The CUDA kernels
// run the same row functions; their comparison is OpsCuda.Moe* (label gpu).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/moe/moe_route.h"
#include "kernels/moe/moe_row.h"
#include "kernels/moe/moe_rows.h"
#include "kernels/ops/cast.h"
#include "tests/kernels/moe/moe_logits.h"

namespace meshproof::kernels {
namespace {

// The router as engine/moe/moe.cc computed it before the row function existed (softmax over the
// row's max, std::stable_sort of the indices by descending probability, the first k).
void route_reference(const std::vector<double>& l, int64_t k, bool sigmoid, bool f64,
                     std::vector<double>& p, std::vector<int32_t>& ex, std::vector<double>& w) {
  const size_t e_n = l.size();
  const auto round = [f64](double v) {
    return f64 ? v : static_cast<double>(static_cast<float>(v));
  };
  p.assign(e_n, 0.0);
  if (sigmoid) {
    for (size_t e = 0; e < e_n; ++e) p[e] = round(1.0 / (1.0 + std::exp(-l[e])));
  } else {
    const double mx = *std::max_element(l.begin(), l.end());
    double sum = 0;
    for (size_t e = 0; e < e_n; ++e) sum += std::exp(l[e] - mx);
    for (size_t e = 0; e < e_n; ++e) p[e] = round(std::exp(l[e] - mx) / sum);
  }
  // A stable insertion sort of the indices by descending probability (an element moves before
  // another only when strictly larger, so equal probabilities keep index order). Written out
  // rather than std::stable_sort, whose inlined buffer code trips GCC 12's -Wstringop-overread
  // at -O3 on these small arrays.
  std::vector<int32_t> order;
  for (size_t e = 0; e < e_n; ++e) {
    size_t at = order.size();
    while (at > 0 && p[e] > p[static_cast<size_t>(order[at - 1])]) --at;
    order.insert(order.begin() + static_cast<std::ptrdiff_t>(at), static_cast<int32_t>(e));
  }
  double chosen = 0;
  for (int64_t j = 0; j < k; ++j) chosen += p[static_cast<size_t>(order[static_cast<size_t>(j)])];
  ex.assign(order.begin(), order.begin() + k);
  w.clear();
  for (int64_t j = 0; j < k; ++j) w.push_back(round(p[static_cast<size_t>(ex[j])] / chosen));
}

using moe_testing::tied_logits;

TEST(MoeRoute, RowFunctionIsTheStableSortOfTheProbabilities) {
  std::mt19937 g(7);
  int ties = 0;
  for (int64_t e_n = 1; e_n <= 9; ++e_n)
    for (int64_t k = 1; k <= e_n; ++k)
      for (bool sigmoid : {false, true}) {
        constexpr int64_t kTokens = 23;
        const std::vector<float> l = tied_logits(g, kTokens * e_n);
        for (bool f64 : {false, true}) {
          Tensor logits = Tensor::from_vector<float>({kTokens, e_n}, l);
          if (f64) logits = cast_to(logits, DType::kFloat64);
          const MoeRouteOut r = moe_route(logits, k, sigmoid);
          const std::vector<double> p = r.probs.to_vector<double>(),
                                    w = r.weight.to_vector<double>();
          const std::vector<int32_t> ex = r.expert.to_vector<int32_t>();
          for (int64_t t = 0; t < kTokens; ++t) {
            std::vector<double> row(l.begin() + t * e_n, l.begin() + (t + 1) * e_n);
            std::vector<double> pr, wr;
            std::vector<int32_t> er;
            route_reference(row, k, sigmoid, f64, pr, er, wr);
            for (int64_t e = 0; e < e_n; ++e)
              EXPECT_EQ(p[static_cast<size_t>(t * e_n + e)], pr[static_cast<size_t>(e)]);
            for (int64_t j = 0; j < k; ++j) {
              EXPECT_EQ(ex[static_cast<size_t>(t * k + j)], er[static_cast<size_t>(j)])
                  << "E " << e_n << " k " << k << " token " << t;
              EXPECT_EQ(w[static_cast<size_t>(t * k + j)], wr[static_cast<size_t>(j)]);
            }
            for (int64_t e = 1; e < e_n; ++e)
              ties += pr[static_cast<size_t>(e)] == pr[static_cast<size_t>(e - 1)];
          }
        }
      }
  EXPECT_GT(ties, 1000) << "the logits must produce many equal probabilities";
}

TEST(MoeRoute, CountsAndProbabilitySums) {
  const std::vector<int32_t> ex = {2, 0, 2, 0, 2, 3};
  const Tensor counts = moe_expert_counts(Tensor::from_vector<int32_t>({3, 2}, ex), 5);
  EXPECT_EQ(counts.to_vector<int64_t>(), (std::vector<int64_t>{2, 0, 3, 1, 0}));
  EXPECT_THROW(moe_expert_counts(Tensor::from_vector<int32_t>({1, 2}, {0, 5}), 5), Error);
  // Token order, one expert at a time: 0.1 + 0.2 + 0.3 in that order (not 0.1 + (0.2 + 0.3)).
  const Tensor probs = Tensor::from_vector<double>({3, 2}, {0.1, 1.0, 0.2, 2.0, 0.3, 3.0});
  const std::vector<double> s = moe_prob_sums(probs).to_vector<double>();
  EXPECT_EQ(s[0], (0.1 + 0.2) + 0.3);
  EXPECT_EQ(s[1], 6.0);
}

// The backward written out with its own dp vector (the formula of engine/moe/moe.h).
std::vector<double> route_backward_reference(const std::vector<double>& p,
                                             const std::vector<int32_t>& ex,
                                             const std::vector<double>& w,
                                             const std::vector<double>& dw,
                                             const std::vector<double>& aux, bool sigmoid) {
  const size_t e_n = p.size(), k = ex.size();
  double chosen = 0, dot = 0;
  for (size_t j = 0; j < k; ++j) {
    chosen += p[static_cast<size_t>(ex[j])];
    dot += dw[j] * w[j];
  }
  std::vector<double> dp(aux);
  for (size_t j = 0; j < k; ++j) dp[static_cast<size_t>(ex[j])] += (dw[j] - dot) / chosen;
  std::vector<double> o(e_n);
  if (sigmoid) {
    for (size_t e = 0; e < e_n; ++e) o[e] = dp[e] * p[e] * (1.0 - p[e]);
  } else {
    double s = 0;
    for (size_t e = 0; e < e_n; ++e) s += p[e] * dp[e];
    for (size_t e = 0; e < e_n; ++e) o[e] = p[e] * (dp[e] - s);
  }
  return o;
}

TEST(MoeRoute, BackwardRowIsTheFormula) {
  std::mt19937 g(11);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  constexpr int64_t kT = 17, kE = 6, kK = 2;
  for (bool sigmoid : {false, true})
    for (bool with_aux : {false, true}) {
      const std::vector<float> l = tied_logits(g, kT * kE);
      const MoeRouteOut r = moe_route(Tensor::from_vector<float>({kT, kE}, l), kK, sigmoid);
      std::vector<double> dw(kT * kK), aux(kE, 0.0);
      for (double& x : dw) x = u(g);
      if (with_aux)
        for (double& x : aux) x = u(g) * 1e-3;
      const Tensor aux_t = with_aux ? Tensor::from_vector<double>({kE}, aux) : Tensor();
      const Tensor d64 =
          moe_route_backward(r.probs, r.expert, r.weight, Tensor::from_vector<double>({kT, kK}, dw),
                             aux_t, sigmoid, DType::kFloat64);
      const Tensor d32 =
          moe_route_backward(r.probs, r.expert, r.weight, Tensor::from_vector<double>({kT, kK}, dw),
                             aux_t, sigmoid, DType::kFloat32);
      const std::vector<double> p = r.probs.to_vector<double>(), w = r.weight.to_vector<double>();
      const std::vector<int32_t> ex = r.expert.to_vector<int32_t>();
      const std::vector<double> got = d64.to_vector<double>();
      const std::vector<float> got32 = d32.to_vector<float>();
      for (int64_t t = 0; t < kT; ++t) {
        const auto sl = [t](const auto& v, int64_t n) {
          using V = typename std::decay_t<decltype(v)>::value_type;
          return std::vector<V>(v.begin() + t * n, v.begin() + (t + 1) * n);
        };
        const std::vector<double> want =
            route_backward_reference(sl(p, kE), sl(ex, kK), sl(w, kK), sl(dw, kK), aux, sigmoid);
        for (int64_t e = 0; e < kE; ++e) {
          EXPECT_EQ(got[static_cast<size_t>(t * kE + e)], want[static_cast<size_t>(e)]);
          EXPECT_EQ(got32[static_cast<size_t>(t * kE + e)],
                    static_cast<float>(want[static_cast<size_t>(e)]));  // rounded once
        }
      }
    }
}

TEST(MoeRows, DispatchIsTheStableSortByExpertPadded) {
  std::mt19937 g(3);
  for (int64_t e_n : {1, 3, 8})
    for (int64_t k = 1; k <= std::min<int64_t>(e_n, 3); ++k)
      for (int64_t align : {1, 4, 32})
        for (bool keep : {false, true}) {
          constexpr int64_t kT = 300;  // more pairs than one device block's 256
          std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(e_n) - 1);
          std::vector<int32_t> ex(kT * k);
          // Expert e_n - 1 is never chosen when there are more than one.
          for (int32_t& x : ex) x = e_n > 1 ? pick(g) % static_cast<int32_t>(e_n - 1) : 0;
          const Tensor expert = Tensor::from_vector<int32_t>({kT, k}, ex);
          const Tensor counts = moe_expert_counts(expert, e_n);
          const std::vector<int64_t> c = counts.to_vector<int64_t>();
          std::vector<int64_t> offset(static_cast<size_t>(e_n) + 1, 0);
          for (int64_t e = 0; e < e_n; ++e) {
            const int64_t n = std::max<int64_t>(c[static_cast<size_t>(e)], keep ? 1 : 0);
            offset[static_cast<size_t>(e) + 1] =
                offset[static_cast<size_t>(e)] + (n + align - 1) / align * align;
            EXPECT_EQ(moe_row::padded_block(c[static_cast<size_t>(e)], align, keep),
                      offset[static_cast<size_t>(e) + 1] - offset[static_cast<size_t>(e)]);
          }
          const MoeDispatchOut d = moe_dispatch(expert, counts, align, keep, offset.back());
          // Independent: the pair indices stably sorted by expert.
          std::vector<int64_t> order(ex.size());
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
            return ex[static_cast<size_t>(a)] < ex[static_cast<size_t>(b)];
          });
          std::vector<int64_t> token(static_cast<size_t>(offset.back()), -1), slot(ex.size());
          std::vector<int64_t> next(offset.begin(), offset.end() - 1);
          for (int64_t pair : order) {
            const int64_t row = next[static_cast<size_t>(ex[static_cast<size_t>(pair)])]++;
            token[static_cast<size_t>(row)] = pair / k;
            slot[static_cast<size_t>(pair)] = row;
          }
          EXPECT_EQ(d.token.to_vector<int64_t>(), token)
              << "E " << e_n << " k " << k << " align " << align;
          EXPECT_EQ(d.slot.to_vector<int64_t>(), slot);
          EXPECT_THROW(moe_dispatch(expert, counts, align, keep, offset.back() + 1), Error);
        }
}

TEST(MoeRows, PermuteCombineAndBackwardAreTheLoops) {
  std::mt19937 g(5);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  constexpr int64_t kT = 9, kK = 2, kE = 3, kH = 5;
  std::vector<int32_t> ex;
  for (int64_t t = 0; t < kT; ++t) {
    ex.push_back(static_cast<int32_t>(t % kE));
    ex.push_back(static_cast<int32_t>((t + 1) % kE));
  }
  std::vector<double> w;
  for (int64_t c = 0; c < kT * kK; ++c) w.push_back(static_cast<float>(0.25 + 0.5 * (c % 3)));
  const Tensor expert = Tensor::from_vector<int32_t>({kT, kK}, ex);
  const Tensor counts = moe_expert_counts(expert, kE);
  const int64_t align = 4;
  int64_t padded = 0;
  for (int64_t c : counts.to_vector<int64_t>()) padded += moe_row::padded_block(c, align, false);
  const MoeDispatchOut d = moe_dispatch(expert, counts, align, false, padded);
  const std::vector<int64_t> token = d.token.to_vector<int64_t>(),
                             slot = d.slot.to_vector<int64_t>();
  const Tensor weight = Tensor::from_vector<double>({kT, kK}, w);
  std::vector<float> xv(kT * kH), yv(static_cast<size_t>(padded * kH)), dv(kT * kH);
  for (float& v : xv) v = n01(g);
  for (float& v : yv) v = n01(g);
  for (float& v : dv) v = n01(g);
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const Tensor x = cast_to(Tensor::from_vector<float>({kT, kH}, xv), dt);
    const Tensor y = cast_to(Tensor::from_vector<float>({padded, kH}, yv), dt);
    const Tensor dout = cast_to(Tensor::from_vector<float>({kT, kH}, dv), dt);
    const std::vector<float> xs = cast_to(x, DType::kFloat32).to_vector<float>(),
                             ys = cast_to(y, DType::kFloat32).to_vector<float>(),
                             ds = cast_to(dout, DType::kFloat32).to_vector<float>();
    // Permute: row p is x[token[p]], padding zero (bytes).
    const Tensor xp = moe_permute(x, d.token);
    const std::vector<float> xps = cast_to(xp, DType::kFloat32).to_vector<float>();
    for (int64_t p = 0; p < padded; ++p)
      for (int64_t h = 0; h < kH; ++h)
        EXPECT_EQ(xps[static_cast<size_t>(p * kH + h)],
                  token[static_cast<size_t>(p)] < 0
                      ? 0.0f
                      : xs[static_cast<size_t>(token[static_cast<size_t>(p)] * kH + h)]);
    // Combine (weighted) and the unpermute sum (unweighted), rounded once to dt.
    Tensor out = Tensor::empty({kT, kH}, dt), sum = Tensor::empty({kT, kH}, dt);
    moe_combine(y, d.slot, weight, out);
    moe_combine(y, d.slot, Tensor(), sum);
    Tensor dy = Tensor::empty({padded, kH}, dt);
    const std::vector<double> dw =
        moe_combine_backward(dout, y, d.slot, weight, dy).to_vector<double>();
    std::vector<double> o(kT * kH), s(kT * kH), g_dy(static_cast<size_t>(padded * kH), 0.0);
    for (int64_t t = 0; t < kT; ++t)
      for (int64_t h = 0; h < kH; ++h)
        for (int64_t j = 0; j < kK; ++j) {
          const size_t c = static_cast<size_t>(t * kK + j);
          const double v = ys[static_cast<size_t>(slot[c] * kH + h)];
          const size_t i = static_cast<size_t>(t * kH + h);
          o[i] = j == 0 ? w[c] * v : o[i] + w[c] * v;
          s[i] = j == 0 ? v : s[i] + v;
          g_dy[static_cast<size_t>(slot[c] * kH + h)] = w[c] * static_cast<double>(ds[i]);
        }
    const Tensor o_t = cast_to(Tensor::from_vector<double>({kT, kH}, o), dt);
    const Tensor s_t = cast_to(Tensor::from_vector<double>({kT, kH}, s), dt);
    const Tensor g_t = cast_to(Tensor::from_vector<double>({padded, kH}, g_dy), dt);
    EXPECT_EQ(std::memcmp(out.raw_data(), o_t.raw_data(), out.nbytes().value), 0);
    EXPECT_EQ(std::memcmp(sum.raw_data(), s_t.raw_data(), sum.nbytes().value), 0);
    EXPECT_EQ(std::memcmp(dy.raw_data(), g_t.raw_data(), dy.nbytes().value), 0);
    for (int64_t c = 0; c < kT * kK; ++c) {
      double dot = 0;
      for (int64_t h = 0; h < kH; ++h)
        dot += static_cast<double>(ds[static_cast<size_t>(c / kK * kH + h)]) *
               static_cast<double>(ys[static_cast<size_t>(slot[static_cast<size_t>(c)] * kH + h)]);
      EXPECT_EQ(dw[static_cast<size_t>(c)], dot) << "pair " << c;
    }
  }
}

}  // namespace
}  // namespace meshproof::kernels
