// CUDA backend of the GEMM family (host side; compiled only with the CUDA backend; the device
// kernels are in gemm.cu): cuBLASLt for fp32/bf16, per-tensor FP8 (TN form) and native
// MXFP8 (compute capability 10.x); exact emulation (device dequantize + high-precision cuBLASLt
// GEMM) for everything else. Validation happened in gemm.cc; here the problem is well formed.
//
// Row-major vs column-major (the classic source of bugs). We compute, row-major,
//   C[R,S] = A[R,K] . B[S,K]^T          (gemm_internal.h: A, B "K-major" = canonical)
// cuBLASLt is column-major. A row-major [R,S] buffer is the column-major S x R matrix C^T, and
//   C^T[S,R] = B[S,K] . A[R,K]^T
// so cuBLASLt computes D(m x n) = op(Acb)(m x k) . op(Bcb)(k x n) with m = S, n = R, k = K,
//   Acb = OUR B: row-major [S,K] is column-major K x S (ld K); op T gives S x K.     ("T")
//               row-major [K,S] (B stored transposed) is column-major S x K (ld S); op N.
//   Bcb = OUR A: row-major [R,K] is column-major K x R (ld K); op N gives K x R.     ("N")
//               row-major [K,R] (A stored transposed) is column-major R x K (ld R); op T.
//   D   = row-major [R,S] = column-major S x R, ld S.
// With both operands K-major this is cuBLAS's "TN" form, the only one per-tensor FP8 GEMMs take
// on Hopper; so the FP8 paths always feed K-major copies (the rowwise copy for an operand used as
// is, the stored transpose (columnwise copy) for one used transposed), and Acb's scale is OUR B's
// scale_inv, Bcb's is OUR A's.
#if MESHPROOF_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "kernels/cuda_check.h"
#include "kernels/device.h"
#include "kernels/gemm_cuda_kernels.h"
#include "kernels/gemm_internal.h"
#include "kernels/nvfp4.h"

namespace meshproof::kernels::detail {
namespace {

// ---- cuBLASLt handle and workspace, one per (device, stream), created on first use ----

constexpr size_t kWorkspaceBytes = 32u << 20;  // 32 MiB

struct LtContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // kWorkspaceBytes on the device; process lifetime (never freed)
};

// The cache lives for the process: handles and workspaces are reused by every GEMM on that
// (device, stream) pair, and GEMMs on one stream are serialised by the stream, so sharing the
// workspace is safe. (Not tracked by the rank's MemoryTracker: it is per stream, not per tensor.)
LtContext& lt_context(int device, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, LtContext> cache;
  std::lock_guard<std::mutex> lock(mu);
  LtContext& ctx = cache[{device, stream}];
  if (ctx.handle == nullptr) {
    MP_CUBLAS_CHECK(cublasLtCreate(&ctx.handle));
    MP_CUDA_CHECK(cudaMalloc(&ctx.workspace, kWorkspaceBytes));
  }
  return ctx;
}

// Makes `device` current for the scope.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    MP_CUDA_CHECK(cudaGetDevice(&saved_));
    if (saved_ != device) MP_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceScope() { cudaSetDevice(saved_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int saved_ = 0;
};

// RAII for the cuBLASLt descriptors of one call.
struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::kFloat32:
      return CUDA_R_32F;
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kE4M3:
      return CUDA_R_8F_E4M3;
    case DType::kE5M2:
      return CUDA_R_8F_E5M2;
    default:
      MP_FAIL("gemm: no cuBLASLt type for {}", dtype_name(d));
  }
}

// One operand as cuBLASLt sees it (in OUR terms: side A or B of C = A.B^T).
struct LtOperand {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  bool k_major = true;          // row-major [rows, K] (else row-major [K, rows])
  const void* scale = nullptr;  // device scale pointer (FP8 paths), else nullptr
  cublasLtMatmulMatrixScale_t scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
};

