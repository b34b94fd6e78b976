#include "kernels/attention.h"

#include <cmath>
#include <vector>

#include "kernels/op_util.h"

namespace meshproof::kernels {
namespace {

void check_shapes(std::string_view op, const Tensor& qkv, const AttentionShape& s) {
  MP_CHECK(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.head_dim > 0 && s.kv_heads >= 0,
           "{}: bad shape B={} S={} A={} d={} KV={}", op, s.batch, s.seq, s.heads, s.head_dim,
           s.kv_heads);
  MP_CHECK(s.heads % s.kv() == 0, "{}: KV={} does not divide A={}", op, s.kv(), s.heads);
  detail::check_operand(qkv, op, "qkv", s.batch * s.seq * s.qkv_width());
  detail::check_float(qkv, op, "qkv");
}

// The CUDA kernels keep one row of S doubles (plus a few static bytes) in shared memory (48 KiB
// without opt-in) and launch one block per (batch, head, row).
constexpr int64_t kCudaMaxSeq = 6000;

void check_cuda_shape(std::string_view op, const AttentionShape& s) {
  MP_CHECK(s.seq <= kCudaMaxSeq, "{}: the CUDA attention supports S <= {}, got S={}", op,
           kCudaMaxSeq, s.seq);
  MP_CHECK(s.batch * s.heads * s.seq < (int64_t{1} << 31), "{}: B*A*S={} blocks exceed the grid",
           op, s.batch * s.heads * s.seq);
}

// Column offsets of query head a in a qkv row (the grouped layout of attention.h).
struct HeadCols {
  int64_t q, k, v;
};
HeadCols head_cols(const AttentionShape& s, int64_t a) {
  const int64_t r = s.heads / s.kv(), d = s.head_dim, base = (a / r) * (r + 2) * d;
  return {base + (a % r) * d, base + r * d, base + (r + 1) * d};
}

}  // namespace

void attention_forward(const Tensor& qkv, const AttentionShape& s, Tensor& out, Tensor& probs) {
  constexpr std::string_view op = "attention_forward";
  check_shapes(op, qkv, s);
  const int64_t b_n = s.batch, seq = s.seq, a_n = s.heads, d = s.head_dim, h = a_n * d;
  const int64_t w = s.qkv_width();  // qkv row stride
  detail::check_operand(out, op, "out", b_n * seq * h);
  detail::check_operand(probs, op, "probs", b_n * a_n * seq * seq);
  detail::check_same_dtype(qkv, out, op);
  detail::check_same_dtype(qkv, probs, op);
  if (detail::on_cuda(op, {&qkv, &out, &probs})) {
    check_cuda_shape(op, s);
    MP_OP_CUDA(op,
               launch_attention_forward(qkv.raw_data(), qkv.dtype() == DType::kBFloat16, s.batch,
                                        s.seq, s.heads, s.head_dim, s.kv(), out.raw_data(),
                                        probs.raw_data(), detail::cuda_stream()));
    return;
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  detail::dispatch_float(qkv.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* in = qkv.data<T>();
    T* o = out.data<T>();
    T* p = probs.data<T>();
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
  });
}

// With P the probabilities and dO the output gradient, per (b, head):
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP - rowsum(P ∘ dP)),  dQ = scale·dS·K,  dK = scale·dSᵀ·Q.
void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                        const AttentionShape& s, Tensor& dqkv) {
  constexpr std::string_view op = "attention_backward";
  check_shapes(op, qkv, s);
  const int64_t b_n = s.batch, seq = s.seq, a_n = s.heads, d = s.head_dim, h = a_n * d;
  const int64_t w = s.qkv_width(), kv = s.kv(), r = a_n / kv;
  detail::check_operand(dout, op, "dout", b_n * seq * h);
  detail::check_operand(probs, op, "probs", b_n * a_n * seq * seq);
  detail::check_operand(dqkv, op, "dqkv", b_n * seq * w);
  detail::check_same_dtype(qkv, dout, op);
  detail::check_same_dtype(qkv, dqkv, op);
  if (detail::on_cuda(op, {&dout, &qkv, &probs, &dqkv})) {
    check_cuda_shape(op, s);
    // rowsum(P ∘ dP) per (b, head, row), shared by the two backward kernels; freed stream-ordered.
    Tensor row_scratch = Tensor::empty({b_n * a_n * seq}, DType::kFloat64, qkv.device());
    // dk and dv of each (b, group, key row) summed over the group's heads in double.
    Tensor kv_scratch = Tensor::empty({b_n * kv * seq * 2 * d}, DType::kFloat64, qkv.device());
    MP_OP_CUDA(op, launch_attention_backward(dout.raw_data(), qkv.raw_data(), probs.raw_data(),
                                             qkv.dtype() == DType::kBFloat16, s.batch, s.seq,
                                             s.heads, s.head_dim, kv, row_scratch.data<double>(),
                                             kv_scratch.data<double>(), dqkv.raw_data(),
                                             detail::cuda_stream()));
    return;
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  detail::dispatch_float(qkv.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* in = qkv.data<T>();
    const T* dop = dout.data<T>();
    const T* p = probs.data<T>();
    T* dg = dqkv.data<T>();
    std::vector<double> dq(seq * d), dk(seq * d), dv(seq * d), ds(seq);
    for (int64_t b = 0; b < b_n; ++b) {
      for (int64_t g = 0; g < kv; ++g) {
        // dk and dv of the group sum over its query heads (head order, then query rows).
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
  });
}

namespace {

// Rotates the q and k heads of every row by +angle (sign 1) or -angle (sign -1).
void rope_apply(std::string_view op, Tensor& qkv, const AttentionShape& s, double theta,
                const std::vector<int64_t>& positions, double sign) {
  check_shapes(op, qkv, s);
  MP_CHECK(s.head_dim % 2 == 0, "{}: head dim d={} must be even (pairs (2i, 2i+1))", op,
           s.head_dim);
  MP_CHECK(static_cast<int64_t>(positions.size()) == s.seq, "{}: {} positions for S={}", op,
           positions.size(), s.seq);
  MP_CHECK(std::isfinite(theta) && theta > 0, "{}: theta={} must be finite and > 0", op, theta);
  const int64_t d = s.head_dim, half = d / 2, kv = s.kv(), r = s.heads / kv;
  // cos/sin per (s, i) in double: the only transcendental work, shared by every head and row.
  std::vector<double> cs(static_cast<size_t>(s.seq * half * 2));
  for (int64_t t = 0; t < s.seq; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(positions[static_cast<size_t>(t)]) *
                           std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
      cs[static_cast<size_t>((t * half + i) * 2)] = std::cos(angle);
      cs[static_cast<size_t>((t * half + i) * 2 + 1)] = sign * std::sin(angle);
    }
  if (detail::on_cuda(op, {&qkv})) {
    const Tensor table =
        Tensor::from_vector<double>({static_cast<int64_t>(cs.size())}, cs).to(qkv.device());
    MP_OP_CUDA(op, launch_rope(qkv.raw_data(), qkv.dtype() == DType::kBFloat16, s.batch, s.seq,
                               s.heads, d, kv, table.data<double>(), detail::cuda_stream()));
    return;
  }
  const int64_t w = s.qkv_width();
  detail::dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    T* x = qkv.data<T>();
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t t = 0; t < s.seq; ++t) {
        T* row = x + (b * s.seq + t) * w;
        const double* c = cs.data() + t * half * 2;
        // The group's r query heads and its k head are contiguous: r + 1 heads from the base.
        for (int64_t g = 0; g < kv; ++g)
          for (int64_t hh = 0; hh <= r; ++hh) {
            T* head = row + g * (r + 2) * d + hh * d;
            for (int64_t i = 0; i < half; ++i) {
              const double x0 = static_cast<double>(head[2 * i]);
              const double x1 = static_cast<double>(head[2 * i + 1]);
              const double co = c[2 * i], si = c[2 * i + 1];
              head[2 * i] = static_cast<T>(x0 * co - x1 * si);
              head[2 * i + 1] = static_cast<T>(x0 * si + x1 * co);
            }
          }
      }
  });
}

}  // namespace

void rope_forward(Tensor& qkv, const AttentionShape& shape, double theta,
                  const std::vector<int64_t>& positions) {
  rope_apply("rope_forward", qkv, shape, theta, positions, 1.0);
}

void rope_backward(Tensor& dqkv, const AttentionShape& shape, double theta,
                   const std::vector<int64_t>& positions) {
  rope_apply("rope_backward", dqkv, shape, theta, positions, -1.0);
}

}  // namespace meshproof::kernels
