#include "kernels/attention.h"

#include <cmath>
#include <vector>

#include "kernels/op_util.h"

namespace meshproof::kernels {
namespace {

void check_shapes(std::string_view op, const Tensor& qkv, const AttentionShape& s) {
  MP_CHECK(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.head_dim > 0,
           "{}: bad shape B={} S={} A={} d={}", op, s.batch, s.seq, s.heads, s.head_dim);
  detail::check_operand(qkv, op, "qkv", s.batch * s.seq * 3 * s.heads * s.head_dim);
  detail::check_float(qkv, op, "qkv");
}

}  // namespace

void attention_forward(const Tensor& qkv, const AttentionShape& s, Tensor& out, Tensor& probs) {
  constexpr std::string_view op = "attention_forward";
  check_shapes(op, qkv, s);
  const int64_t b_n = s.batch, seq = s.seq, a_n = s.heads, d = s.head_dim, h = a_n * d;
  detail::check_operand(out, op, "out", b_n * seq * h);
  detail::check_operand(probs, op, "probs", b_n * a_n * seq * seq);
  detail::check_same_dtype(qkv, out, op);
  detail::check_same_dtype(qkv, probs, op);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  detail::dispatch_float(qkv.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* in = qkv.data<T>();
    T* o = out.data<T>();
    T* p = probs.data<T>();
    std::vector<double> row(seq);
    for (int64_t b = 0; b < b_n; ++b) {
      for (int64_t a = 0; a < a_n; ++a) {
        const int64_t q_col = a * 3 * d, k_col = q_col + d, v_col = q_col + 2 * d;
        for (int64_t i = 0; i < seq; ++i) {
          const T* q = in + (b * seq + i) * 3 * h + q_col;
          double mx = -INFINITY;
          for (int64_t j = 0; j <= i; ++j) {
            const T* k = in + (b * seq + j) * 3 * h + k_col;
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
              acc += static_cast<double>(pr[j]) * in[(b * seq + j) * 3 * h + v_col + c];
            orow[c] = static_cast<T>(acc);
          }
        }
      }
    }
  });
}

// With P the probabilities and dO the output gradient, per (b, head):
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP - rowsum(P ∘ dP)),  dQ = scale·dS·K,  dK = scale·dSᵀ·Q.
void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                        const AttentionShape& s, Tensor& dqkv) {
  constexpr std::string_view op = "attention_backward";
  check_shapes(op, qkv, s);
  const int64_t b_n = s.batch, seq = s.seq, a_n = s.heads, d = s.head_dim, h = a_n * d;
  detail::check_operand(dout, op, "dout", b_n * seq * h);
  detail::check_operand(probs, op, "probs", b_n * a_n * seq * seq);
  detail::check_operand(dqkv, op, "dqkv", b_n * seq * 3 * h);
  detail::check_same_dtype(qkv, dout, op);
  detail::check_same_dtype(qkv, dqkv, op);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  detail::dispatch_float(qkv.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* in = qkv.data<T>();
    const T* dop = dout.data<T>();
    const T* p = probs.data<T>();
    T* dg = dqkv.data<T>();
    std::vector<double> dq(seq * d), dk(seq * d), dv(seq * d), ds(seq);
    for (int64_t b = 0; b < b_n; ++b) {
      for (int64_t a = 0; a < a_n; ++a) {
        const int64_t q_col = a * 3 * d, k_col = q_col + d, v_col = q_col + 2 * d;
        std::fill(dq.begin(), dq.end(), 0.0);
        std::fill(dk.begin(), dk.end(), 0.0);
        std::fill(dv.begin(), dv.end(), 0.0);
        for (int64_t i = 0; i < seq; ++i) {
          const T* pr = p + ((b * a_n + a) * seq + i) * seq;
          const T* dorow = dop + (b * seq + i) * h + a * d;
          const T* q = in + (b * seq + i) * 3 * h + q_col;
          double dot_pdp = 0;
          for (int64_t j = 0; j <= i; ++j) {
            const T* v = in + (b * seq + j) * 3 * h + v_col;
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
            const T* k = in + (b * seq + j) * 3 * h + k_col;
            for (int64_t c = 0; c < d; ++c) {
              dq[i * d + c] += dsc * k[c];
              dk[j * d + c] += dsc * q[c];
            }
          }
        }
        for (int64_t i = 0; i < seq; ++i) {
          T* row = dg + (b * seq + i) * 3 * h;
          for (int64_t c = 0; c < d; ++c) {
            row[q_col + c] = static_cast<T>(dq[i * d + c]);
            row[k_col + c] = static_cast<T>(dk[i * d + c]);
            row[v_col + c] = static_cast<T>(dv[i * d + c]);
          }
        }
      }
    }
  });
}

}  // namespace meshproof::kernels
