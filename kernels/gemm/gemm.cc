// GEMMs of a linear layer in their three roles: validation, dispatch and the float64 reference.
//
// CPU reference (docs/design.md section 4): every operand is decoded exactly to fp32 (bf16 and the
// FP8 codes are subsets of fp32; per-tensor FP8 values are fp32(q * scale_inv), the same product
// cuBLASLt forms from the code and the scale), then C = A.B^T is summed in fp32 in strictly
// increasing k order for every output element. We use our own loop rather than OpenBLAS: OpenBLAS
// picks its micro-kernel (and with it the summation order and FMA use) by the CPU it runs on, so
// its bits differ between machines even single-threaded; this loop's order is fixed by the code.
// The operands are packed (decoded, transposed) into panels and multiplied by register-tiled
// micro-kernels (AVX2 when the CPU has it, a portable 4-lane vector loop otherwise) that keep that
// order for every element, so the result is the same on every x86-64 machine and for every tile
// shape (section 21). The kernels library is compiled with -ffp-contract=off: no a*b+c is ever
// fused into an FMA.
// The CPU reference is in two files beside this one (gemm_cpu_internal.h): gemm_cpu_pack.cc decodes
// and packs the operands, gemm_cpu_kernel.cc runs the register-tiled product.
#include "kernels/gemm/gemm.h"

#include <string>
#include <vector>

#include "kernels/gemm/gemm_cpu_internal.h"
#include "kernels/gemm/gemm_internal.h"

