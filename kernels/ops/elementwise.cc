#include "kernels/ops/elementwise.h"

#include <algorithm>
#include <vector>

#include "kernels/ops/column_reduce.h"
#include "kernels/ops/op_util.h"
#include "kernels/random/philox.h"

namespace meshproof::kernels {

void add_bias_(Tensor& y, const Tensor& bias) {
  constexpr std::string_view op = "add_bias_";
  detail::check_operand(y, op, "y");
  detail::check_float(y, op, "y");
  const int64_t n = y.shape().last(), m = y.shape().leading();
  detail::check_operand(bias, op, "bias", n);
  detail::check_same_dtype(y, bias, op);
  if (detail::on_cuda(op, {&y, &bias})) {
    MP_OP_CUDA(op, launch_add_bias(y.raw_data(), bias.raw_data(), y.dtype() == DType::kBFloat16, m,
                                   n, detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(y.dtype(), op, [&](auto t) {
    using T = decltype(t);
    T* yp = y.data<T>();
    const T* b = bias.data<T>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) yp[r * n + c] += b[c];
  });
}

void bias_grad(const Tensor& dy, Tensor& dbias) {
  constexpr std::string_view op = "bias_grad";
  detail::check_operand(dy, op, "dy");
  detail::check_float(dy, op, "dy");
  const int64_t n = dy.shape().last(), m = dy.shape().leading();
  detail::check_grad(dbias, op, "dbias", n);
  if (detail::on_cuda(op, {&dy, &dbias})) {
    const int64_t chunks = detail::column_chunks(m);
    MP_CHECK(chunks <= detail::kColumnMaxChunks,
             "{}: {} rows exceed the CUDA column reduction's {}", op, m,
             detail::kColumnMaxChunks * detail::kColumnChunkRows);
    // The chunk partials (kernels/ops/column_reduce.h), freed stream-ordered.
    Tensor partial =
        Tensor::empty({std::max<int64_t>(1, chunks * n)}, DType::kFloat64, dy.device());
    MP_OP_CUDA(
        op, launch_bias_grad(dy.raw_data(), dy.dtype() == DType::kBFloat16, m, n,
                             partial.data<double>(), dbias.data<float>(), detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(dy.dtype(), op, [&](auto t) {
    using T = decltype(t);
    detail::dispatch_grad(dbias.dtype(), op, [&](auto g) {
      using G = decltype(g);
      const T* d = dy.data<T>();
      G* db = dbias.data<G>();
      std::vector<double> acc(n, 0.0);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < n; ++c) acc[c] += d[r * n + c];
      for (int64_t c = 0; c < n; ++c) db[c] = static_cast<G>(db[c] + acc[c]);
    });
  });
}

void add_(Tensor& x, const Tensor& y) {
  constexpr std::string_view op = "add_";
  detail::check_operand(x, op, "x");
  detail::check_float(x, op, "x");
  detail::check_operand(y, op, "y", x.numel().value);
  detail::check_same_dtype(x, y, op);
  if (detail::on_cuda(op, {&x, &y})) {
    MP_OP_CUDA(op, launch_add(x.raw_data(), y.raw_data(), x.dtype() == DType::kBFloat16,
                              x.numel().value, detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(x.dtype(), op, [&](auto t) {
    using T = decltype(t);
    T* xp = x.data<T>();
    const T* yp = y.data<T>();
    const int64_t n = x.numel().value;  // hoisted: numel() multiplies the dims
    for (int64_t i = 0; i < n; ++i) xp[i] += yp[i];
  });
}

void scale_(Tensor& x, double alpha) {
  constexpr std::string_view op = "scale_";
  detail::check_operand(x, op, "x");
  detail::check_float(x, op, "x");
  if (detail::on_cuda(op, {&x})) {
    MP_OP_CUDA(op, launch_scale(x.raw_data(), x.dtype() == DType::kBFloat16, x.numel().value, alpha,
                                detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(x.dtype(), op, [&](auto t) {
    using T = decltype(t);
    T* xp = x.data<T>();
    const int64_t n = x.numel().value;  // hoisted out of the loop
    for (int64_t i = 0; i < n; ++i) xp[i] = static_cast<T>(xp[i] * alpha);
  });
}

namespace {

// Shared by forward and backward: out = in * mask / (1 - p).
void apply_dropout(std::string_view op, const Tensor& in, double p, const DropoutKey& key,
                   Tensor& out) {
  detail::check_operand(in, op, "input");
  detail::check_float(in, op, "input");
  detail::check_operand(out, op, "output", in.numel().value);
  detail::check_same_dtype(in, out, op);
  MP_CHECK(p >= 0.0 && p < 1.0, "{}: dropout probability {} outside [0, 1)", op, p);
  if (detail::on_cuda(op, {&in, &out})) {
    MP_OP_CUDA(op, launch_dropout(in.raw_data(), out.raw_data(), in.dtype() == DType::kBFloat16,
                                  in.numel().value, p, key.seed, key.stream, key.first_index,
                                  detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(in.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* ip = in.data<T>();
    T* op_ = out.data<T>();
    const int64_t n = in.numel().value;
    if (p == 0.0) {
      for (int64_t i = 0; i < n; ++i) op_[i] = ip[i];
      return;
    }
    const double keep_scale = 1.0 / (1.0 - p);
    for (int64_t i = 0; i < n; ++i) {
      const bool keep =
          philox_uniform(key.seed, key.stream, key.first_index + static_cast<uint64_t>(i)) >= p;
      op_[i] = keep ? static_cast<T>(ip[i] * keep_scale) : T(0);
    }
  });
}

}  // namespace

void dropout_forward(const Tensor& x, double p, const DropoutKey& key, Tensor& y) {
  apply_dropout("dropout_forward", x, p, key, y);
}

void dropout_backward(const Tensor& dy, double p, const DropoutKey& key, Tensor& dx) {
  apply_dropout("dropout_backward", dy, p, key, dx);
}

}  // namespace meshproof::kernels
