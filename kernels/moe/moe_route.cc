#include "kernels/moe/moe_route.h"

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

void check_on(const char* op, const char* name, const Tensor& t, DType dtype, const Shape& shape,
              Device dev) {
  MP_CHECK(t.defined() && t.dtype() == dtype && t.shape() == shape && t.device() == dev,
           "{}: {} must be {} {} on {}, got {}", op, name, dtype_name(dtype), shape.str(),
           dev.str(), t.defined() ? t.describe() : "undefined");
}

}  // namespace

MoeRouteOut moe_route(const Tensor& logits, int64_t top_k, bool sigmoid) {
  constexpr const char* op = "moe_route";
  const bool f64 = logits.defined() && logits.dtype() == DType::kFloat64;
  MP_CHECK(
      logits.defined() && (f64 || logits.dtype() == DType::kFloat32) && logits.shape().rank() == 2,
      "{}: logits must be float32 (or float64) [T, E], got {}", op,
      logits.defined() ? logits.describe() : "undefined");
  const int64_t t_n = logits.shape()[0], e_n = logits.shape()[1];
  MP_CHECK(top_k >= 1 && top_k <= e_n, "{}: top_k {} not in [1, {}]", op, top_k, e_n);
  const Device dev = logits.device();
  MoeRouteOut r{Tensor::empty({t_n, e_n}, DType::kFloat64, dev),
                Tensor::empty({t_n, top_k}, DType::kInt32, dev),
                Tensor::empty({t_n, top_k}, DType::kFloat64, dev)};
  if (device_op(op, dev)) {
#if MESHPROOF_HAVE_CUDA
    MP_CHECK(!f64, "{}: float64 logits are CPU-only, got {}", op, logits.describe());
    MP_CUDA_CHECK_STATUS(cuda::launch_moe_route(logits.data<float>(), t_n, e_n, top_k, sigmoid,
                                                r.probs.data<double>(), r.expert.data<int32_t>(),
                                                r.weight.data<double>(), current_context().stream));
#endif
    return r;
  }
  double* p = r.probs.data<double>();
  int32_t* ex = r.expert.data<int32_t>();
  double* w = r.weight.data<double>();
  for (int64_t t = 0; t < t_n; ++t) {
    if (f64)
      moe_row::route_row(logits.data<double>() + t * e_n, e_n, top_k, sigmoid, true, p + t * e_n,
                         ex + t * top_k, w + t * top_k);
    else
      moe_row::route_row(logits.data<float>() + t * e_n, e_n, top_k, sigmoid, false, p + t * e_n,
                         ex + t * top_k, w + t * top_k);
  }
  return r;
}

Tensor moe_expert_counts(const Tensor& expert, int64_t experts) {
  constexpr const char* op = "moe_expert_counts";
  MP_CHECK(expert.defined() && expert.dtype() == DType::kInt32 && expert.shape().rank() == 2 &&
               experts >= 1,
           "{}: expert must be int32 [T, k] and the experts >= 1, got {} and {}", op,
           expert.defined() ? expert.describe() : "undefined", experts);
  const Device dev = expert.device();
  const int64_t pairs = expert.numel().value;
  if (device_op(op, dev)) {
    Tensor counts = Tensor::empty({experts}, DType::kInt64, dev);
#if MESHPROOF_HAVE_CUDA
    MP_CUDA_CHECK_STATUS(cuda::launch_moe_expert_counts(
        expert.data<int32_t>(), pairs, experts, counts.data<int64_t>(), current_context().stream));
#endif
    return counts;
  }
  Tensor counts = Tensor::zeros({experts}, DType::kInt64, dev);
  int64_t* c = counts.data<int64_t>();
  const int32_t* ex = expert.data<int32_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    MP_CHECK(ex[i] >= 0 && ex[i] < experts, "{}: expert {} of pair {} outside [0, {})", op, ex[i],
             i, experts);
    ++c[ex[i]];
  }
  return counts;
}