namespace meshproof::kernels {

std::string_view gemm_role_name(GemmRole r) {
  switch (r) {
    case GemmRole::kFprop:
      return "fprop";
    case GemmRole::kDgrad:
      return "dgrad";
    case GemmRole::kWgrad:
      return "wgrad";
  }
  return "unknown";
}

namespace {

using detail::gemm_cpu;
using detail::GemmProblem;
using detail::GemmSide;

// Local name for error messages (quantize.cc owns scaling_mode_name; we must not depend on it
// being linked).
const char* mode_label(ScalingMode m) {
  switch (m) {
    case ScalingMode::kDelayedTensor:
      return "delayed per-tensor";
    case ScalingMode::kCurrentTensor:
      return "current per-tensor";
    case ScalingMode::kMxfp8:
      return "mxfp8";
    case ScalingMode::kBlock1x128:
      return "block 1x128";
    case ScalingMode::kBlock128x128:
      return "block 128x128";
    case ScalingMode::kNvfp4:
      return "nvfp4";
  }
  return "unknown";
}

// ---- operand description and validation (shared by the CPU and CUDA backends) ----

struct Dims {
  int64_t rows = 0;
  int64_t cols = 0;
};

Dims logical_dims(const GemmOperand& op) {
  if (const auto* t = std::get_if<const Tensor*>(&op)) {
    return {(*t)->shape().leading(), (*t)->shape().last()};
  }
  const QuantizedTensor* q = std::get<const QuantizedTensor*>(op);
  return {q->rows(), q->cols()};
}

std::string describe_operand(const GemmOperand& op) {
  if (const auto* t = std::get_if<const Tensor*>(&op)) return (*t)->describe();
  const QuantizedTensor* q = std::get<const QuantizedTensor*>(op);
  return fmt::format("{} {} quantized {}", mode_label(q->mode), dtype_name(q->format),
                     q->logical_shape.str());
}

void check_not_null(const GemmOperand& op, GemmRole role, const char* name) {
  const bool null = std::visit([](const auto* p) { return p == nullptr; }, op);
  MP_CHECK_INPUT(!null, "gemm_{}: operand {} is a null pointer", gemm_role_name(role), name);
}

void check_tensor_shape(const Tensor& t, const Shape& want, GemmRole role, const char* name,
                        const char* what) {
  MP_CHECK_INPUT(t.defined(), "gemm_{}: {} has no {}", gemm_role_name(role), name, what);
  MP_CHECK_INPUT(t.shape() == want, "gemm_{}: {} {} is {}, expected shape {}", gemm_role_name(role),
                 name, what, t.describe(), want.str());
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Checks the copy of a quantized operand that `side` uses: present, right format and shapes.
void check_quantized_copy(const QuantizedTensor& q, const GemmSide& side, GemmRole role) {
  const char* name = side.name;
  const std::string copy = side.transposed ? "columnwise copy" : "rowwise copy";
  const bool nvfp4 = q.mode == ScalingMode::kNvfp4;
  MP_CHECK_INPUT(
      nvfp4 ? q.format == DType::kE2M1 : (q.format == DType::kE4M3 || q.format == DType::kE5M2),
      "gemm_{}: operand {} has element format {}; expected {}", gemm_role_name(role), name,
      dtype_name(q.format), nvfp4 ? "e2m1 (nvfp4)" : "e4m3 or e5m2");
  MP_CHECK_INPUT(q.logical_shape.rank() >= 1, "gemm_{}: operand {} has an empty logical shape",
                 gemm_role_name(role), name);
  const bool present = side.transposed ? q.has_columnwise() : q.has_rowwise();
  MP_CHECK_INPUT(present,
                 "gemm_{}: operand {} ({}) has no {}; the {} GEMM consumes it {} (quantize it "
                 "with Usage{{.rowwise = {}, .columnwise = {}}})",
                 gemm_role_name(role), name, describe_operand(&q), copy, gemm_role_name(role),
                 side.transposed ? "transposed" : "as is", !side.transposed, side.transposed);
  const Tensor& data = side.transposed ? q.columnwise_data : q.rowwise_data;
  const Tensor& sinv = side.transposed ? q.columnwise_scale_inv : q.rowwise_scale_inv;
  const int64_t m = q.rows();
  const int64_t k = q.cols();
  const bool stored_transposed = side.transposed && q.mode != ScalingMode::kMxfp8;
  const int64_t sr = stored_transposed ? k : m;  // stored rows
  const int64_t sc = stored_transposed ? m : k;  // stored cols
  const std::string data_what = copy + " data";
  const std::string scale_what = copy + " scale_inv";
  MP_CHECK_INPUT(data.dtype() == q.format, "gemm_{}: {} {} is {}, expected element format {}",
                 gemm_role_name(role), name, data_what, data.describe(), dtype_name(q.format));
  // The data may carry leading dims (e.g. [B, S, K]); its 2-D view must be [sr, sc].
  MP_CHECK_INPUT(
      data.shape().rank() >= 1 && data.shape().leading() == sr && data.shape().last() == sc,
      "gemm_{}: {} {} is {}, expected shape [{}, {}] (logical shape {})", gemm_role_name(role),
      name, data_what, data.describe(), sr, sc, q.logical_shape.str());
  switch (q.mode) {
    case ScalingMode::kDelayedTensor:
    case ScalingMode::kCurrentTensor:
      MP_CHECK_INPUT(sinv.defined() && sinv.dtype() == DType::kFloat32,
                     "gemm_{}: {} {} must be float32[1]", gemm_role_name(role), name, scale_what);
      check_tensor_shape(sinv, Shape{1}, role, name, scale_what.c_str());
      break;
    case ScalingMode::kMxfp8:
      MP_CHECK_INPUT(m % 32 == 0 && k % 32 == 0,
                     "gemm_{}: MXFP8 operand {} has logical shape {}; both dims must be "
                     "multiples of 32",
                     gemm_role_name(role), name, q.logical_shape.str());
      MP_CHECK_INPUT(sinv.defined() && sinv.dtype() == DType::kE8M0, "gemm_{}: {} {} must be e8m0",
                     gemm_role_name(role), name, scale_what);
      check_tensor_shape(sinv, side.transposed ? Shape{m / 32, k} : Shape{m, k / 32}, role, name,
                         scale_what.c_str());
      break;
    case ScalingMode::kBlock1x128:
      MP_CHECK_INPUT(sinv.defined() && sinv.dtype() == DType::kFloat32,
                     "gemm_{}: {} {} must be float32", gemm_role_name(role), name, scale_what);
      check_tensor_shape(sinv, Shape{sr, ceil_div(sc, 128)}, role, name, scale_what.c_str());
      break;
    case ScalingMode::kBlock128x128:
      MP_CHECK_INPUT(sinv.defined() && sinv.dtype() == DType::kFloat32,
                     "gemm_{}: {} {} must be float32", gemm_role_name(role), name, scale_what);
      check_tensor_shape(sinv, Shape{ceil_div(sr, 128), ceil_div(sc, 128)}, role, name,
                         scale_what.c_str());
      break;
    case ScalingMode::kNvfp4: {
      // E4M3 codes per 1x16 block of the stored rows, and the copy's global amax.
      MP_CHECK_INPUT(sr % 16 == 0 && sc % 16 == 0,
                     "gemm_{}: NVFP4 operand {} has logical shape {}; both dims must be "
                     "multiples of 16",
                     gemm_role_name(role), name, q.logical_shape.str());
      MP_CHECK_INPUT(sinv.defined() && sinv.dtype() == DType::kE4M3,
                     "gemm_{}: {} {} must be e4m3 codes", gemm_role_name(role), name, scale_what);
      check_tensor_shape(sinv, Shape{sr, sc / 16}, role, name, scale_what.c_str());
      const Tensor& amax = side.transposed ? q.columnwise_amax : q.amax;
      MP_CHECK_INPUT(amax.defined() && amax.dtype() == DType::kFloat32 && amax.numel().value == 1,
                     "gemm_{}: NVFP4 operand {} has no {} global amax (float32[1])",
                     gemm_role_name(role), name, copy);
      break;
    }
  }
}

void check_side(const GemmSide& side, GemmRole role) {
  if (const auto* t = std::get_if<const Tensor*>(&side.op)) {
    MP_CHECK_INPUT((*t)->defined(), "gemm_{}: operand {} is an undefined tensor",
                   gemm_role_name(role), side.name);
    const DType d = (*t)->dtype();
    MP_CHECK_INPUT(d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat64,
                   "gemm_{}: operand {} is {}; high-precision operands must be float32 or bfloat16 "
                   "(float64: CPU finite-difference checks)",
                   gemm_role_name(role), side.name, (*t)->describe());
    MP_CHECK_INPUT((*t)->shape().rank() >= 1, "gemm_{}: operand {} has an empty shape",
                   gemm_role_name(role), side.name);
    return;
  }
  check_quantized_copy(*std::get<const QuantizedTensor*>(side.op), side, role);
}

// Device of the tensors one side reads.
Device side_device(const GemmSide& side) {
  if (const auto* t = std::get_if<const Tensor*>(&side.op)) return (*t)->device();
  const QuantizedTensor* q = std::get<const QuantizedTensor*>(side.op);
  return side.transposed ? q->columnwise_data.device() : q->rowwise_data.device();
}

void check_devices(const GemmProblem& p, const Tensor& out) {
  const Device d = out.device();
  for (const GemmSide* s : {&p.a, &p.b}) {
    Device sd = side_device(*s);
    MP_CHECK_INPUT(sd == d, "gemm_{}: operand {} is on {} but the output is on {}",
                   gemm_role_name(p.role), s->name, sd.str(), d.str());
    if (const auto* q = std::get_if<const QuantizedTensor*>(&s->op)) {
      const Tensor& sinv = s->transposed ? (*q)->columnwise_scale_inv : (*q)->rowwise_scale_inv;
      MP_CHECK_INPUT(sinv.device() == d, "gemm_{}: scale_inv of operand {} is on {}, not {}",
                     gemm_role_name(p.role), s->name, sinv.device().str(), d.str());
    }
  }
}

void check_output(const Tensor& out, int64_t rows, int64_t cols, const GemmOptions& options,
                  GemmRole role, const char* name) {
  MP_CHECK_INPUT(out.defined(), "gemm_{}: output {} is an undefined tensor", gemm_role_name(role),
                 name);
  MP_CHECK_INPUT(out.dtype() == DType::kFloat32 || out.dtype() == DType::kBFloat16 ||
                     out.dtype() == DType::kFloat64,
                 "gemm_{}: output {} is {}; expected float32 or bfloat16 (float64: CPU "
                 "finite-difference checks)",
                 gemm_role_name(role), name, out.describe());
  MP_CHECK_INPUT(
      out.shape().rank() >= 1 && out.shape().leading() == rows && out.shape().last() == cols,
      "gemm_{}: output {} is {}, expected [{}, {}]", gemm_role_name(role), name, out.describe(),
      rows, cols);
  MP_CHECK_INPUT(!options.accumulate || out.dtype() != DType::kBFloat16,
                 "gemm_{}: accumulate needs a float32 (or float64) output, but {} is {}",
                 gemm_role_name(role), name, out.describe());
}

// float64 (the model's fp64 mode for finite-difference checks): plain operands and output all
// float64, on the CPU, summed in double over k = 0..K-1 in order.
bool is_f64(const GemmSide& side) {
  const auto* t = std::get_if<const Tensor*>(&side.op);
  return t != nullptr && (*t)->dtype() == DType::kFloat64;
}

// The side's canonical matrix ([rows, k], or [k, rows] when `want_k_major` is false) in double.
std::vector<double> side_f64(const GemmSide& side, bool want_k_major) {
  const Tensor& t = **std::get_if<const Tensor*>(&side.op);
  const int64_t rows = t.shape().leading(), cols = t.shape().last();
  const double* d = t.data<double>();
  std::vector<double> v(d, d + rows * cols);
  const bool v_is_canonical = !side.transposed;  // v is the logical operand
  if (want_k_major == v_is_canonical) return v;
  std::vector<double> tr(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) tr[c * rows + r] = v[r * cols + c];
  return tr;
}

void gemm_cpu_f64(const GemmProblem& p, Tensor& out, const GemmOptions& options) {
  const int64_t R = p.r, S = p.s, K = p.k;
  const std::vector<double> a = side_f64(p.a, /*want_k_major=*/true);    // [R, K]
  const std::vector<double> bt = side_f64(p.b, /*want_k_major=*/false);  // [K, S]
  double* o = out.data<double>();
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < S; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += a[i * K + k] * bt[k * S + j];
      o[i * S + j] = options.accumulate ? o[i * S + j] + acc : acc;
    }
}

void run_gemm(GemmProblem p, Tensor& out, const GemmOptions& options, const char* out_name) {
  check_not_null(p.a.op, p.role, p.a.name);
  check_not_null(p.b.op, p.role, p.b.name);
  check_side(p.a, p.role);
  check_side(p.b, p.role);
  check_output(out, p.r, p.s, options, p.role, out_name);
  check_devices(p, out);
  const bool f64 = out.dtype() == DType::kFloat64;
  if (f64 || is_f64(p.a) || is_f64(p.b)) {
    MP_CHECK_INPUT(f64 && is_f64(p.a) && is_f64(p.b) && out.device().is_cpu(),
                   "gemm_{}: float64 GEMMs take float64 {}, {} and output on the CPU, got {}, {} "
                   "and {}",
                   gemm_role_name(p.role), p.a.name, p.b.name, describe_operand(p.a.op),
                   describe_operand(p.b.op), out.describe());
    if (p.r > 0 && p.s > 0) gemm_cpu_f64(p, out, options);
    return;
  }
  if (p.r == 0 || p.s == 0) return;
  if (out.device().is_cpu()) {
    gemm_cpu(p, out, options);
    return;
  }
#if MESHPROOF_HAVE_CUDA
  detail::gemm_cuda(p, out, options);
#else
  MP_FAIL_INPUT("gemm_{}: output is on {} but this build has no CUDA backend",
                gemm_role_name(p.role), out.device().str());
#endif
}

std::string shapes(const GemmOperand& a, const char* an, const GemmOperand& b, const char* bn) {
  return fmt::format("{} is {}, {} is {}", an, describe_operand(a), bn, describe_operand(b));
}

}  // namespace

void gemm_fprop(GemmOperand x, GemmOperand w, Tensor& y, const GemmOptions& options) {
  check_not_null(x, GemmRole::kFprop, "X");
  check_not_null(w, GemmRole::kFprop, "W");
  const Dims xd = logical_dims(x);  // [M, K]
  const Dims wd = logical_dims(w);  // [N, K]
  MP_CHECK_INPUT(xd.cols == wd.cols, "gemm_fprop: X[M,K] and W[N,K] disagree on K: {}",
                 shapes(x, "X", w, "W"));
  run_gemm(
      GemmProblem{GemmRole::kFprop, {x, false, "X"}, {w, false, "W"}, xd.rows, wd.rows, xd.cols}, y,
      options, "Y");
}

void gemm_dgrad(GemmOperand dy, GemmOperand w, Tensor& dx, const GemmOptions& options) {
  check_not_null(dy, GemmRole::kDgrad, "dY");
  check_not_null(w, GemmRole::kDgrad, "W");
  const Dims dyd = logical_dims(dy);  // [M, N]
  const Dims wd = logical_dims(w);    // [N, K]
  MP_CHECK_INPUT(dyd.cols == wd.rows, "gemm_dgrad: dY[M,N] and W[N,K] disagree on N: {}",
                 shapes(dy, "dY", w, "W"));
  run_gemm(
      GemmProblem{GemmRole::kDgrad, {dy, false, "dY"}, {w, true, "W"}, dyd.rows, wd.cols, dyd.cols},
      dx, options, "dX");
}

void gemm_wgrad(GemmOperand dy, GemmOperand x, Tensor& dw, const GemmOptions& options) {
  check_not_null(dy, GemmRole::kWgrad, "dY");
  check_not_null(x, GemmRole::kWgrad, "X");
  const Dims dyd = logical_dims(dy);  // [M, N]
  const Dims xd = logical_dims(x);    // [M, K]
  MP_CHECK_INPUT(dyd.rows == xd.rows, "gemm_wgrad: dY[M,N] and X[M,K] disagree on M: {}",
                 shapes(dy, "dY", x, "X"));
  run_gemm(
      GemmProblem{GemmRole::kWgrad, {dy, true, "dY"}, {x, true, "X"}, dyd.cols, xd.cols, dyd.rows},
      dw, options, "dW");
}

}  // namespace meshproof::kernels
