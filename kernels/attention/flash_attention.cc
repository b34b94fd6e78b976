#include "kernels/attention/flash_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/ops/cast.h"
#include "kernels/ops/op_util.h"

namespace meshproof::kernels {
namespace {

void check_flash_shape(std::string_view op, const Tensor& qkv, const AttentionShape& s) {
  detail::check_attention_operand(op, qkv, s);
  MP_CHECK(flash_attention_supported(s), "{}: head dim d={} exceeds the fused kernels' {}", op,
           s.head_dim, kFlashMaxHeadDim);
  // Grid dimensions of the CUDA kernels: (row tiles, heads or groups, batch).
  MP_CHECK(s.heads <= 65535 && s.batch <= 65535, "{}: A={} or B={} exceeds the CUDA grid", op,
           s.heads, s.batch);
  MP_CHECK(qkv.dtype() != DType::kFloat64,
           "{}: the fused attention computes in float32; {} is "
           "float64 (the reference kernels/attention/attention.h takes it)",
           op, qkv.describe());
}

struct Cols {
  int64_t q, k, v;
};
Cols cols_of(const AttentionShape& s, int64_t a) {
  const int64_t r = s.heads / s.kv(), d = s.head_dim, base = (a / r) * (r + 2) * d;
  return {base + (a % r) * d, base + r * d, base + (r + 1) * d};
}

// ---- CPU model of the CUDA kernels: the same tiles and online rescaling in float32 ----

template <typename T>
float ld(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

template <typename T>
void forward_cpu(const T* qkv, const AttentionShape& s, T* out, float* lse) {
  const int64_t seq = s.seq, d = s.head_dim, w = s.qkv_width(), h = s.heads * d;
  const int64_t tile = kFlashKeyTile(d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> o(static_cast<size_t>(d)), sc(static_cast<size_t>(tile));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t a = 0; a < s.heads; ++a) {
      const Cols c = cols_of(s, a);
      for (int64_t i = 0; i < seq; ++i) {
        const T* q = qkv + (b * seq + i) * w + c.q;
        float m = -INFINITY, l = 0.0f;
        std::fill(o.begin(), o.end(), 0.0f);
        for (int64_t j0 = 0; j0 <= i; j0 += tile) {
          const int64_t n = std::min(tile, i + 1 - j0);  // causal: keys j <= i
          float tile_max = -INFINITY;
          for (int64_t jj = 0; jj < n; ++jj) {
            const T* k = qkv + (b * seq + j0 + jj) * w + c.k;
            float dot = 0.0f;
            for (int64_t x = 0; x < d; ++x) dot += ld(q, x) * ld(k, x);
            sc[static_cast<size_t>(jj)] = dot * scale;
            tile_max = std::max(tile_max, dot * scale);
          }
          const float m_new = std::max(m, tile_max);
          const float alpha = std::exp(m - m_new);  // 0 on the first tile (m = -inf)
          float psum = 0.0f;
          for (int64_t jj = 0; jj < n; ++jj) {
            sc[static_cast<size_t>(jj)] = std::exp(sc[static_cast<size_t>(jj)] - m_new);
            psum += sc[static_cast<size_t>(jj)];
          }
          l = l * alpha + psum;
          for (int64_t x = 0; x < d; ++x) o[static_cast<size_t>(x)] *= alpha;
          for (int64_t jj = 0; jj < n; ++jj) {
            const T* v = qkv + (b * seq + j0 + jj) * w + c.v;
            for (int64_t x = 0; x < d; ++x)
              o[static_cast<size_t>(x)] += sc[static_cast<size_t>(jj)] * ld(v, x);
          }
          m = m_new;
        }
        T* orow = out + (b * seq + i) * h + a * d;
        for (int64_t x = 0; x < d; ++x) orow[x] = static_cast<T>(o[static_cast<size_t>(x)] / l);
        lse[(b * s.heads + a) * seq + i] = m + std::log(l);
      }
    }
}

// The two backward kernels' loops: dQ per query row over keys j <= i; dK, dV per key row over the
// group's heads in order, then queries i >= j; p = exp(s - lse), ds = p (dp - D) scale.
template <typename T>
void backward_cpu(const T* dout, const T* qkv, const T* out, const float* lse,
                  const AttentionShape& s, T* dqkv) {
  const int64_t seq = s.seq, d = s.head_dim, w = s.qkv_width(), h = s.heads * d;
  const int64_t r = s.heads / s.kv();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> big_d(static_cast<size_t>(s.batch * s.heads * seq));
  auto dot = [d](const T* x, const T* y) {
    float acc = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc += ld(x, c) * ld(y, c);
    return acc;
  };
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t a = 0; a < s.heads; ++a)
      for (int64_t i = 0; i < seq; ++i) {
        const T* dor = dout + (b * seq + i) * h + a * d;
        const T* orow = out + (b * seq + i) * h + a * d;
        big_d[static_cast<size_t>((b * s.heads + a) * seq + i)] = dot(dor, orow);
      }
  std::vector<float> acc(static_cast<size_t>(2 * d));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t a = 0; a < s.heads; ++a) {
      const Cols c = cols_of(s, a);
      for (int64_t i = 0; i < seq; ++i) {
        const int64_t row = (b * s.heads + a) * seq + i;
        const T* q = qkv + (b * seq + i) * w + c.q;
        const T* dor = dout + (b * seq + i) * h + a * d;
        std::fill(acc.begin(), acc.begin() + d, 0.0f);
        for (int64_t j = 0; j <= i; ++j) {
          const T* k = qkv + (b * seq + j) * w + c.k;
          const T* v = qkv + (b * seq + j) * w + c.v;
          const float p = std::exp(dot(q, k) * scale - lse[row]);
          const float ds = p * (dot(dor, v) - big_d[static_cast<size_t>(row)]) * scale;
          for (int64_t x = 0; x < d; ++x) acc[static_cast<size_t>(x)] += ds * ld(k, x);
        }
        T* dq = dqkv + (b * seq + i) * w + c.q;
        for (int64_t x = 0; x < d; ++x) dq[x] = static_cast<T>(acc[static_cast<size_t>(x)]);
      }
    }
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t g = 0; g < s.kv(); ++g) {
      const Cols gc = cols_of(s, g * r);
      for (int64_t j = 0; j < seq; ++j) {
        const T* k = qkv + (b * seq + j) * w + gc.k;
        const T* v = qkv + (b * seq + j) * w + gc.v;
        std::fill(acc.begin(), acc.end(), 0.0f);  // [dk (d), dv (d)]
        for (int64_t a = g * r; a < (g + 1) * r; ++a) {
          const Cols c = cols_of(s, a);
          for (int64_t i = j; i < seq; ++i) {
            const int64_t row = (b * s.heads + a) * seq + i;
            const T* q = qkv + (b * seq + i) * w + c.q;
            const T* dor = dout + (b * seq + i) * h + a * d;
            const float p = std::exp(dot(q, k) * scale - lse[row]);
            const float ds = p * (dot(dor, v) - big_d[static_cast<size_t>(row)]) * scale;
            for (int64_t x = 0; x < d; ++x) {
              acc[static_cast<size_t>(x)] += ds * ld(q, x);
              acc[static_cast<size_t>(d + x)] += p * ld(dor, x);
            }
          }
        }
        T* rowp = dqkv + (b * seq + j) * w;
        for (int64_t x = 0; x < d; ++x) {
          rowp[gc.k + x] = static_cast<T>(acc[static_cast<size_t>(x)]);
          rowp[gc.v + x] = static_cast<T>(acc[static_cast<size_t>(d + x)]);
        }
      }
    }
}

}  // namespace

