// The tolerance of the fused attention (kernels/attention/flash_attention.h, float32 arithmetic)
// against the double reference (kernels/attention/attention.h), derived per element from the
// inputs. No device measurement exists (no GPU was available when it was written): the bound is
// derived, then checked against the CPU model of the algorithm (flash_attention_test.cc, label cpu)
// and the device kernels (ops_cuda_test.cc, label gpu).
//
// Notation: u = 2^-24 (float32 unit roundoff), u_T the storage dtype's (2^-24 float32, 2^-8
// bfloat16); q, k, v, dO are exact in both kernels (stored values). Row i, keys j <= i, N_i the
// number of key tiles it spans, s_ij = scale q_i.k_j, P = softmax, A_ij = sum_c |q_ic k_jc|.
// Forward:
//   scores: |s^ - s| <= (d + 2) u scale A_ij =: ds_i (max over j). The softmax is invariant to
//   the shift m, so only differences of scores matter (2 ds_i); each exp (CUDA expf: <= 2 ulp =
//   4u relative) and each per-tile rescale exp(m_old - m_new) (at most N_i + 1 of them on any
//   term, argument rounding u |s - m| <= 2u max|s|) perturb a weight relatively:
//     eps_p = 2 ds_i + (N_i + 1) (4u + 2u max_j |s_ij|).
//   l and o sum i + 1 terms plus N_i rescalings in float32: gamma = (i + 1 + N_i) u relative to
//   the sum of absolute terms; the weights' errors enter o / l twice (numerator, denominator):
//     |out_flash - out| <= (2 eps_p + (2 (i + 1 + N_i) + 1) u) max_j |v_jc| =: E_ic.
//   The reference sums probabilities rounded to T (relative u_T each): u_T sum_j P_ij |v_jc|.
//   Each result is rounded to T once more: 2 ulp_T(out_ref) covers both stores.
// Backward (dP_ij = dO_i.v_j, D_i = sum_j P_ij dP_ij, dS = P (dP - D) scale):
//   flash's p = exp(s - lse): lse carries the forward's relative error of l and an absolute
//   rounding u |lse|, so eps_b = 2 eps_p + (i + 1 + N_i + 2) u + 2u (max|s| + |lse_i|);
//   dP in float32: |d dP_ij| <= d u sum_c |dO_ic v_jc|; flash's D_i = dO_i.O_i uses the stored
//   output: |d D_i| <= sum_c |dO_ic| (E_ic + ulp_T(O_ic)) + d u sum_c |dO_ic O_ic|, and the
//   reference's D from rounded probabilities adds u_T sum_j P_ij |dP_ij|;
//   |d dS_ij| <= scale [(eps_b + u_T) P (|dP| + |D|) + P (|d dP| + |d D|)] + 3u |dS_ij|;
//   dQ_i = sum_j dS_ij k_j, dK_j = sum_{a,i} dS_ij q_i, dV_j = sum_{a,i} P_ij dO_i: the dS (or P)
//   errors times |k| (|q|, |dO|), plus float32 accumulation (number of terms) u times the sum of
//   absolute terms; 2 ulp_T of the reference for the stores.
// First-order terms only: every bound is multiplied by 1.125 for the neglected products of u's.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/attention/attention.h"
#include "kernels/attention/flash_attention.h"
#include "kernels/core/dtype.h"

