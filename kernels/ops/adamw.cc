#include "kernels/ops/adamw.h"

#include <cmath>

#include "kernels/ops/op_util.h"

namespace meshproof::kernels {

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                int64_t step, const AdamWHyper& hp) {
  constexpr std::string_view op = "adamw_step";
  detail::check_operand(param, op, "param");
  MP_CHECK(param.dtype() == DType::kFloat32, "{}: master weights must be float32, got {}", op,
           param.describe());
  const int64_t n = param.numel().value;
  for (const Tensor* t :
       {&grad, const_cast<const Tensor*>(&exp_avg), const_cast<const Tensor*>(&exp_avg_sq)}) {
    detail::check_operand(*t, op, "state", n);
    detail::check_same_dtype(param, *t, op);
  }
  MP_CHECK(step >= 1, "{}: step must be >= 1, got {}", op, step);
  // Scalars are formed in double (as Python floats in PyTorch) and enter the fp32 ops as float.
  const float decay = static_cast<float>(1.0 - hp.lr * hp.weight_decay);
  const float b1 = static_cast<float>(hp.beta1), b2 = static_cast<float>(hp.beta2);
  const float one_minus_b1 = static_cast<float>(1.0 - hp.beta1);
  const float one_minus_b2 = static_cast<float>(1.0 - hp.beta2);
  const double bc1 = 1.0 - std::pow(hp.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(hp.beta2, static_cast<double>(step));
  const float step_size = static_cast<float>(hp.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float eps = static_cast<float>(hp.eps);
  if (detail::on_cuda(op, {&param, &grad, &exp_avg, &exp_avg_sq})) {
    MP_OP_CUDA(op, launch_adamw(param.data<float>(), grad.data<float>(), exp_avg.data<float>(),
                                exp_avg_sq.data<float>(), n, hp.weight_decay != 0.0, decay, b1, b2,
                                one_minus_b1, one_minus_b2, step_size, bc2_sqrt, eps,
                                detail::cuda_stream()));
    return;
  }
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* m = exp_avg.data<float>();
  float* v = exp_avg_sq.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    if (hp.weight_decay != 0.0) p[i] *= decay;
    m[i] = m[i] * b1 + g[i] * one_minus_b1;
    v[i] = v[i] * b2 + one_minus_b2 * (g[i] * g[i]);
    const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
    p[i] += -step_size * (m[i] / denom);
  }
}

double sum_of_squares(const Tensor& t) {
  detail::check_operand(t, "sum_of_squares", "t");
  detail::check_float(t, "sum_of_squares", "t");
  if (detail::on_cuda("sum_of_squares", {&t})) {
    Tensor out = Tensor::empty({1}, DType::kFloat64, t.device());
    MP_OP_CUDA("sum_of_squares",
               launch_sum_of_squares(t.raw_data(), t.dtype() == DType::kBFloat16, t.numel().value,
                                     out.data<double>(), detail::cuda_stream()));
    return out.to(Device::cpu()).data<double>()[0];  // to() synchronises the stream
  }
  return detail::dispatch_float(t.dtype(), "sum_of_squares", [&](auto z) -> double {
    using T = decltype(z);
    const T* p = t.data<T>();
    double acc = 0;
    const int64_t n = t.numel().value;  // hoisted: numel() multiplies the dims
    for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(p[i]) * p[i];
    return acc;
  });
}

double sum_of_squares_total(const std::vector<const Tensor*>& tensors) {
  constexpr std::string_view op = "sum_of_squares_total";
  if (tensors.empty()) return 0.0;
  for (const Tensor* t : tensors) {
    MP_CHECK(t != nullptr, "{}: null tensor", op);
    detail::check_operand(*t, op, "t");
    MP_CHECK(t->dtype() == DType::kFloat32, "{}: {} is not float32", op, t->describe());
    MP_CHECK(t->device() == tensors[0]->device(), "{}: {} is not on {} like the first tensor", op,
             t->describe(), tensors[0]->device().str());
  }
  if (tensors[0]->device().is_cpu()) {
    double sq = 0;
    for (const Tensor* t : tensors) sq += sum_of_squares(*t);
    return sq;
  }
  const Device dev = tensors[0]->device();
  const auto count = static_cast<int64_t>(tensors.size());
  std::vector<const float*> ptrs;
  std::vector<int64_t> sizes;
  for (const Tensor* t : tensors) {
    ptrs.push_back(t->data<float>());
    sizes.push_back(t->numel().value);
  }
  Tensor partial = Tensor::empty({count}, DType::kFloat64, dev);
  Tensor out = Tensor::empty({1}, DType::kFloat64, dev);
  MP_OP_CUDA(
      op, launch_sum_of_squares_in_order(ptrs.data(), sizes.data(), count, partial.data<double>(),
                                         out.data<double>(), detail::cuda_stream()));
  double result = 0;
  copy_bytes(&result, Device::cpu(), out.raw_data(), dev, Bytes(sizeof(double)));  // synchronises
  return result;
}

}  // namespace meshproof::kernels
