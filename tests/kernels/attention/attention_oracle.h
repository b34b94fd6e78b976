// The CPU attention as it was before the tiled kernels (main ccb165d,
// kernels/attention/attention.cc), kept verbatim as the oracle: the tiled attention must be BITWISE
// equal to it (docs/design.md section 21). Every sum in double, each in a fixed order: a score sums
// q[c] k[c] over c, the softmax sums over keys j, an output element sums p[j] v[j][c] over j, and
// the backward's dv and dk sum over the group's heads, then query rows; dq over keys.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/attention/attention.h"

namespace meshproof::kernels::attention_oracle {

struct HeadCols {
  int64_t q, k, v;
};
inline HeadCols head_cols(const AttentionShape& s, int64_t a) {
  const int64_t r = s.heads / s.kv(), d = s.head_dim, base = (a / r) * (r + 2) * d;
  return {base + (a % r) * d, base + r * d, base + (r + 1) * d};
}

// qkv [B*S, qkv_width], out [B*S, A*d], probs [B, A, S, S].
template <typename T>
void forward(const T* in, const AttentionShape& s, T* o, T* p) {
  const int64_t b_n = s.batch, seq = s.seq, a_n = s.heads, d = s.head_dim, h = a_n * d;
  const int64_t w = s.qkv_width();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> row(seq);
  for (int64_t b = 0; b < b_n; ++b) {
    for (int64_t a = 0; a < a_n; ++a) {
      const auto [q_col, k_col, v_col] = head_cols(s, a);
      for (int64_t i = 0; i < seq; ++i) {
        const T* q = in + (b * seq + i) * w + q_col;
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const T* k = in + (b * seq + j) * w + k_col;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * k[c];
          row[j] = dot * scale;
          mx = std::max(mx, row[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        T* pr = p + ((b * a_n + a) * seq + i) * seq;
        for (int64_t j = 0; j < seq; ++j) pr[j] = j <= i ? static_cast<T>(row[j] / sum) : T(0);
        T* orow = o + (b * seq + i) * h + a * d;
        for (int64_t c = 0; c < d; ++c) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j)
            acc += static_cast<double>(pr[j]) * in[(b * seq + j) * w + v_col + c];
          orow[c] = static_cast<T>(acc);
        }
      }
    }
  }
}

// dout [B*S, A*d], probs [B, A, S, S], dqkv [B*S, qkv_width].
template <typename T>
void backward(const T* dop, const T* in, const T* p, const AttentionShape& s, T* dg) {
  const int64_t b_n = s.batch, seq = s.seq, a_n = s.heads, d = s.head_dim, h = a_n * d;
  const int64_t w = s.qkv_width(), kv = s.kv(), r = a_n / kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> dq(seq * d), dk(seq * d), dv(seq * d), ds(seq);
  for (int64_t b = 0; b < b_n; ++b) {
    for (int64_t g = 0; g < kv; ++g) {
      std::fill(dk.begin(), dk.end(), 0.0);
      std::fill(dv.begin(), dv.end(), 0.0);
      const HeadCols group = head_cols(s, g * r);
      const int64_t k_col = group.k, v_col = group.v;
      for (int64_t a = g * r; a < (g + 1) * r; ++a) {
        const int64_t q_col = head_cols(s, a).q;
        std::fill(dq.begin(), dq.end(), 0.0);
        for (int64_t i = 0; i < seq; ++i) {
          const T* pr = p + ((b * a_n + a) * seq + i) * seq;
          const T* dorow = dop + (b * seq + i) * h + a * d;
          const T* q = in + (b * seq + i) * w + q_col;
          double dot_pdp = 0;
          for (int64_t j = 0; j <= i; ++j) {
            const T* v = in + (b * seq + j) * w + v_col;
            double dp = 0;
            for (int64_t c = 0; c < d; ++c) {
              dp += static_cast<double>(dorow[c]) * v[c];
              dv[j * d + c] += static_cast<double>(pr[j]) * dorow[c];
            }
            ds[j] = dp;
            dot_pdp += static_cast<double>(pr[j]) * dp;
          }
          for (int64_t j = 0; j <= i; ++j) {
            const double dsc = pr[j] * (ds[j] - dot_pdp) * scale;
            const T* k = in + (b * seq + j) * w + k_col;
            for (int64_t c = 0; c < d; ++c) {
              dq[i * d + c] += dsc * k[c];
              dk[j * d + c] += dsc * q[c];
            }
          }
        }
        for (int64_t i = 0; i < seq; ++i) {
          T* row = dg + (b * seq + i) * w;
          for (int64_t c = 0; c < d; ++c) row[q_col + c] = static_cast<T>(dq[i * d + c]);
        }
      }
      for (int64_t i = 0; i < seq; ++i) {
        T* row = dg + (b * seq + i) * w;
        for (int64_t c = 0; c < d; ++c) {
          row[k_col + c] = static_cast<T>(dk[i * d + c]);
          row[v_col + c] = static_cast<T>(dv[i * d + c]);
        }
      }
    }
  }
}

}  // namespace meshproof::kernels::attention_oracle