namespace meshproof::kernels::flash_bound {

inline double unit_roundoff(DType dt) { return std::ldexp(1.0, dt == DType::kBFloat16 ? -8 : -24); }

// The spacing of `dt` at |x| (smallest normal spacing near zero).
inline double ulp(double x, DType dt) {
  const int mant = dt == DType::kBFloat16 ? 7 : 23;
  return std::ldexp(1.0, std::ilogb(std::max(std::fabs(x), 1.1754943508222875e-38)) - mant);
}

struct Bounds {
  std::vector<double> out;   // [B*S, A*d]
  std::vector<double> dqkv;  // [B*S, (A + 2KV)d]
};

// qkv, dout: the inputs as double; out_ref, dqkv_ref: the reference kernel's results as double.
inline Bounds bounds(const std::vector<double>& qkv, const std::vector<double>& dout,
                     const std::vector<double>& out_ref, const std::vector<double>& dqkv_ref,
                     const AttentionShape& s, DType dt) {
  const double u = std::ldexp(1.0, -24), ut = unit_roundoff(dt), margin = 1.125;
  const int64_t seq = s.seq, d = s.head_dim, w = s.qkv_width(), h = s.heads * d;
  const int64_t r = s.heads / s.kv(), tile = kFlashKeyTile(d);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> eo(out_ref.size(), 0.0), ed(dqkv_ref.size(), 0.0);
  auto at = [](const std::vector<double>& v, int64_t i) { return v[static_cast<size_t>(i)]; };
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t a = 0; a < s.heads; ++a) {
      const int64_t base = (a / r) * (r + 2) * d;
      const int64_t qc = base + (a % r) * d, kc = base + r * d, vc = kc + d;
      auto q = [&](int64_t i, int64_t c) { return at(qkv, (b * seq + i) * w + qc + c); };
      auto k = [&](int64_t j, int64_t c) { return at(qkv, (b * seq + j) * w + kc + c); };
      auto v = [&](int64_t j, int64_t c) { return at(qkv, (b * seq + j) * w + vc + c); };
      auto go = [&](int64_t i, int64_t c) { return at(dout, (b * seq + i) * h + a * d + c); };
      auto o = [&](int64_t i, int64_t c) { return at(out_ref, (b * seq + i) * h + a * d + c); };
      std::vector<double> sc(static_cast<size_t>(seq)), p(static_cast<size_t>(seq)),
          dp(static_cast<size_t>(seq)), e_row(static_cast<size_t>(d));
      for (int64_t i = 0; i < seq; ++i) {
        double max_a = 0, max_s = 0, mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0, abs = 0;
          for (int64_t c = 0; c < d; ++c) {
            dot += q(i, c) * k(j, c);
            abs += std::fabs(q(i, c) * k(j, c));
          }
          sc[size_t(j)] = dot * scale;
          max_a = std::max(max_a, abs);
          max_s = std::max(max_s, std::fabs(sc[size_t(j)]));
          mx = std::max(mx, sc[size_t(j)]);
        }
        double l = 0;
        for (int64_t j = 0; j <= i; ++j) l += (p[size_t(j)] = std::exp(sc[size_t(j)] - mx));
        for (int64_t j = 0; j <= i; ++j) p[size_t(j)] /= l;
        const double lse = mx + std::log(l);
        const double n_tiles = static_cast<double>(i / tile + 1),
                     terms = static_cast<double>(i + 1);
        const double eps_p = 2 * (static_cast<double>(d) + 2) * u * scale * max_a +
                             (n_tiles + 1) * (4 * u + 2 * u * max_s);
        // Forward.
        for (int64_t c = 0; c < d; ++c) {
          double vmax = 0, pv = 0;
          for (int64_t j = 0; j <= i; ++j) {
            vmax = std::max(vmax, std::fabs(v(j, c)));
            pv += p[size_t(j)] * std::fabs(v(j, c));
          }
          e_row[size_t(c)] = (2 * eps_p + (2 * (terms + n_tiles) + 1) * u) * vmax;
          eo[size_t((b * seq + i) * h + a * d + c)] = e_row[size_t(c)] + ut * pv;
        }
        // Backward terms of row i.
        double big_d = 0, pdp_abs = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double x = 0;
          for (int64_t c = 0; c < d; ++c) x += go(i, c) * v(j, c);
          dp[size_t(j)] = x;
          big_d += p[size_t(j)] * x;
          pdp_abs += p[size_t(j)] * std::fabs(x);
        }
        double d_err = ut * pdp_abs;
        for (int64_t c = 0; c < d; ++c)
          d_err += std::fabs(go(i, c)) * (e_row[size_t(c)] + ulp(o(i, c), dt)) +
                   static_cast<double>(d) * u * std::fabs(go(i, c) * o(i, c));
        const double eps_b =
            2 * eps_p + (terms + n_tiles + 2) * u + 2 * u * (max_s + std::fabs(lse));
        const double acc_kv = static_cast<double>(seq * r) * u;  // dK/dV terms per element
        for (int64_t j = 0; j <= i; ++j) {
          const double pj = p[size_t(j)];
          double dp_err = 0;
          for (int64_t c = 0; c < d; ++c) dp_err += std::fabs(go(i, c) * v(j, c));
          dp_err *= static_cast<double>(d) * u;
          const double ds = pj * (dp[size_t(j)] - big_d) * scale;
          const double ds_err =
              scale * ((eps_b + ut) * pj * (std::fabs(dp[size_t(j)]) + std::fabs(big_d)) +
                       pj * (dp_err + d_err)) +
              3 * u * std::fabs(ds);
          for (int64_t c = 0; c < d; ++c) {
            ed[size_t((b * seq + i) * w + qc + c)] +=
                ds_err * std::fabs(k(j, c)) + terms * u * std::fabs(ds * k(j, c));
            ed[size_t((b * seq + j) * w + kc + c)] +=
                ds_err * std::fabs(q(i, c)) + acc_kv * std::fabs(ds * q(i, c));
            ed[size_t((b * seq + j) * w + vc + c)] +=
                (eps_b + ut + acc_kv) * pj * std::fabs(go(i, c));
          }
        }
      }
    }
  Bounds out{std::vector<double>(out_ref.size()), std::vector<double>(dqkv_ref.size())};
  for (size_t x = 0; x < out_ref.size(); ++x) out.out[x] = 2 * ulp(out_ref[x], dt) + margin * eo[x];
  for (size_t x = 0; x < dqkv_ref.size(); ++x)
    out.dqkv[x] = 2 * ulp(dqkv_ref[x], dt) + margin * ed[x];
  return out;
}

}  // namespace meshproof::kernels::flash_bound