// D[R,S] (row-major) = A . B^T (+ D when accumulate), fp32 accumulation (CUBLAS_COMPUTE_32F: no
// TF32 for fp32 inputs).
void lt_matmul(const GemmProblem& p, const LtOperand& a, const LtOperand& b, Tensor& out,
               const GemmOptions& options, bool fast_accum) {
  const int device = out.device().index;
  DeviceScope scope(device);
  auto stream = static_cast<cudaStream_t>(current_context().stream);
  LtContext& lt = lt_context(device, stream);
  const uint64_t m = static_cast<uint64_t>(p.s), n = static_cast<uint64_t>(p.r),
                 k = static_cast<uint64_t>(p.k);
  LtDescs d;
  MP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Acb = our B, Bcb = our A (see the header comment).
  const cublasOperation_t opa = b.k_major ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = a.k_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  MP_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  MP_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  if (b.scale != nullptr) {
    MP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                   &b.scale, sizeof(b.scale)));
    MP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                   &b.scale_mode, sizeof(b.scale_mode)));
  }
  if (a.scale != nullptr) {
    MP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                   &a.scale, sizeof(a.scale)));
    MP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                   &a.scale_mode, sizeof(a.scale_mode)));
  }
  if (is_fp8(a.dtype)) {
    const int8_t fast = fast_accum ? 1 : 0;
    MP_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  }
  // Layouts: Acb is (rows x cols, ld) column-major as stored (before op).
  MP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, cuda_type(b.dtype), b.k_major ? k : m,
                                             b.k_major ? m : k, b.k_major ? k : m));
  MP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, cuda_type(a.dtype), a.k_major ? k : n,
                                             a.k_major ? n : k, a.k_major ? k : n));
  MP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, cuda_type(out.dtype()), m, n, m));
  MP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.pref));
  const uint64_t ws = kWorkspaceBytes;
  MP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  MP_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt.handle, d.op, d.a, d.b, d.c, d.c, d.pref, 1,
                                                 &heur, &found));
  MP_CHECK(found > 0,
           "gemm_{}: cuBLASLt has no algorithm for A {} x B {} -> {} with [R,S,K] = [{}, {}, {}] "
           "(op {}{})",
           gemm_role_name(p.role), dtype_name(a.dtype), dtype_name(b.dtype),
           dtype_name(out.dtype()), p.r, p.s, p.k, opa == CUBLAS_OP_T ? 'T' : 'N',
           opb == CUBLAS_OP_T ? 'T' : 'N');
  const float alpha = 1.0f;
  const float beta = options.accumulate ? 1.0f : 0.0f;
  // C and D are the same buffer: with beta = 1 this is out += A.B^T.
  MP_CUBLAS_CHECK(cublasLtMatmul(lt.handle, d.op, &alpha, b.data, d.a, a.data, d.b, &beta,
                                 out.raw_data(), d.c, out.raw_data(), d.c, &heur.algo, lt.workspace,
                                 kWorkspaceBytes, stream));
}

cudaStream_t stream_now() { return static_cast<cudaStream_t>(current_context().stream); }

// ---- operand preparation ----

const Tensor& copy_data(const QuantizedTensor& q, bool transposed) {
  return transposed ? q.columnwise_data : q.rowwise_data;
}
const Tensor& copy_scale(const QuantizedTensor& q, bool transposed) {
  return transposed ? q.columnwise_scale_inv : q.rowwise_scale_inv;
}

// Whether the stored matrix of a side is K-major (its canonical form) or the transpose of it.
bool stored_k_major(const GemmSide& s) {
  if (std::holds_alternative<const Tensor*>(s.op)) return !s.transposed;
  const QuantizedTensor& q = *std::get<const QuantizedTensor*>(s.op);
  // Per-tensor/block columnwise copies are the stored transpose = canonical; MXFP8 columnwise is
  // logical [M,K] = canonical^T.
  return !(s.transposed && q.mode == ScalingMode::kMxfp8);
}

// Decodes the stored matrix of a quantized side into `scratch` (fp32 or bf16, same orientation).
LtOperand decode_side(const GemmSide& s, DType to, Tensor& scratch) {
  const QuantizedTensor& q = *std::get<const QuantizedTensor*>(s.op);
  if (q.mode == ScalingMode::kNvfp4) {
    // NVFP4: the quantizer's exact decode of the stored (K-major) copy to fp32.
    MP_CHECK(to == DType::kFloat32, "NVFP4 operands decode to float32 only");
    scratch = dequantize_nvfp4(q, !s.transposed);
    return LtOperand{scratch.raw_data(), DType::kFloat32, stored_k_major(s), nullptr,
                     CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F};
  }
  const Tensor& data = copy_data(q, s.transposed);
  const Tensor& sinv = copy_scale(q, s.transposed);
  DecodeArgs a{};
  a.codes = static_cast<const uint8_t*>(data.raw_data());
  a.rows = data.shape().leading();
  a.cols = data.shape().last();
  a.e4m3 = q.format == DType::kE4M3;
  a.mode = q.mode == ScalingMode::kMxfp8 ? DecodeScaling::kMxfp8
           : (q.mode == ScalingMode::kBlock1x128 || q.mode == ScalingMode::kBlock128x128)
               ? DecodeScaling::kBlock
               : DecodeScaling::kPerTensor;
  a.scale = sinv.raw_data();
  a.scale_cols = sinv.shape().rank() >= 2 ? sinv.shape()[1] : 1;
  a.mx_columnwise = s.transposed;
  a.block_rows = q.mode == ScalingMode::kBlock128x128 ? 128 : 1;
  scratch = Tensor::empty(Shape{a.rows, a.cols}, to, data.device());  // stored 2-D view
  if (to == DType::kFloat32) {
    MP_CUDA_CHECK(launch_decode_to_f32(a, scratch.data<float>(), stream_now()));
  } else {
    MP_CUDA_CHECK(
        launch_decode_to_bf16(a, static_cast<uint16_t*>(scratch.raw_data()), stream_now()));
  }
  return LtOperand{scratch.raw_data(), to, stored_k_major(s), nullptr,
                   CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F};
}

