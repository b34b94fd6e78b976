// GEMMs of a linear layer in their three roles: validation, dispatch and the CPU reference.
//
// CPU reference (docs/design.md section 4): every operand is decoded exactly to fp32 (bf16 and the
// FP8 codes are subsets of fp32; per-tensor FP8 values are fp32(q * scale_inv), the same product
// cuBLASLt forms from the code and the scale), then C = A.B^T is summed in fp32 in strictly
// increasing k order for every output element. We use our own loop rather than OpenBLAS: OpenBLAS
// picks its micro-kernel (and with it the summation order and FMA use) by the CPU it runs on, so
// its bits differ between machines even single-threaded; this loop's order is fixed by the code.
// The loop is "i-k-j": for each output row it sweeps k in order and updates the whole row, so it
// vectorises over j without reassociating any sum. Whether the compiler contracts a*b+c into an
// FMA depends on the target flags (plain x86-64 has no FMA); for one build the result is bitwise
// reproducible either way, and the tests' tolerances cover both.
#include "kernels/gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/formats.h"
#include "kernels/gemm_internal.h"

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

// ---- exact element decodes (kernels/formats.h, shared bit for bit with the CUDA kernels) ----

float decode_fp8(DType format, uint8_t b) {
  return format == DType::kE4M3 ? fmt8::e4m3_to_float(b) : fmt8::e5m2_to_float(b);
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
  MP_CHECK_INPUT(q.mode != ScalingMode::kNvfp4,
                 "gemm_{}: operand {} ({}) uses NVFP4, which the GEMM does not support yet",
                 gemm_role_name(role), name, describe_operand(&q));
  MP_CHECK_INPUT(q.format == DType::kE4M3 || q.format == DType::kE5M2,
                 "gemm_{}: operand {} has element format {}; expected e4m3 or e5m2",
                 gemm_role_name(role), name, dtype_name(q.format));
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
    case ScalingMode::kNvfp4:
      break;
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

// ---- CPU reference ----

// Decodes the stored matrix (`rows` x `cols`, row-major) of one quantized copy to fp32.
std::vector<float> decode_stored(const QuantizedTensor& q, const Tensor& data, const Tensor& sinv,
                                 bool columnwise) {
  const int64_t rows = data.shape().leading();
  const int64_t cols = data.shape().last();
  const auto* codes = static_cast<const uint8_t*>(data.raw_data());
  std::vector<float> out(static_cast<size_t>(rows * cols));
  auto at = [&](int64_t r, int64_t c) { return decode_fp8(q.format, codes[r * cols + c]); };
  switch (q.mode) {
    case ScalingMode::kDelayedTensor:
    case ScalingMode::kCurrentTensor: {
      const float s = *sinv.data<float>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = at(r, c) * s;
      break;
    }
    case ScalingMode::kMxfp8: {
      // rowwise: scale [rows, cols/32] (1x32 blocks); columnwise: [rows/32, cols] (32x1 blocks).
      const auto* e8 = static_cast<const uint8_t*>(sinv.raw_data());
      const int64_t scols = sinv.shape()[1];
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const uint8_t e = columnwise ? e8[(r / 32) * scols + c] : e8[r * scols + c / 32];
          // x = q * 2^(e-127): ldexp is exact (the result is a normal or subnormal fp32).
          out[r * cols + c] = e == 0xFF ? std::numeric_limits<float>::quiet_NaN()
                                        : std::ldexp(at(r, c), static_cast<int>(e) - 127);
        }
      }
      break;
    }
    case ScalingMode::kBlock1x128:
    case ScalingMode::kBlock128x128: {
      // The stored matrix (the transpose for the columnwise copy) has 1x128 or 128x128 blocks.
      const float* s = sinv.data<float>();
      const int64_t scols = sinv.shape()[1];
      const int64_t rdiv = q.mode == ScalingMode::kBlock1x128 ? 1 : 128;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          out[r * cols + c] = at(r, c) * s[(r / rdiv) * scols + c / 128];
      break;
    }
    case ScalingMode::kNvfp4:
      MP_FAIL("gemm: NVFP4 operands are not supported");
  }
  return out;
}