Tensor moe_prob_sums(const Tensor& probs) {
  constexpr const char* op = "moe_prob_sums";
  MP_CHECK(probs.defined() && probs.dtype() == DType::kFloat64 && probs.shape().rank() == 2,
           "{}: probs must be float64 [T, E], got {}", op,
           probs.defined() ? probs.describe() : "undefined");
  const Device dev = probs.device();
  const int64_t t_n = probs.shape()[0], e_n = probs.shape()[1];
  Tensor sums = Tensor::empty({e_n}, DType::kFloat64, dev);
  if (device_op(op, dev)) {
#if MESHPROOF_HAVE_CUDA
    MP_CUDA_CHECK_STATUS(cuda::launch_moe_prob_sums(probs.data<double>(), t_n, e_n,
                                                    sums.data<double>(), current_context().stream));
#endif
    return sums;
  }
  const double* p = probs.data<double>();
  double* s = sums.data<double>();
  for (int64_t e = 0; e < e_n; ++e) s[e] = 0.0;
  for (int64_t t = 0; t < t_n; ++t)
    for (int64_t e = 0; e < e_n; ++e) s[e] += p[t * e_n + e];
  return sums;
}

Tensor moe_route_backward(const Tensor& probs, const Tensor& expert, const Tensor& weight,
                          const Tensor& d_weight, const Tensor& aux, bool sigmoid, DType dtype) {
  constexpr const char* op = "moe_route_backward";
  MP_CHECK(probs.defined() && probs.dtype() == DType::kFloat64 && probs.shape().rank() == 2,
           "{}: probs must be float64 [T, E], got {}", op,
           probs.defined() ? probs.describe() : "undefined");
  const Device dev = probs.device();
  const int64_t t_n = probs.shape()[0], e_n = probs.shape()[1];
  MP_CHECK(expert.defined() && expert.shape().rank() == 2 && expert.shape()[0] == t_n,
           "{}: expert must be int32 [{}, k], got {}", op, t_n,
           expert.defined() ? expert.describe() : "undefined");
  const int64_t k = expert.shape()[1];
  check_on(op, "expert", expert, DType::kInt32, Shape{t_n, k}, dev);
  check_on(op, "weight", weight, DType::kFloat64, Shape{t_n, k}, dev);
  check_on(op, "d_weight", d_weight, DType::kFloat64, Shape{t_n, k}, dev);
  if (aux.defined()) check_on(op, "aux", aux, DType::kFloat64, Shape{e_n}, dev);
  const double* a = aux.defined() ? aux.data<double>() : nullptr;
  if (device_op(op, dev)) {
    MP_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16,
             "{}: the device gradient must be float32 or bfloat16, got {}", op, dtype_name(dtype));
    Tensor scratch = Tensor::empty({t_n, e_n}, DType::kFloat64, dev);
    Tensor out = Tensor::empty({t_n, e_n}, dtype, dev);
#if MESHPROOF_HAVE_CUDA
    MP_CUDA_CHECK_STATUS(cuda::launch_moe_route_backward(
        probs.data<double>(), expert.data<int32_t>(), weight.data<double>(),
        d_weight.data<double>(), a, t_n, e_n, k, sigmoid, scratch.data<double>(), out.raw_data(),
        dtype == DType::kBFloat16, current_context().stream));
#endif
    return out;
  }
  Tensor d = Tensor::empty({t_n, e_n}, DType::kFloat64, dev);
  for (int64_t t = 0; t < t_n; ++t)
    moe_row::route_backward_row(probs.data<double>() + t * e_n, expert.data<int32_t>() + t * k,
                                weight.data<double>() + t * k, d_weight.data<double>() + t * k, a,
                                e_n, k, sigmoid, d.data<double>() + t * e_n);
  if (dtype == DType::kFloat64) return d;
  Tensor out = Tensor::empty({t_n, e_n}, dtype, dev);
  cast(d, out);  // rounded once (static_cast<T>(double), as the device's store_d)
  return out;
}

}  // namespace meshproof::kernels