// A side as an fp32 operand (high-precision tensors converted, quantized ones decoded).
LtOperand f32_side(const GemmSide& s, Tensor& scratch) {
  if (const auto* t = std::get_if<const Tensor*>(&s.op)) {
    if ((*t)->dtype() == DType::kFloat32) {
      return LtOperand{(*t)->raw_data(), DType::kFloat32, !s.transposed, nullptr,
                       CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F};
    }
    const int64_t n = (*t)->numel().value;
    scratch = Tensor::empty((*t)->shape(), DType::kFloat32, (*t)->device());
    MP_CUDA_CHECK(launch_bf16_to_f32(static_cast<const uint16_t*>((*t)->raw_data()),
                                     scratch.data<float>(), n, stream_now()));
    return LtOperand{scratch.raw_data(), DType::kFloat32, !s.transposed, nullptr,
                     CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F};
  }
  return decode_side(s, DType::kFloat32, scratch);
}

int compute_capability(int device) {
  const CudaStatus& st = cuda_status();
  for (const GpuInfo& g : st.gpus) {
    if (g.index == device) return g.cc_major * 10 + g.cc_minor;
  }
  return 0;
}

const QuantizedTensor* as_quantized(const GemmSide& s) {
  const auto* q = std::get_if<const QuantizedTensor*>(&s.op);
  return q ? *q : nullptr;
}

// FP8 TN cuBLASLt kernels want 16-byte aligned leading dimensions and sizes: K (bytes of a row
// of both operands) and S (leading dimension of the output) multiples of 16, and R too.
void check_fp8_dims(const GemmProblem& p, const char* what) {
  MP_CHECK_INPUT(p.r % 16 == 0 && p.s % 16 == 0 && p.k % 16 == 0,
                 "gemm_{}: {} GEMMs on CUDA need every dimension to be a multiple of 16, got "
                 "[R, S, K] = [{}, {}, {}] (output [{}, {}], reduction {})",
                 gemm_role_name(p.role), what, p.r, p.s, p.k, p.r, p.s, p.k);
}

void check_aligned(const void* ptr, const char* what, GemmRole role) {
  MP_CHECK_INPUT(reinterpret_cast<uintptr_t>(ptr) % 16 == 0,
                 "gemm_{}: {} is not 16-byte aligned (a view at an odd offset?); FP8 cuBLASLt "
                 "GEMMs need aligned operands",
                 gemm_role_name(role), what);
}

}  // namespace

