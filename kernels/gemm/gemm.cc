// GEMMs of a linear layer in their three roles: validation, dispatch and the CPU reference.
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
// Over 600 lines on purpose: one file per op family; validation, dispatch and the packed CPU
// kernel share the operand-decode tables and the summation-order contract stated here.
#include "kernels/gemm/gemm.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kernels/core/formats.h"
#include "kernels/gemm/gemm_internal.h"
#include "kernels/quantize/nvfp4_rules.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

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

// ---- exact element decodes (kernels/core/formats.h, shared bit for bit with the CUDA kernels)
// ----

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

// ---- CPU reference: packed operands, register tiles, the same per-element order ----
//
// Both operands are packed once per call into panels (docs/design.md section 21): A's canonical
// matrix [R, K] into panels of kMr rows, element (i, k) of panel p at [k * kMr + i]; B's [S, K]
// into panels of kNr rows. Packing decodes every element exactly to fp32 (a 256-entry table per
// FP8 format times the copy's scale: the exact power of two 2^(e-127) for MXFP8, the fp32
// scale_inv otherwise) and performs the transposes the role needs, so the micro-kernel reads
// contiguous fp32 only. A kMr x kNr tile of C is held in registers; K is cut into kKc-long
// blocks so that a B panel stays in L1 and an A block in L2. The tile is stored back between
// K blocks and reloaded, which changes no bit: each c[i][j] is still +0.0f plus a[i][k] * b[j][k]
// (multiply rounded, then add rounded, never fused) for k = 0, 1, ..., K-1 in order, exactly the
// sum of the previous "i-k-j" loop. The tile shape, the vector width, the K blocking and the ISA
// therefore never change the result.

constexpr int kMr = 6;        // rows of A per micro-tile
constexpr int kNr = 16;       // rows of B (columns of C) per micro-tile: two 8-lane vectors
constexpr int64_t kKc = 256;  // K block: a B panel slice is kKc * kNr * 4 = 16 KiB (L1)
constexpr int64_t kMc = 96;   // rows of A per block: kMc * kKc * 4 = 96 KiB (L2)
static_assert(kMc % kMr == 0);

// Exact fp32 value of every FP8 code (NaN codes decode to the format's NaN, as formats.h does).
struct Fp8Table {
  float v[256];
};
Fp8Table make_fp8_table(DType format) {
  Fp8Table t{};
  for (int b = 0; b < 256; ++b) t.v[b] = decode_fp8(format, static_cast<uint8_t>(b));
  return t;
}
}  // namespace

namespace detail {
const float* fp8_decode_table(DType format) {
  static const Fp8Table e4m3 = make_fp8_table(DType::kE4M3);
  static const Fp8Table e5m2 = make_fp8_table(DType::kE5M2);
  return format == DType::kE4M3 ? e4m3.v : e5m2.v;
}

const float* e8m0_pow2_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int e = 0; e < 255; ++e)
      t[e] = e == 0 ? fmt8::bits_float(0x00400000u) : fmt8::bits_float(uint32_t(e) << 23);
    t[255] = std::numeric_limits<float>::quiet_NaN();
    return t;
  }();
  return table.data();
}
}  // namespace detail

