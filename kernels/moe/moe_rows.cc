#include "kernels/moe/moe_rows.h"

#include <algorithm>

#include "kernels/core/device_op.h"
#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "kernels/moe/moe_row.h"
#include "kernels/ops/cast.h"

#if MESHPROOF_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/core/cuda_check.h"
#include "kernels/moe/moe_cuda.h"
#endif

namespace meshproof::kernels {

namespace {

std::string described(const Tensor& t) { return t.defined() ? t.describe() : "undefined"; }

#if MESHPROOF_HAVE_CUDA
// The element type code of the launchers (moe_cuda.h): float32 0, bfloat16 1.
int device_type(const char* op, const Tensor& t) {
  MP_CHECK(t.dtype() == DType::kFloat32 || t.dtype() == DType::kBFloat16,
           "{}: device rows must be float32 or bfloat16, got {}", op, t.describe());
  return t.dtype() == DType::kBFloat16 ? 1 : 0;
}

#endif

// Host float64 copy of a float tensor's elements (exact for float32 / bfloat16).
Tensor as_f64(const Tensor& t) {
  return t.dtype() == DType::kFloat64 ? t : cast_to(t, DType::kFloat64);
}

// Writes the doubles of `d` into `out`, each rounded once to out's dtype.
void store(Tensor& out, const Tensor& d) {
  out.copy_from(out.dtype() == DType::kFloat64 ? d : cast_to(d, out.dtype()));
}

}  // namespace

MoeDispatchOut moe_dispatch(const Tensor& expert, const Tensor& counts, int64_t align,
                            bool keep_empty, int64_t padded) {
  constexpr const char* op = "moe_dispatch";
  MP_CHECK(expert.defined() && expert.dtype() == DType::kInt32 && expert.shape().rank() == 2,
           "{}: expert must be int32 [T, k], got {}", op, described(expert));
  MP_CHECK(counts.defined() && counts.dtype() == DType::kInt64 && counts.shape().rank() == 1 &&
               counts.device() == expert.device(),
           "{}: counts must be int64 [E] on {}, got {}", op, expert.device().str(),
           described(counts));
  MP_CHECK(align >= 1 && padded >= 0, "{}: alignment {} must be >= 1 and the rows {} >= 0", op,
           align, padded);
  const Device dev = expert.device();
  const int64_t t_n = expert.shape()[0], k = expert.shape()[1], e_n = counts.shape()[0];
  MoeDispatchOut d{Tensor::empty({padded}, DType::kInt64, dev),
                   Tensor::empty({t_n, k}, DType::kInt64, dev)};
  if (device_op(op, dev)) {
#if MESHPROOF_HAVE_CUDA
    MP_CUDA_CHECK_STATUS(cuda::launch_moe_dispatch(
        expert.data<int32_t>(), t_n * k, k, e_n, counts.data<int64_t>(), align, keep_empty, padded,
        d.token.data<int64_t>(), d.slot.data<int64_t>(), current_context().stream));
#endif
    return d;
  }
  const int64_t* c = counts.data<int64_t>();
  std::vector<int64_t> next(static_cast<size_t>(e_n) + 1, 0);  // each expert's next row
  for (int64_t e = 0; e < e_n; ++e)
    next[static_cast<size_t>(e) + 1] =
        next[static_cast<size_t>(e)] + moe_row::padded_block(c[e], align, keep_empty);
  MP_CHECK(next.back() == padded, "{}: the counts' blocks hold {} rows, the caller sized {}", op,
           next.back(), padded);
  int64_t* token = d.token.data<int64_t>();
  int64_t* slot = d.slot.data<int64_t>();
  std::fill_n(token, padded, int64_t{-1});
  const int32_t* ex = expert.data<int32_t>();
  std::vector<int64_t> placed(static_cast<size_t>(e_n), 0);
  // Counting sort by expert, pairs in (token, choice) order within an expert: stable.
  for (int64_t c_i = 0; c_i < t_n * k; ++c_i) {
    const int64_t e = ex[c_i];
    MP_CHECK(e >= 0 && e < e_n && placed[static_cast<size_t>(e)] < c[e],
             "{}: pair {} goes to expert {}, which the counts ({} experts) do not hold", op, c_i, e,
             e_n);
    const int64_t row = next[static_cast<size_t>(e)] + placed[static_cast<size_t>(e)]++;
    token[row] = c_i / k;
    slot[c_i] = row;
  }
  return d;
}

Tensor moe_permute(const Tensor& x, const Tensor& token) {
  constexpr const char* op = "moe_permute";
  MP_CHECK(x.defined() && x.shape().rank() == 2, "{}: x must be [T, H], got {}", op, described(x));
  MP_CHECK(token.defined() && token.dtype() == DType::kInt64 && token.shape().rank() == 1 &&
               token.device() == x.device(),
           "{}: token must be int64 [P] on {}, got {}", op, x.device().str(), described(token));
  const int64_t t_n = x.shape()[0], p_n = token.shape()[0];
  const int64_t row_bytes = dtype_bits(x.dtype()) / 8 * x.shape()[1];
  MP_CHECK(dtype_bits(x.dtype()) % 8 == 0, "{}: x must have whole-byte elements, got {}", op,
           x.describe());
  const Device dev = x.device();
  if (device_op(op, dev)) {
    Tensor out = Tensor::empty({p_n, x.shape()[1]}, x.dtype(), dev);
#if MESHPROOF_HAVE_CUDA
    MP_CUDA_CHECK_STATUS(cuda::launch_moe_permute(x.raw_data(), row_bytes, token.data<int64_t>(),
                                                  p_n, out.raw_data(), current_context().stream));
#endif
    return out;
  }
  Tensor out = Tensor::zeros({p_n, x.shape()[1]}, x.dtype(), dev);
  const char* src = static_cast<const char*>(x.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  const int64_t* tk = token.data<int64_t>();
  for (int64_t row = 0; row < p_n; ++row) {
    if (tk[row] < 0) continue;
    MP_CHECK(tk[row] < t_n, "{}: row {} takes token {} of {}", op, row, tk[row], t_n);
    std::copy_n(src + tk[row] * row_bytes, row_bytes, dst + row * row_bytes);
  }
  return out;
}

void moe_combine(const Tensor& y, const Tensor& slot, const Tensor& weight, Tensor& out) {
  constexpr const char* op = "moe_combine";
  MP_CHECK(y.defined() && y.shape().rank() == 2 && out.defined() && out.shape().rank() == 2 &&
               out.shape()[1] == y.shape()[1] && out.device() == y.device(),
           "{}: y [P, H] and out [T, H] on one device, got {} and {}", op, described(y),
           described(out));
  const Device dev = y.device();
  const int64_t t_n = out.shape()[0], h = y.shape()[1], p_n = y.shape()[0];
  MP_CHECK(slot.defined() && slot.dtype() == DType::kInt64 && slot.shape().rank() == 2 &&
               slot.shape()[0] == t_n && slot.device() == dev,
           "{}: slot must be int64 [{}, k] on {}, got {}", op, t_n, dev.str(), described(slot));
  const int64_t k = slot.shape()[1];
  MP_CHECK(!weight.defined() || (weight.dtype() == DType::kFloat64 &&
                                 weight.shape() == slot.shape() && weight.device() == dev),
           "{}: weight must be float64 {} on {}, got {}", op, slot.shape().str(), dev.str(),
           weight.describe());
  const double* w = weight.defined() ? weight.data<double>() : nullptr;
  if (device_op(op, dev)) {
#if MESHPROOF_HAVE_CUDA
    MP_CUDA_CHECK_STATUS(cuda::launch_moe_combine(
        y.raw_data(), device_type(op, y), slot.data<int64_t>(), w, t_n, k, h, out.raw_data(),
        device_type(op, out), current_context().stream));
#endif
    return;
  }
  const Tensor yd = as_f64(y);
  const double* yv = yd.data<double>();
  const int64_t* s = slot.data<int64_t>();
  Tensor o = Tensor::empty({t_n, h}, DType::kFloat64, dev);
  double* ov = o.data<double>();
  for (int64_t t = 0; t < t_n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t c = t * k + j;
      MP_CHECK(s[c] >= 0 && s[c] < p_n, "{}: pair {} at row {} of {}", op, c, s[c], p_n);
      const double* src = yv + s[c] * h;
      double* dst = ov + t * h;
      if (w != nullptr)
        for (int64_t i = 0; i < h; ++i) dst[i] = j == 0 ? w[c] * src[i] : dst[i] + w[c] * src[i];
      else
        for (int64_t i = 0; i < h; ++i) dst[i] = j == 0 ? src[i] : dst[i] + src[i];
    }
  store(out, o);
}

Tensor moe_combine_backward(const Tensor& dout, const Tensor& y, const Tensor& slot,
                            const Tensor& weight, Tensor& dy) {
  constexpr const char* op = "moe_combine_backward";
  MP_CHECK(y.defined() && y.shape().rank() == 2 && dy.defined() && dy.shape() == y.shape() &&
               dout.defined() && dout.shape().rank() == 2 && dout.shape()[1] == y.shape()[1] &&
               y.device() == dy.device() && y.device() == dout.device(),
           "{}: y and dy [P, H], dout [T, H] on one device, got {}, {} and {}", op, described(y),
           described(dy), described(dout));
  const Device dev = y.device();
  const int64_t t_n = dout.shape()[0], h = y.shape()[1], p_n = y.shape()[0];
  MP_CHECK(slot.defined() && slot.dtype() == DType::kInt64 && slot.shape().rank() == 2 &&
               slot.shape()[0] == t_n && slot.device() == dev,
           "{}: slot must be int64 [{}, k] on {}, got {}", op, t_n, dev.str(), described(slot));
  const int64_t k = slot.shape()[1];
  MP_CHECK(weight.defined() && weight.dtype() == DType::kFloat64 &&
               weight.shape() == slot.shape() && weight.device() == dev,
           "{}: weight must be float64 {} on {}, got {}", op, slot.shape().str(), dev.str(),
           described(weight));
  Tensor d_weight = Tensor::empty(slot.shape(), DType::kFloat64, dev);
  if (device_op(op, dev)) {
#if MESHPROOF_HAVE_CUDA
    MP_CUDA_CHECK_STATUS(cuda::launch_moe_combine_backward(
        dout.raw_data(), device_type(op, dout), y.raw_data(), device_type(op, y),
        slot.data<int64_t>(), weight.data<double>(), t_n, k, h, p_n, dy.raw_data(),
        device_type(op, dy), d_weight.data<double>(), current_context().stream));
#endif
    return d_weight;
  }
  const Tensor yd = as_f64(y), dd = as_f64(dout);
  const double* yv = yd.data<double>();
  const double* dv = dd.data<double>();
  const int64_t* s = slot.data<int64_t>();
  const double* w = weight.data<double>();
  double* dw = d_weight.data<double>();
  Tensor g = Tensor::zeros({p_n, h}, DType::kFloat64, dev);  // padding rows stay 0
  double* gv = g.data<double>();
  for (int64_t t = 0; t < t_n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t c = t * k + j;
      MP_CHECK(s[c] >= 0 && s[c] < p_n, "{}: pair {} at row {} of {}", op, c, s[c], p_n);
      const double* go = dv + t * h;
      const double* yr = yv + s[c] * h;
      double dot = 0;
      for (int64_t i = 0; i < h; ++i) {
        gv[s[c] * h + i] = w[c] * go[i];
        dot += go[i] * yr[i];
      }
      dw[c] = dot;
    }
  store(dy, g);
  return d_weight;
}

}  // namespace meshproof::kernels