bool flash_attention_supported(const AttentionShape& shape) {
  return shape.head_dim > 0 && shape.head_dim <= kFlashMaxHeadDim;
}

void flash_attention_forward(const Tensor& qkv, const AttentionShape& s, Tensor& out, Tensor& lse) {
  constexpr std::string_view op = "flash_attention_forward";
  check_flash_shape(op, qkv, s);
  detail::check_operand(out, op, "out", s.batch * s.seq * s.heads * s.head_dim);
  detail::check_operand(lse, op, "lse", s.batch * s.heads * s.seq);
  detail::check_same_dtype(qkv, out, op);
  MP_CHECK(lse.dtype() == DType::kFloat32, "{}: lse must be float32, got {}", op, lse.describe());
  if (detail::on_cuda(op, {&qkv, &out, &lse})) {
    MP_OP_CUDA(op, launch_flash_attention_forward(qkv.raw_data(), qkv.dtype() == DType::kBFloat16,
                                                  s.batch, s.seq, s.heads, s.head_dim, s.kv(),
                                                  kFlashKeyTile(s.head_dim), out.raw_data(),
                                                  lse.data<float>(), detail::cuda_stream()));
    return;
  }
  if (qkv.dtype() == DType::kBFloat16) {
    forward_cpu<BFloat16>(qkv.data<BFloat16>(), s, out.data<BFloat16>(), lse.data<float>());
  } else {
    forward_cpu<float>(qkv.data<float>(), s, out.data<float>(), lse.data<float>());
  }
}

void flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const AttentionShape& s, Tensor& dqkv) {
  constexpr std::string_view op = "flash_attention_backward";
  check_flash_shape(op, qkv, s);
  const int64_t h = s.heads * s.head_dim;
  detail::check_operand(dout, op, "dout", s.batch * s.seq * h);
  detail::check_operand(out, op, "out", s.batch * s.seq * h);
  detail::check_operand(lse, op, "lse", s.batch * s.heads * s.seq);
  detail::check_operand(dqkv, op, "dqkv", s.batch * s.seq * s.qkv_width());
  detail::check_same_dtype(qkv, dout, op);
  detail::check_same_dtype(qkv, out, op);
  detail::check_same_dtype(qkv, dqkv, op);
  MP_CHECK(lse.dtype() == DType::kFloat32, "{}: lse must be float32, got {}", op, lse.describe());
  if (detail::on_cuda(op, {&dout, &qkv, &out, &lse, &dqkv})) {
    // D_i = sum_c dO_ic O_ic per (b, head, row), written by the dQ kernel, read by the dK/dV one.
    Tensor big_d = Tensor::empty({s.batch * s.heads * s.seq}, DType::kFloat32, qkv.device());
    MP_OP_CUDA(op, launch_flash_attention_backward(
                       dout.raw_data(), qkv.raw_data(), out.raw_data(), lse.data<float>(),
                       qkv.dtype() == DType::kBFloat16, s.batch, s.seq, s.heads, s.head_dim, s.kv(),
                       kFlashKeyTile(s.head_dim), big_d.data<float>(), dqkv.raw_data(),
                       detail::cuda_stream()));
    return;
  }
  if (qkv.dtype() == DType::kBFloat16) {
    backward_cpu<BFloat16>(dout.data<BFloat16>(), qkv.data<BFloat16>(), out.data<BFloat16>(),
                           lse.data<float>(), s, dqkv.data<BFloat16>());
  } else {
    backward_cpu<float>(dout.data<float>(), qkv.data<float>(), out.data<float>(), lse.data<float>(),
                        s, dqkv.data<float>());
  }
}

}  // namespace meshproof::kernels