namespace {

using detail::e8m0_pow2_table;
const float* fp8_table(DType format) { return detail::fp8_decode_table(format); }

// One stored matrix (`rows` x `cols`, row-major) of an operand and how to decode it.
struct StoredView {
  enum class Kind : uint8_t { kF32, kBf16, kPerTensor, kMxfp8Row, kMxfp8Col, kBlock, kNvfp4 };
  Kind kind = Kind::kF32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  const float* table = nullptr;  // FP8 decode table
  float scale = 0.0f;            // per-tensor scale_inv
  const uint8_t* e8 = nullptr;   // MXFP8 scales
  const float* block = nullptr;  // block scales
  int64_t scols = 0;             // columns of the scale matrix
  int64_t rdiv = 1;              // block rows (1 or 128)
  float gds = 0.0f;              // NVFP4 global decode scale (e4m3 block codes in e8)
  bool canonical = true;         // stored = canonical [n, K]; else stored = canonical^T
};

StoredView stored_view(const GemmSide& side) {
  StoredView v;
  if (const auto* tp = std::get_if<const Tensor*>(&side.op)) {
    const Tensor& t = **tp;
    v.kind = t.dtype() == DType::kFloat32 ? StoredView::Kind::kF32 : StoredView::Kind::kBf16;
    v.data = t.raw_data();
    v.rows = t.shape().leading();
    v.cols = t.shape().last();
    v.canonical = !side.transposed;
    return v;
  }
  const QuantizedTensor& q = *std::get<const QuantizedTensor*>(side.op);
  const Tensor& data = side.transposed ? q.columnwise_data : q.rowwise_data;
  const Tensor& sinv = side.transposed ? q.columnwise_scale_inv : q.rowwise_scale_inv;
  v.data = data.raw_data();
  v.rows = data.shape().leading();
  v.cols = data.shape().last();
  v.table = fp8_table(q.format);
  // Per-tensor and block columnwise copies are stored transposed already (= canonical); the
  // MXFP8 columnwise copy is stored in the logical layout and transposed while packing.
  v.canonical = !(side.transposed && q.mode == ScalingMode::kMxfp8);
  switch (q.mode) {
    case ScalingMode::kDelayedTensor:
    case ScalingMode::kCurrentTensor:
      v.kind = StoredView::Kind::kPerTensor;
      v.scale = *sinv.data<float>();
      break;
    case ScalingMode::kMxfp8:
      v.kind = side.transposed ? StoredView::Kind::kMxfp8Col : StoredView::Kind::kMxfp8Row;
      v.e8 = static_cast<const uint8_t*>(sinv.raw_data());
      v.scols = sinv.shape()[1];
      break;
    case ScalingMode::kBlock1x128:
    case ScalingMode::kBlock128x128:
      v.kind = StoredView::Kind::kBlock;
      v.block = sinv.data<float>();
      v.scols = sinv.shape()[1];
      v.rdiv = q.mode == ScalingMode::kBlock1x128 ? 1 : 128;
      break;
    case ScalingMode::kNvfp4: {
      // Both copies are stored K-major (rowwise [M, K], columnwise the transpose), packed two
      // codes per byte; the block codes sit where MXFP8's e8m0 scales do.
      namespace nv = rules::nvfp4;
      const Tensor& amax = side.transposed ? q.columnwise_amax : q.amax;
      v.kind = StoredView::Kind::kNvfp4;
      v.e8 = static_cast<const uint8_t*>(sinv.raw_data());
      v.scols = sinv.shape()[1];
      v.gds = nv::global_decode_scale(nv::global_encode_scale(*amax.data<float>()));
      break;
    }
  }
  return v;
}

// Decodes stored row `r` (all `cols` elements) to fp32: the exact values of the previous decode
// (fp32 copied, bf16 widened, fp8 value times the fp32 scale_inv, fp8 value times 2^(e-127)).
void decode_stored_row(const StoredView& v, int64_t r, float* out) {
  const int64_t n = v.cols;
  const auto* codes = static_cast<const uint8_t*>(v.data) + r * n;
  switch (v.kind) {
    case StoredView::Kind::kF32:
      std::memcpy(out, static_cast<const float*>(v.data) + r * n, static_cast<size_t>(n) * 4);
      return;
    case StoredView::Kind::kBf16: {
      const auto* h = static_cast<const uint16_t*>(v.data) + r * n;
      for (int64_t c = 0; c < n; ++c) out[c] = fmt8::bf16_to_float(h[c]);
      return;
    }
    case StoredView::Kind::kPerTensor: {
      const float s = v.scale;
      for (int64_t c = 0; c < n; ++c) out[c] = v.table[codes[c]] * s;
      return;
    }
    case StoredView::Kind::kMxfp8Row:
    case StoredView::Kind::kMxfp8Col: {
      // Row r's scales: one per 32 columns (rowwise copy) or one per column (columnwise copy).
      const bool row_blocks = v.kind == StoredView::Kind::kMxfp8Row;
      const uint8_t* e = row_blocks ? v.e8 + r * v.scols : v.e8 + (r / 32) * v.scols;
      const float* p2 = e8m0_pow2_table();
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int64_t c = 0; c < n; ++c) {
        const uint8_t ec = row_blocks ? e[c / 32] : e[c];
        out[c] = ec == 0xFF ? nan : v.table[codes[c]] * p2[ec];
      }
      return;
    }
    case StoredView::Kind::kBlock: {
      const float* s = v.block + (r / v.rdiv) * v.scols;
      for (int64_t c = 0; c < n; ++c) out[c] = v.table[codes[c]] * s[c / 128];
      return;
    }
    case StoredView::Kind::kNvfp4: {
      // The quantizer's decode (kernels/quantize/nvfp4_rules.h): fp32(fp32(e2m1 * dec) * gds).
      const auto* packed = static_cast<const uint8_t*>(v.data) + r * n / 2;
      const uint8_t* dec = v.e8 + r * v.scols;
      // rules::nvfp4::decode per element, its block's scale decoded once per 16 elements.
      for (int64_t c0 = 0; c0 < n; c0 += 16) {
        const float d = fmt8::e4m3_to_float(dec[c0 / 16]);
        for (int64_t c = c0; c < std::min(n, c0 + 16); ++c) {
          const uint8_t b = packed[c / 2];
          const auto code = static_cast<uint8_t>((c & 1) ? b >> 4 : b & 0xFu);
          out[c] = (fmt8::e2m1_to_float(code) * d) * v.gds;
        }
      }
      return;
    }
  }
}