std::vector<float> transpose(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<float> t(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = v[r * cols + c];
  return t;
}

// The side's canonical matrix ([rows, k]: the logical operand, transposed for columnwise use),
// decoded to fp32. When `want_k_major` is false the result is returned transposed ([k, rows]).
std::vector<float> decode_side(const GemmSide& side, bool want_k_major) {
  std::vector<float> v;
  int64_t rows = 0;  // of v as built
  int64_t cols = 0;
  bool v_is_logical = true;  // v holds the logical (untransposed) operand
  if (const auto* tp = std::get_if<const Tensor*>(&side.op)) {
    const Tensor& t = **tp;
    rows = t.shape().leading();
    cols = t.shape().last();
    v.resize(static_cast<size_t>(rows * cols));
    if (t.dtype() == DType::kFloat32) {
      std::copy_n(t.data<float>(), v.size(), v.begin());
    } else {
      const auto* h = static_cast<const uint16_t*>(t.raw_data());
      for (size_t i = 0; i < v.size(); ++i) v[i] = fmt8::bf16_to_float(h[i]);
    }
  } else {
    const QuantizedTensor& q = *std::get<const QuantizedTensor*>(side.op);
    const Tensor& data = side.transposed ? q.columnwise_data : q.rowwise_data;
    const Tensor& sinv = side.transposed ? q.columnwise_scale_inv : q.rowwise_scale_inv;
    v = decode_stored(q, data, sinv, side.transposed);
    rows = data.shape().leading();
    cols = data.shape().last();
    // Per-tensor and block columnwise copies are stored transposed already.
    v_is_logical = !(side.transposed && q.mode != ScalingMode::kMxfp8);
  }
  // Canonical = logical^T when transposed. v is logical or logical^T; flip as needed.
  const bool v_is_canonical = side.transposed ? !v_is_logical : v_is_logical;
  const bool want_v = want_k_major ? v_is_canonical : !v_is_canonical;
  return want_v ? v : transpose(v, rows, cols);
}

// c[R, S] = a[R, K] · bt[K, S] in fp32. Tiles of kRowBlock x kColBlock outputs accumulate in a
// local array (L1/registers) over the whole K; each c[i][j] is the fp32 sum over k = 0, 1, ...,
// K-1 in order, so the result depends neither on the tiling nor on the vector width: the AVX2
// clone (8 lanes across j, no FMA: the target does not enable it, so no multiply-add is
// contracted) is bitwise equal to the baseline SSE2 one, and the CPU reference stays the same
// on every x86-64 machine.
__attribute__((target_clones("avx2", "default"))) void gemm_tiles_f32(const float* a,
                                                                      const float* bt, float* c,
                                                                      int64_t R, int64_t S,
                                                                      int64_t K) {
  constexpr int64_t kRowBlock = 4, kColBlock = 64;
  float acc[kRowBlock][kColBlock];
  for (int64_t i0 = 0; i0 < R; i0 += kRowBlock) {
    const int64_t rows = std::min(R - i0, kRowBlock);
    for (int64_t j0 = 0; j0 < S; j0 += kColBlock) {
      const int64_t cols = std::min(S - j0, kColBlock);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) acc[i][j] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float* brow = bt + k * S + j0;
        for (int64_t i = 0; i < rows; ++i) {
          const float av = a[(i0 + i) * K + k];
          float* arow = acc[i];
          for (int64_t j = 0; j < cols; ++j) arow[j] += av * brow[j];
        }
      }
      for (int64_t i = 0; i < rows; ++i) std::copy_n(acc[i], cols, c + (i0 + i) * S + j0);
    }
  }
}

void gemm_cpu(const GemmProblem& p, Tensor& out, const GemmOptions& options) {
  const int64_t R = p.r, S = p.s, K = p.k;
  const std::vector<float> a = decode_side(p.a, /*want_k_major=*/true);    // [R, K]
  const std::vector<float> bt = decode_side(p.b, /*want_k_major=*/false);  // [K, S]
  std::vector<float> c(static_cast<size_t>(R * S), 0.0f);                  // [R, S]
  gemm_tiles_f32(a.data(), bt.data(), c.data(), R, S, K);
  const size_t n = c.size();
  if (out.dtype() == DType::kFloat32) {
    float* o = out.data<float>();
    if (options.accumulate) {
      for (size_t i = 0; i < n; ++i) o[i] += c[i];
    } else {
      std::copy(c.begin(), c.end(), o);
    }
  } else {
    auto* o = static_cast<uint16_t*>(out.raw_data());
    for (size_t i = 0; i < n; ++i) o[i] = fmt8::float_to_bf16(c[i]);  // round to nearest even
  }
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

void run(GemmProblem p, Tensor& out, const GemmOptions& options, const char* out_name) {
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
  run(GemmProblem{GemmRole::kFprop, {x, false, "X"}, {w, false, "W"}, xd.rows, wd.rows, xd.cols}, y,
      options, "Y");
}

void gemm_dgrad(GemmOperand dy, GemmOperand w, Tensor& dx, const GemmOptions& options) {
  check_not_null(dy, GemmRole::kDgrad, "dY");
  check_not_null(w, GemmRole::kDgrad, "W");
  const Dims dyd = logical_dims(dy);  // [M, N]
  const Dims wd = logical_dims(w);    // [N, K]
  MP_CHECK_INPUT(dyd.cols == wd.rows, "gemm_dgrad: dY[M,N] and W[N,K] disagree on N: {}",
                 shapes(dy, "dY", w, "W"));
  run(GemmProblem{GemmRole::kDgrad, {dy, false, "dY"}, {w, true, "W"}, dyd.rows, wd.cols, dyd.cols},
      dx, options, "dX");
}

void gemm_wgrad(GemmOperand dy, GemmOperand x, Tensor& dw, const GemmOptions& options) {
  check_not_null(dy, GemmRole::kWgrad, "dY");
  check_not_null(x, GemmRole::kWgrad, "X");
  const Dims dyd = logical_dims(dy);  // [M, N]
  const Dims xd = logical_dims(x);    // [M, K]
  MP_CHECK_INPUT(dyd.rows == xd.rows, "gemm_wgrad: dY[M,N] and X[M,K] disagree on M: {}",
                 shapes(dy, "dY", x, "X"));
  run(GemmProblem{GemmRole::kWgrad, {dy, true, "dY"}, {x, true, "X"}, dyd.cols, xd.cols, dyd.rows},
      dw, options, "dW");
}

}  // namespace meshproof::kernels
