#include "kernels/ops/cast.h"

#include "kernels/ops/op_util.h"

namespace meshproof::kernels {

void cast(const Tensor& src, Tensor& dst) {
  constexpr std::string_view op = "cast";
  detail::check_operand(src, op, "src");
  detail::check_float(src, op, "src");
  detail::check_operand(dst, op, "dst", src.numel().value);
  detail::check_float(dst, op, "dst");
  if (detail::on_cuda(op, {&src, &dst})) {
    MP_OP_CUDA(
        op, launch_cast(src.raw_data(), src.dtype() == DType::kBFloat16, dst.raw_data(),
                        dst.dtype() == DType::kBFloat16, src.numel().value, detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(src.dtype(), op, [&](auto s) {
    using S = decltype(s);
    detail::dispatch_float(dst.dtype(), op, [&](auto d) {
      using D = decltype(d);
      const S* sp = src.data<S>();
      D* dp = dst.data<D>();
      const int64_t n = src.numel().value;  // hoisted out of the loop
      for (int64_t i = 0; i < n; ++i) dp[i] = static_cast<D>(sp[i]);
    });
  });
}

Tensor cast_to(const Tensor& src, DType dtype) {
  Tensor out = Tensor::empty(src.shape(), dtype, src.device());
  cast(src, out);
  return out;
}

}  // namespace meshproof::kernels