// Per-thread scratch reused across calls (virtual ranks are threads): no malloc, page faults or
// zeroing per GEMM. Buffers above kKeepFloats are released after the call.
class Scratch {
 public:
  float* get(size_t n) {
    if (n > cap_) {
      buf_.reset(new float[n]);
      cap_ = n;
    }
    return buf_.get();
  }
  void trim() {
    if (cap_ > kKeepFloats) {
      buf_.reset();
      cap_ = 0;
    }
  }

 private:
  static constexpr size_t kKeepFloats = size_t{8} << 20;  // 32 MiB
  std::unique_ptr<float[]> buf_;
  size_t cap_ = 0;
};

// Stored row `r` of `v` in fp32: an fp32 row in place, any other decoded into `row`.
const float* stored_row(const StoredView& v, int64_t r, float* row) {
  if (v.kind == StoredView::Kind::kF32) return static_cast<const float*>(v.data) + r * v.cols;
  decode_stored_row(v, r, row);
  return row;
}

#if defined(__x86_64__) || defined(__i386__)
// dst[j * ldd + i] = src[i][k + j] for i, j < 8: an 8 x 8 block of fp32 transposed in registers
// (pure data movement: the same bits as the scalar loop).
__attribute__((target("avx2"))) void transpose_8x8(const float* const* src, int64_t k, float* dst,
                                                   int64_t ldd) {
  const __m256 r0 = _mm256_loadu_ps(src[0] + k), r1 = _mm256_loadu_ps(src[1] + k);
  const __m256 r2 = _mm256_loadu_ps(src[2] + k), r3 = _mm256_loadu_ps(src[3] + k);
  const __m256 r4 = _mm256_loadu_ps(src[4] + k), r5 = _mm256_loadu_ps(src[5] + k);
  const __m256 r6 = _mm256_loadu_ps(src[6] + k), r7 = _mm256_loadu_ps(src[7] + k);
  // Pairs of rows interleaved, then pairs of pairs: lane l of 128-bit half h of u_c holds row
  // 4 h' + l's column ... (the standard unpack / shuffle / permute2f128 transpose).
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * ldd, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

// Packs the canonical matrix [n, K] of `v` into panels of `w` rows (rows >= n zero): panel p
// starts at dst + p * K * w and holds element (p * w + i, k) at [k * w + i]. `avx2`: full panels
// of a multiple of 8 rows are transposed in 8 x 8 register blocks (the AVX2 GEMM kernel's packing;
// the portable kernel's is the scalar loop, so forcing it tests that loop).
void pack_panels(const StoredView& v, int64_t n, int64_t K, int w, float* dst, float* row,
                 bool avx2) {
  const int64_t panels = (n + w - 1) / w;
  if (v.canonical) {  // stored [n, K]: a transpose, the panel written in order
    // `row` holds w decoded rows ([w, K]); an fp32 row is read in place. Reading the panel's w
    // rows column by column (w read streams) writes the panel contiguously; a row at a time wrote
    // one float per cache line across the whole panel (K * w * 4 bytes: 64 KiB at K = 1024), which
    // made this pack most of the driver's time when a virtual rank multiplies few rows by a whole
    // weight.
    const float* src[kNr > kMr ? kNr : kMr];
    MP_CHECK(w > 0 && w <= static_cast<int>(std::size(src)), "gemm: panels of {} rows (at most {})",
             w, std::size(src));
    for (int64_t p = 0; p < panels; ++p) {
      float* panel = dst + p * K * w;
      const int live = static_cast<int>(std::min<int64_t>(w, n - p * w));
      for (int i = 0; i < live; ++i) src[i] = stored_row(v, p * w + i, row + i * K);
      int64_t k = 0;
#if defined(__x86_64__) || defined(__i386__)
      if (avx2 && live == w && w % 8 == 0)
        for (; k + 8 <= K; k += 8)
          for (int h = 0; h < w; h += 8) transpose_8x8(src + h, k, panel + k * w + h, w);
#else
      (void)avx2;
#endif
      for (; k < K; ++k) {
        float* dk = panel + k * w;
        for (int i = 0; i < live; ++i) dk[i] = src[i][k];
        for (int i = live; i < w; ++i) dk[i] = 0.0f;
      }
    }
    return;
  }
  // stored [K, n]: stored row k is column k of the canonical matrix, contiguous in every panel
  for (int64_t k = 0; k < K; ++k) {
    const float* src = stored_row(v, k, row);
    for (int64_t p = 0; p < panels; ++p) {
      float* dk = dst + p * K * w + k * w;
      const int64_t r0 = p * w;
      const int64_t m = std::min<int64_t>(w, n - r0);
      std::memcpy(dk, src + r0, static_cast<size_t>(m) * 4);
      for (int64_t i = m; i < w; ++i) dk[i] = 0.0f;
    }
  }
}

// The micro-kernel's A operand: element (i, k) of the tile at p[i * is + k * ks]. A packed panel
// has is = 1, ks = kMr and zero rows past the matrix; an fp32 operand read in place (canonical,
// stored [n, K]) has is = K, ks = 1, and `rows` < kMr on its last tile: the rows past it read row
// rows - 1 instead (in bounds; their results are never stored).
struct ATile {
  const float* p;
  int64_t is, ks;
  int rows;
};

// c[kMr][kNr] (row stride ldc) = (load_c ? c : +0.0f) + sum over k < kc, in order, of
// a(i, k) * b[k * kNr + j]. kSwapped: the kernel computes C^T (its A operand is the GEMM's B and
// its B panel the GEMM's A), and every product is formed as b * a so that each one is still the
// GEMM's A element times its B element, operands in that order (which NaN an x86 multiply of two
// NaNs returns depends on the order, section 21). Portable kernel: GCC/Clang 4-lane vector
// extensions (SSE2 on any x86-64, NEON on aarch64), lane-wise IEEE multiply then add, the same
// order in every lane.
using V4 = float __attribute__((vector_size(16)));

V4 load4(const float* p) {
  V4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
void store4(float* p, V4 v) { std::memcpy(p, &v, sizeof(v)); }

template <bool kSwapped>
void micro_kernel_portable(int64_t kc, const ATile& a, const float* b, float* c, int64_t ldc,
                           bool load_c) {
  constexpr int kV = kNr / 4;
  const float* ar[kMr];
  for (int i = 0; i < kMr; ++i) ar[i] = a.p + std::min(i, a.rows - 1) * a.is;
  V4 acc[kMr][kV];
  for (int i = 0; i < kMr; ++i)
    for (int v = 0; v < kV; ++v) acc[i][v] = load_c ? load4(c + i * ldc + 4 * v) : V4{};
  for (int64_t k = 0; k < kc; ++k) {
    V4 bv[kV];
    for (int v = 0; v < kV; ++v) bv[v] = load4(b + k * kNr + 4 * v);
    for (int i = 0; i < kMr; ++i) {
      const float ai = ar[i][k * a.ks];
      const V4 av = {ai, ai, ai, ai};
      for (int v = 0; v < kV; ++v) acc[i][v] = acc[i][v] + (kSwapped ? bv[v] * av : av * bv[v]);
    }
  }
  for (int i = 0; i < kMr; ++i)
    for (int v = 0; v < kV; ++v) store4(c + i * ldc + 4 * v, acc[i][v]);
}

#if defined(__x86_64__) || defined(__i386__)
#define MESHPROOF_GEMM_AVX2 1
// AVX2: 12 accumulators (6 rows x 2 vectors of 8) + 2 B vectors + 1 broadcast + 1 product = 16
// ymm registers. Explicit mul then add (the avx2 target has no FMA and the kernels are compiled
// with -ffp-contract=off, so nothing is fused).
template <bool kSwapped>
__attribute__((target("avx2"))) inline __m256 product(__m256 av, __m256 bv) {
  return kSwapped ? _mm256_mul_ps(bv, av) : _mm256_mul_ps(av, bv);
}

template <bool kSwapped>
__attribute__((target("avx2"))) void micro_kernel_avx2(int64_t kc, const ATile& a, const float* b,
                                                       float* c, int64_t ldc, bool load_c) {
  const float* a0 = a.p;
  const float* a1 = a.p + std::min(1, a.rows - 1) * a.is;
  const float* a2 = a.p + std::min(2, a.rows - 1) * a.is;
  const float* a3 = a.p + std::min(3, a.rows - 1) * a.is;
  const float* a4 = a.p + std::min(4, a.rows - 1) * a.is;
  const float* a5 = a.p + std::min(5, a.rows - 1) * a.is;
  const int64_t ks = a.ks;
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  if (load_c) {
    c00 = _mm256_loadu_ps(c + 0 * ldc), c01 = _mm256_loadu_ps(c + 0 * ldc + 8);
    c10 = _mm256_loadu_ps(c + 1 * ldc), c11 = _mm256_loadu_ps(c + 1 * ldc + 8);
    c20 = _mm256_loadu_ps(c + 2 * ldc), c21 = _mm256_loadu_ps(c + 2 * ldc + 8);
    c30 = _mm256_loadu_ps(c + 3 * ldc), c31 = _mm256_loadu_ps(c + 3 * ldc + 8);
    c40 = _mm256_loadu_ps(c + 4 * ldc), c41 = _mm256_loadu_ps(c + 4 * ldc + 8);
    c50 = _mm256_loadu_ps(c + 5 * ldc), c51 = _mm256_loadu_ps(c + 5 * ldc + 8);
  } else {
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
  }
  for (int64_t k = 0, off = 0; k < kc; ++k, off += ks) {
    const __m256 b0 = _mm256_loadu_ps(b);
    const __m256 b1 = _mm256_loadu_ps(b + 8);
    __m256 av = _mm256_broadcast_ss(a0 + off);
    c00 = _mm256_add_ps(c00, product<kSwapped>(av, b0));
    c01 = _mm256_add_ps(c01, product<kSwapped>(av, b1));
    av = _mm256_broadcast_ss(a1 + off);
    c10 = _mm256_add_ps(c10, product<kSwapped>(av, b0));
    c11 = _mm256_add_ps(c11, product<kSwapped>(av, b1));
    av = _mm256_broadcast_ss(a2 + off);
    c20 = _mm256_add_ps(c20, product<kSwapped>(av, b0));
    c21 = _mm256_add_ps(c21, product<kSwapped>(av, b1));
    av = _mm256_broadcast_ss(a3 + off);
    c30 = _mm256_add_ps(c30, product<kSwapped>(av, b0));
    c31 = _mm256_add_ps(c31, product<kSwapped>(av, b1));
    av = _mm256_broadcast_ss(a4 + off);
    c40 = _mm256_add_ps(c40, product<kSwapped>(av, b0));
    c41 = _mm256_add_ps(c41, product<kSwapped>(av, b1));
    av = _mm256_broadcast_ss(a5 + off);
    c50 = _mm256_add_ps(c50, product<kSwapped>(av, b0));
    c51 = _mm256_add_ps(c51, product<kSwapped>(av, b1));
    b += kNr;
  }
  _mm256_storeu_ps(c + 0 * ldc, c00), _mm256_storeu_ps(c + 0 * ldc + 8, c01);
  _mm256_storeu_ps(c + 1 * ldc, c10), _mm256_storeu_ps(c + 1 * ldc + 8, c11);
  _mm256_storeu_ps(c + 2 * ldc, c20), _mm256_storeu_ps(c + 2 * ldc + 8, c21);
  _mm256_storeu_ps(c + 3 * ldc, c30), _mm256_storeu_ps(c + 3 * ldc + 8, c31);
  _mm256_storeu_ps(c + 4 * ldc, c40), _mm256_storeu_ps(c + 4 * ldc + 8, c41);
  _mm256_storeu_ps(c + 5 * ldc, c50), _mm256_storeu_ps(c + 5 * ldc + 8, c51);
}
#else
#define MESHPROOF_GEMM_AVX2 0
#endif

using MicroKernel = void (*)(int64_t, const ATile&, const float*, float*, int64_t, bool);

std::atomic<detail::CpuGemmKernel> g_forced_kernel{detail::CpuGemmKernel::kAuto};

bool cpu_has_avx2() {
#if MESHPROOF_GEMM_AVX2
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
#else
  return false;
#endif
}

MicroKernel select_kernel(bool swapped) {
  const detail::CpuGemmKernel k = detail::cpu_gemm_kernel();
#if MESHPROOF_GEMM_AVX2
  if (k == detail::CpuGemmKernel::kAvx2)
    return swapped ? micro_kernel_avx2<true> : micro_kernel_avx2<false>;
#endif
  (void)k;
  return swapped ? micro_kernel_portable<true> : micro_kernel_portable<false>;
}

// The A operand of gemm_packed: packed kMr-row panels (pack_panels), or an fp32 matrix read in
// place, stored [R, K] (canonical) or [K, R] (k_major: the transposed weight of a dgrad).
struct ASource {
  const float* data;
  bool panels;
  bool k_major = false;
  ATile tile(int64_t ip, int64_t k0, int64_t R, int64_t K) const {
    if (panels) return {data + ip * K * kMr + k0 * kMr, 1, kMr, kMr};
    const int64_t i0 = ip * kMr;
    const int rows = static_cast<int>(std::min<int64_t>(kMr, R - i0));
    if (k_major) return {data + k0 * R + i0, 1, R, rows};
    return {data + i0 * K + k0, K, 1, rows};
  }
};

// c[R, S] (row stride S) = A · B^T from A (panels or in place) and B's packed panels, every
// element summed in k order. `swapped`: A and B are the GEMM's B and A (c is C^T).
void gemm_packed(const ASource& a, const float* bpack, float* c, int64_t R, int64_t S, int64_t K,
                 bool swapped) {
  if (K == 0) {  // an empty sum is +0
    std::fill_n(c, R * S, 0.0f);
    return;
  }
  const MicroKernel kernel = select_kernel(swapped);
  const int64_t a_panels = (R + kMr - 1) / kMr;
  const int64_t b_panels = (S + kNr - 1) / kNr;
  float edge[kMr * kNr];
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t kc = std::min(kKc, K - k0);
    const bool load_c = k0 > 0;
    for (int64_t ib = 0; ib < a_panels; ib += kMc / kMr) {
      const int64_t ie = std::min(a_panels, ib + kMc / kMr);
      for (int64_t jp = 0; jp < b_panels; ++jp) {
        const float* bp = bpack + jp * K * kNr + k0 * kNr;
        const int64_t j0 = jp * kNr;
        const int64_t cols = std::min<int64_t>(kNr, S - j0);
        for (int64_t ip = ib; ip < ie; ++ip) {
          const ATile at = a.tile(ip, k0, R, K);
          const int64_t i0 = ip * kMr;
          const int64_t rows = std::min<int64_t>(kMr, R - i0);
          float* ct = c + i0 * S + j0;
          if (rows == kMr && cols == kNr) {
            kernel(kc, at, bp, ct, S, load_c);
            continue;
          }
          // Edge tile: through a full-size local tile; only the valid part is read and written.
          if (load_c)
            for (int64_t i = 0; i < rows; ++i) std::memcpy(edge + i * kNr, ct + i * S, cols * 4);
          kernel(kc, at, bp, edge, kNr, load_c);
          for (int64_t i = 0; i < rows; ++i) std::memcpy(ct + i * S, edge + i * kNr, cols * 4);
        }
      }
    }
  }
}

// Packing costs about one pass over the packed matrix, so with few rows of A (a virtual rank's
// share of the batch) packing B, the whole weight, costs more than the product. Two plans, the
// same bits (every element is the same k-ordered sum of the same A x B products):
//  - plain: the kernel's A is the GEMM's A (read in place when it is a canonical fp32 matrix,
//    packed otherwise) and its B panels are the GEMM's B, packed;
//  - swapped: C^T = B · A^T; the kernel reads the GEMM's B in place (an fp32 matrix, stored
//    canonical or transposed: a dgrad's weight), packs the GEMM's A into B panels, and C^T is
//    transposed into the output.
// The cheaper one by elements moved runs: packing a matrix, transposing C^T, and streaming B
// again for every kNr rows of A beyond the first in the swapped plan (its kernel walks the whole
// of B, read in place, once per packed panel of A; the plain plan streams its packed B once per
// kMc rows of A). Without that last term the swapped plan also ran at 32-128
// rows, where the whole 8-rank run took 2-5% more CPU than with the plain plan (`perf stat`
// task-clock, dp_shard 8 at hidden 128 and 256, two interleaved repetitions each, 2026-11-25; at
// hidden 64 the two were within noise); with it, it runs at 16 rows or fewer. The plain plan reads
// only a canonical A in place: a transposed A (a wgrad's output gradient) is packed, so that the
// kernel's A reads stay contiguous where A is large.
bool in_place(const StoredView& v) { return v.kind == StoredView::Kind::kF32 && v.canonical; }
bool in_place_swapped(const StoredView& v) { return v.kind == StoredView::Kind::kF32; }

bool swap_operands(const StoredView& a, const StoredView& b, int64_t R, int64_t S, int64_t K) {
  if (!in_place_swapped(b)) return false;
  const int64_t plain = (in_place(a) ? 0 : R * K) + S * K;
  const int64_t restreams = (R + kNr - 1) / kNr - 1;
  const int64_t swapped = R * K + R * S + restreams * S * K;
  return swapped < plain;
}

void gemm_cpu(const GemmProblem& p, Tensor& out, const GemmOptions& options) {
  const int64_t R = p.r, S = p.s, K = p.k;
  thread_local Scratch a_buf, b_buf, c_buf, row_buf;
  const StoredView av = stored_view(p.a);
  const StoredView bv = stored_view(p.b);
  const bool swap = swap_operands(av, bv, R, S, K);
  const bool avx2 = detail::cpu_gemm_kernel() == detail::CpuGemmKernel::kAvx2;
  // The kernel's operands: x (its A, xr rows) and y (its B panels, yr rows).
  const StoredView& x = swap ? bv : av;
  const StoredView& y = swap ? av : bv;
  const int64_t xr = swap ? S : R, yr = swap ? R : S;
  // Room for kNr decoded rows (pack_panels of a canonical operand decodes a panel's rows at once).
  float* row = row_buf.get(static_cast<size_t>(kNr * std::max({av.cols, bv.cols, int64_t{1}})));
  ASource asrc{static_cast<const float*>(x.data), true};
  if (swap || in_place(x)) {  // swapped: x is the GEMM's fp32 B (swap_operands)
    asrc.panels = false;
    asrc.k_major = !x.canonical;
  } else {
    float* apack = a_buf.get(static_cast<size_t>((xr + kMr - 1) / kMr * kMr * K + 1));
    pack_panels(x, xr, K, kMr, apack, row, avx2);
    asrc.data = apack;
  }
  float* bpack = b_buf.get(static_cast<size_t>((yr + kNr - 1) / kNr * kNr * K + 1));
  pack_panels(y, yr, K, kNr, bpack, row, avx2);
  const size_t n = static_cast<size_t>(R * S);
  const bool direct = !swap && out.dtype() == DType::kFloat32 && !options.accumulate;
  float* c = direct ? out.data<float>() : c_buf.get(n);  // [R, S], or C^T [S, R] when swapped
  gemm_packed(asrc, bpack, c, xr, yr, K, swap);
  // Element (i, j) of C, row by row.
  const auto for_each_c = [&](auto&& f) {
    if (!swap) {
      for (size_t i = 0; i < n; ++i) f(i, c[i]);
      return;
    }
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < S; ++j) f(static_cast<size_t>(i * S + j), c[j * R + i]);
  };
  if (out.dtype() == DType::kFloat32) {
    float* o = out.data<float>();
    if (options.accumulate) {
      for_each_c([o](size_t i, float v) { o[i] += v; });
    } else if (!direct) {
      for_each_c([o](size_t i, float v) { o[i] = v; });
    }
  } else {
    auto* o = static_cast<uint16_t*>(out.raw_data());
    // round to nearest even
    for_each_c([o](size_t i, float v) { o[i] = fmt8::float_to_bf16(v); });
  }
  for (Scratch* s : {&a_buf, &b_buf, &c_buf, &row_buf}) s->trim();
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

namespace detail {

bool cpu_gemm_kernel_available(CpuGemmKernel k) {
  return k != CpuGemmKernel::kAvx2 || cpu_has_avx2();
}

void set_cpu_gemm_kernel(CpuGemmKernel k) {
  MP_CHECK_INPUT(cpu_gemm_kernel_available(k), "gemm: this CPU has no AVX2 for the AVX2 kernel");
  g_forced_kernel.store(k);
}

CpuGemmKernel cpu_gemm_kernel() {
  const CpuGemmKernel k = g_forced_kernel.load();
  if (k != CpuGemmKernel::kAuto) return k;
  return cpu_has_avx2() ? CpuGemmKernel::kAvx2 : CpuGemmKernel::kPortable;
}

}  // namespace detail

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
