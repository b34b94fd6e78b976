#include "kernels/cast.h"

#include "kernels/op_util.h"

namespace meshproof::kernels {

void cast(const Tensor& src, Tensor& dst) {
  constexpr std::string_view op = "cast";
  detail::check_operand(src, op, "src");
  detail::check_float(src, op, "src");
  detail::check_operand(dst, op, "dst", src.numel().value);
  detail::check_float(dst, op, "dst");
  detail::dispatch_float(src.dtype(), op, [&](auto s) {
    using S = decltype(s);
    detail::dispatch_float(dst.dtype(), op, [&](auto d) {
      using D = decltype(d);
      const S* sp = src.data<S>();
      D* dp = dst.data<D>();
      for (int64_t i = 0; i < src.numel().value; ++i) dp[i] = static_cast<D>(sp[i]);
    });
  });
}

Tensor cast_to(const Tensor& src, DType dtype) {
  Tensor out = Tensor::empty(src.shape(), dtype, src.device());
  cast(src, out);
  return out;
}

}  // namespace meshproof::kernels