void gemm_cuda(const GemmProblem& p, Tensor& out, const GemmOptions& options) {
  const int device = out.device().index;
  DeviceScope scope(device);
  const int cc = compute_capability(device);  // e.g. 90, 100
  const QuantizedTensor* qa = as_quantized(p.a);
  const QuantizedTensor* qb = as_quantized(p.b);

  // 1. Both high precision with the same dtype: native fp32 or bf16 GEMM, no copies.
  if (!qa && !qb) {
    const Tensor& ta = *std::get<const Tensor*>(p.a.op);
    const Tensor& tb = *std::get<const Tensor*>(p.b.op);
    if (ta.dtype() == tb.dtype()) {
      lt_matmul(p, LtOperand{ta.raw_data(), ta.dtype(), !p.a.transposed},
                LtOperand{tb.raw_data(), tb.dtype(), !p.b.transposed}, out, options, false);
      return;
    }
  }

  const bool per_tensor = [&] {
    auto pt = [](const QuantizedTensor* q) {
      return q &&
             (q->mode == ScalingMode::kDelayedTensor || q->mode == ScalingMode::kCurrentTensor);
    };
    return pt(qa) && pt(qb);
  }();
  const bool mxfp8 = qa && qb && qa->mode == ScalingMode::kMxfp8 && qb->mode == ScalingMode::kMxfp8;
  const bool both_e5m2 = qa && qb && qa->format == DType::kE5M2 && qb->format == DType::kE5M2;

  // 2. Per-tensor FP8 (sm_89+): TN form on the K-major copies, scale_inv as the A/B scales
  //    (D = scale_a * scale_b * sum(qa * qb)). cuBLASLt has no e5m2 x e5m2 kernel.
  if (per_tensor && cc >= 89 && !both_e5m2) {
    check_fp8_dims(p, "per-tensor FP8");
    const Tensor& da = copy_data(*qa, p.a.transposed);
    const Tensor& db = copy_data(*qb, p.b.transposed);
    check_aligned(da.raw_data(), p.a.name, p.role);
    check_aligned(db.raw_data(), p.b.name, p.role);
    LtOperand a{da.raw_data(), qa->format, true, copy_scale(*qa, p.a.transposed).raw_data(),
                CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F};
    LtOperand b{db.raw_data(), qb->format, true, copy_scale(*qb, p.b.transposed).raw_data(),
                CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F};
    lt_matmul(p, a, b, out, options, options.fast_accumulation);
    return;
  }

  // 3. MXFP8 native on compute capability 10.x: TN form again. A columnwise MXFP8 copy is the
  //    logical [M,K] matrix with 32x1 blocks, i.e. the transpose of the K-major operand, so it is
  //    transposed on the device (bytes, lossless) and its scales are read transposed. The scales
  //    are padded and swizzled into cuBLASLt's 128x4 tiles.
  if (mxfp8 && cc >= 100 && cc < 110 && !both_e5m2) {
    check_fp8_dims(p, "MXFP8");
    Tensor tdata[2], swz[2];
    LtOperand ops[2];
    const GemmSide* sides[2] = {&p.a, &p.b};
    const QuantizedTensor* qs[2] = {qa, qb};
    for (int i = 0; i < 2; ++i) {
      const GemmSide& s = *sides[i];
      const QuantizedTensor& q = *qs[i];
      const Tensor& data = copy_data(q, s.transposed);
      const Tensor& sinv = copy_scale(q, s.transposed);
      const int64_t rows = i == 0 ? p.r : p.s;  // non-reduction length of this operand
      const void* kmajor = data.raw_data();
      // Scale matrix S[r, c], r < rows, c < K/32.
      int64_t stride_r = 0, stride_c = 0;
      if (!s.transposed) {  // rowwise: data [rows, K], scales [rows, K/32]
        stride_r = p.k / 32;
        stride_c = 1;
      } else {  // columnwise: data [K, rows] (logical), scales [K/32, rows]
        tdata[i] = Tensor::empty(Shape{rows, p.k}, q.format, data.device());
        MP_CUDA_CHECK(launch_transpose_u8(static_cast<const uint8_t*>(data.raw_data()),
                                          static_cast<uint8_t*>(tdata[i].raw_data()), p.k, rows,
                                          stream_now()));
        kmajor = tdata[i].raw_data();
        stride_r = 1;
        stride_c = rows;
      }
      const int64_t cols = p.k / 32;
      swz[i] = Tensor::empty(Shape{swizzled_e8m0_bytes(rows, cols)}, DType::kE8M0, data.device());
      MP_CUDA_CHECK(launch_swizzle_e8m0(static_cast<const uint8_t*>(sinv.raw_data()), rows, cols,
                                        stride_r, stride_c,
                                        static_cast<uint8_t*>(swz[i].raw_data()), stream_now()));
      ops[i] = LtOperand{kmajor, q.format, true, swz[i].raw_data(),
                         CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0};
    }
    lt_matmul(p, ops[0], ops[1], out, options, false);
    return;
  }

  // 4. MXFP8 elsewhere: exact emulation. Each element q * 2^(e-127) has at most 4 significant
  //    bits and an exponent in bf16's range, so decoding to bf16 is lossless (except values below
  //    bf16's smallest subnormal 2^-133, which only arise with block scales below 2^-124 and are
  //    rounded to nearest even), then a bf16 GEMM with fp32 accumulation.
  if (mxfp8) {
    Tensor sa, sb;
    const LtOperand a = decode_side(p.a, DType::kBFloat16, sa);
    const LtOperand b = decode_side(p.b, DType::kBFloat16, sb);
    lt_matmul(p, a, b, out, options, false);
    return;
  }

  // Scratch tensors (decoded copies, transposes, swizzled scales) are freed with cudaFreeAsync on
  // the rank's stream, i.e. after the GEMM queued before them has run.
  // 5. Everything else (block scaling, NVFP4, per-tensor FP8 before sm_89 or e5m2 x e5m2, mixed
  //    operand kinds): decode exactly to fp32 (the CPU reference's values) and run an fp32 GEMM.
  //    NVFP4 is not sent to cuBLASLt's VEC16_UE4M3 mode (sm_100) for the same reason as block
  //    scaling below.
  //    Block scaling is not sent to cuBLASLt's VEC128/BLK128x128 modes: without a device to
  //    validate their scale layouts here, the exact emulation is the safe choice.
  Tensor sa, sb;
  const LtOperand a = f32_side(p.a, sa);
  const LtOperand b = f32_side(p.b, sb);
  lt_matmul(p, a, b, out, options, false);
}

}  // namespace meshproof::kernels::detail
#endif  // MESHPROOF_HAVE_CUDA
