// CUDA backend of the GEMM family (host side; compiled only with the CUDA backend; the device
// kernels are in gemm.cu): cuBLASLt for fp32/bf16, per-tensor FP8 (TN form), MXFP8 (cc 10.x),
// block scaling (sm_90) and NVFP4 (cc 10.x) natively; exact emulation (device dequantize +
// high-precision cuBLASLt GEMM) for everything else. The path is lt::choose_gemm_path's
// (kernels/gemm/cublaslt_plan.h), the label of every emulated figure comes from the same decision.
// Handles and workspaces are per stream (released by release_stream_resources), the heuristic's
// choice is cached per AlgoKey (docs/design.md section 31). Validation happened in gemm.cc; here
// the problem is well formed.
// Over 600 lines on purpose: one file per op family; every native path (fp32/bf16, per-tensor FP8,
// MXFP8, block, NVFP4) shares the descriptor, layout, scale-pointer and heuristic/cache helpers
// defined here, which a split would have to export from the CUDA-only part of the library.
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
#include <cstdio>
#include <mutex>
#include <utility>

#include "kernels/core/cuda_check.h"
#include "kernels/core/device.h"
#include "kernels/gemm/cublaslt_api.h"
#include "kernels/gemm/cublaslt_plan.h"
#include "kernels/gemm/cublaslt_resources.h"
#include "kernels/gemm/gemm_cuda_kernels.h"
#include "kernels/gemm/gemm_internal.h"
#include "kernels/ops/ops_cuda.h"
#include "kernels/quantize/nvfp4.h"

namespace meshproof::kernels {
namespace {

// ---- cuBLASLt handle and workspace, one per (device, stream), released with the stream ----

// 32 MiB: NVIDIA's recommended cuBLASLt workspace for Hopper and Blackwell (TransformerEngine uses
// the same); split-K and stream-K algorithms need it, and the heuristic is told its size.
constexpr size_t kWorkspaceBytes = 32u << 20;

std::mutex& resources_mu() {
  static std::mutex mu;
  return mu;
}
// Leaked on purpose (never destroyed at exit): the CUDA context may already be gone by then, and
// an entry still present at exit belongs to a stream nobody released (the default stream).
lt::StreamResourceTable& resources() {
  static auto* t = new lt::StreamResourceTable();
  return *t;
}
lt::AlgoCache& algo_cache() {
  static auto* c = new lt::AlgoCache();
  return *c;
}

// A copy of the entry (never a reference into the table: another rank's thread may insert).
lt::StreamResources lt_context(int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(resources_mu());
  if (const lt::StreamResources* e = resources().find(device, stream)) return *e;
  lt::StreamResources r{device, stream, nullptr, nullptr, static_cast<int64_t>(kWorkspaceBytes)};
  cublasLtHandle_t h = nullptr;
  MP_CUBLAS_CHECK(lt::api().create(&h));
  const cudaError_t st = cudaMalloc(&r.workspace, kWorkspaceBytes);
  if (st != cudaSuccess) {
    lt::api().destroy(h);
    MP_CUDA_CHECK(st);
  }
  r.handle = h;
  return resources().insert(r);
}

}  // namespace

int64_t cublaslt_reserved_bytes(Device device) {
  if (!device.is_cuda()) return 0;
  std::lock_guard<std::mutex> lock(resources_mu());
  return resources().bytes(device.index);
}

void release_stream_resources(void* stream) noexcept {
  std::vector<lt::StreamResources> gone;
  try {
    std::lock_guard<std::mutex> lock(resources_mu());
    gone = resources().take(stream);
  } catch (...) {
    std::fprintf(stderr, "meshproof: releasing the cuBLASLt resources of stream %p failed\n",
                 stream);
    return;
  }
  for (const lt::StreamResources& e : gone) {
    int saved = -1;
    const bool have_saved = cudaGetDevice(&saved) == cudaSuccess;
    if (cudaSetDevice(e.device) == cudaSuccess) {
      // The workspace may still be read by GEMMs queued on the stream: wait for them first.
      const cudaError_t sync = cudaStreamSynchronize(static_cast<cudaStream_t>(e.stream));
      const cublasStatus_t destroy = lt::api().destroy(static_cast<cublasLtHandle_t>(e.handle));
      const cudaError_t freed = cudaFree(e.workspace);
      if (sync != cudaSuccess || destroy != CUBLAS_STATUS_SUCCESS || freed != cudaSuccess) {
        std::fprintf(stderr,
                     "meshproof: releasing the cuBLASLt resources of stream %p on cuda:%d: "
                     "synchronize %s, cublasLtDestroy %s, cudaFree %s\n",
                     e.stream, e.device, cudaGetErrorName(sync), lt::api().get_status_name(destroy),
                     cudaGetErrorName(freed));
      }
    }
    if (have_saved) cudaSetDevice(saved);
  }
}

int cublaslt_runtime_version() {
  // 0 when the library cannot be opened: the GEMMs then fail with the reason (lt::api()).
  static const int v = [] {
    try {
      return static_cast<int>(lt::api().get_version());
    } catch (const Error&) {
      return 0;
    }
  }();
  return v;
}

LtAlgoCacheStats cublaslt_algo_cache_stats() { return algo_cache().stats(); }

int64_t cublaslt_stream_count() {
  std::lock_guard<std::mutex> lock(resources_mu());
  return static_cast<int64_t>(resources().size());
}

namespace detail {
namespace {

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
    if (pref) lt::api().matmul_preference_destroy(pref);
    if (c) lt::api().matrix_layout_destroy(c);
    if (b) lt::api().matrix_layout_destroy(b);
    if (a) lt::api().matrix_layout_destroy(a);
    if (op) lt::api().matmul_desc_destroy(op);
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
    case DType::kE2M1:
      return CUDA_R_4F_E2M1;
    default:
      MP_FAIL("gemm: no cuBLASLt type for {}", dtype_name(d));
  }
}

cublasLtMatmulMatrixScale_t lt_scale_mode(lt::ScaleMode m) {
  switch (m) {
    case lt::ScaleMode::kNone:
    case lt::ScaleMode::kScalar32F:
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case lt::ScaleMode::kVec32Ue8m0:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
    case lt::ScaleMode::kVec128_32F:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case lt::ScaleMode::kBlk128x128_32F:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    case lt::ScaleMode::kVec16Ue4m3:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
  }
  MP_FAIL("gemm: unknown scale mode {}", static_cast<int>(m));
}

bool is_narrow(DType d) { return is_fp8(d) || d == DType::kE2M1; }

// One operand as cuBLASLt sees it (in OUR terms: side A or B of C = A.B^T).
struct LtOperand {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  bool k_major = true;          // row-major [rows, K] (else row-major [K, rows])
  const void* scale = nullptr;  // device scale pointer (scaled paths), else nullptr
  lt::ScaleMode scale_mode = lt::ScaleMode::kNone;
};

// D[R,S] (row-major) = A . B^T (+ D when accumulate), fp32 accumulation (CUBLAS_COMPUTE_32F: no
// TF32 for fp32 inputs). `alpha_beta`: a device pointer to {alpha, beta} (device pointer mode,
// NVFP4's global scales), else alpha = 1 and beta = accumulate on the host.
void lt_matmul(const GemmProblem& p, const LtOperand& a, const LtOperand& b, Tensor& out,
               const GemmOptions& options, bool fast_accum, const float* alpha_beta = nullptr) {
  const int device = out.device().index;
  DeviceScope scope(device);
  auto stream = static_cast<cudaStream_t>(current_context().stream);
  if (a.dtype == DType::kFloat32 && out.dtype() == DType::kBFloat16) {
    // cuBLASLt pairs float32 A and B with a float32 C/D only (its table of supported types), so a
    // bf16 result of float32 operands (the float32 emulation of NVFP4, block-scaled or mixed
    // operands, whose outputs are bf16 activations) is computed into float32 scratch and rounded
    // once to bf16 (RNE, the CPU reference's fp32 sum and one rounding). A bf16 output never
    // accumulates (gemm rejects it), so the scratch needs no initial value.
    Tensor wide = Tensor::empty(out.shape(), DType::kFloat32, out.device());
    lt_matmul(p, a, b, wide, options, fast_accum, alpha_beta);
    MP_CUDA_CHECK(
        cuda::launch_cast(wide.raw_data(), false, out.raw_data(), true, out.numel().value, stream));
    return;  // `wide` is freed on this stream, after the cast
  }
  const lt::StreamResources ctx = lt_context(device, stream);
  auto handle = static_cast<cublasLtHandle_t>(ctx.handle);
  const uint64_t m = static_cast<uint64_t>(p.s), n = static_cast<uint64_t>(p.r),
                 k = static_cast<uint64_t>(p.k);
  LtDescs d;
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  MP_CUBLAS_CHECK(lt::api().matmul_desc_create(&d.op, compute, CUDA_R_32F));
  // Acb = our B, Bcb = our A (see the header comment).
  const cublasOperation_t opa = b.k_major ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = a.k_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  MP_CUBLAS_CHECK(
      lt::api().matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  MP_CUBLAS_CHECK(
      lt::api().matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  const cublasLtMatmulMatrixScale_t mode_a = lt_scale_mode(b.scale_mode);
  const cublasLtMatmulMatrixScale_t mode_b = lt_scale_mode(a.scale_mode);
  // The scale mode is set only when it is not the default per-tensor scalar: a cuBLASLt older than
  // 12.8 (the attribute's release) then still runs per-tensor FP8, and choose_gemm_path keeps the
  // other modes from such a library.
  if (b.scale != nullptr) {
    MP_CUBLAS_CHECK(lt::api().matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                        &b.scale, sizeof(b.scale)));
    if (b.scale_mode != lt::ScaleMode::kScalar32F) {
      MP_CUBLAS_CHECK(lt::api().matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                          &mode_a, sizeof(mode_a)));
    }
  }
  if (a.scale != nullptr) {
    MP_CUBLAS_CHECK(lt::api().matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                        &a.scale, sizeof(a.scale)));
    if (a.scale_mode != lt::ScaleMode::kScalar32F) {
      MP_CUBLAS_CHECK(lt::api().matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                          &mode_b, sizeof(mode_b)));
    }
  }
  const int8_t fast = fast_accum ? 1 : 0;
  if (is_fp8(a.dtype)) {
    MP_CUBLAS_CHECK(lt::api().matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                        &fast, sizeof(fast)));
  }
  if (alpha_beta != nullptr) {
    const cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
    MP_CUBLAS_CHECK(lt::api().matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_POINTER_MODE,
                                                        &pm, sizeof(pm)));
  }
  // Layouts: Acb is (rows x cols, ld) column-major as stored (before op); sizes in elements (for
  // E2M1, two per byte).
  const int64_t lda = b.k_major ? static_cast<int64_t>(k) : static_cast<int64_t>(m);
  const int64_t ldb = a.k_major ? static_cast<int64_t>(k) : static_cast<int64_t>(n);
  const int64_t ldc = static_cast<int64_t>(m);
  MP_CUBLAS_CHECK(lt::api().matrix_layout_create(&d.a, cuda_type(b.dtype), b.k_major ? k : m,
                                                 b.k_major ? m : k, lda));
  MP_CUBLAS_CHECK(lt::api().matrix_layout_create(&d.b, cuda_type(a.dtype), a.k_major ? k : n,
                                                 a.k_major ? n : k, ldb));
  MP_CUBLAS_CHECK(lt::api().matrix_layout_create(&d.c, cuda_type(out.dtype()), m, n, ldc));

  // Alignment preferences from the real pointers: the heuristic then returns only algorithms
  // valid for them (C and D are the output buffer).
  const uint32_t align_acb = lt::pointer_alignment(b.data);
  const uint32_t align_bcb = lt::pointer_alignment(a.data);
  const uint32_t align_out = lt::pointer_alignment(out.raw_data());
  lt::AlgoKey key;
  key.device = device;
  key.m = m, key.n = n, key.k = k;
  key.type_a = cuda_type(b.dtype), key.type_b = cuda_type(a.dtype);
  key.type_c = cuda_type(out.dtype());
  key.compute = compute;
  key.trans_a = opa, key.trans_b = opb;
  key.lda = lda, key.ldb = ldb, key.ldc = ldc;
  key.align_a = align_acb, key.align_b = align_bcb, key.align_c = align_out;
  key.align_d = align_out;
  key.scale_a = b.scale != nullptr ? mode_a : -1;
  key.scale_b = a.scale != nullptr ? mode_b : -1;
  key.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  key.fast_accum = is_fp8(a.dtype) ? fast : int8_t{-1};
  key.workspace = kWorkspaceBytes;

  cublasLtMatmulAlgo_t algo{};
  static_assert(sizeof(algo.data) == sizeof(lt::AlgoBlob));
  if (const std::optional<lt::AlgoBlob> hit = algo_cache().find(key)) {
    std::copy(hit->begin(), hit->end(), algo.data);
  } else {
    MP_CUBLAS_CHECK(lt::api().matmul_preference_create(&d.pref));
    const uint64_t ws = kWorkspaceBytes;
    MP_CUBLAS_CHECK(lt::api().matmul_preference_set_attribute(
        d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_acb},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_bcb},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_out},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_out}};
    for (const auto& [attr, value] : aligns) {
      MP_CUBLAS_CHECK(
          lt::api().matmul_preference_set_attribute(d.pref, attr, &value, sizeof(value)));
    }
    cublasLtMatmulHeuristicResult_t heur{};
    int found = 0;
    const cublasStatus_t st = lt::api().matmul_algo_get_heuristic(handle, d.op, d.a, d.b, d.c, d.c,
                                                                  d.pref, 1, &heur, &found);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
      const CudaStatus& cs = cuda_status();
      int cc = 0;
      for (const GpuInfo& g : cs.gpus) {
        if (g.index == device) cc = g.cc_major * 10 + g.cc_minor;
      }
      lt::LtFailure f;
      f.role = gemm_role_name(p.role);
      f.r = p.r, f.s = p.s, f.k = p.k;
      f.a_dtype = dtype_name(a.dtype), f.b_dtype = dtype_name(b.dtype);
      f.out_dtype = dtype_name(out.dtype());
      f.trans_a = opa == CUBLAS_OP_T ? 'T' : 'N';
      f.trans_b = opb == CUBLAS_OP_T ? 'T' : 'N';
      f.align_a = align_bcb, f.align_b = align_acb, f.align_c = align_out;
      f.scale_a = a.scale != nullptr ? a.scale_mode : lt::ScaleMode::kNone;
      f.scale_b = b.scale != nullptr ? b.scale_mode : lt::ScaleMode::kNone;
      f.compute_capability = cc;
      f.cublaslt_version = cublaslt_runtime_version();
      f.status =
          st != CUBLAS_STATUS_SUCCESS ? lt::api().get_status_name(st) : "no algorithm returned";
      MP_FAIL("{}", lt::describe_lt_failure(f));
    }
    algo = heur.algo;
    lt::AlgoBlob blob;
    std::copy(std::begin(algo.data), std::end(algo.data), blob.begin());
    algo_cache().store(key, blob);
  }
  // C and D are the same buffer: with beta = 1 this is out += A.B^T.
  const float alpha_host = 1.0f;
  const float beta_host = options.accumulate ? 1.0f : 0.0f;
  const void* alpha = alpha_beta != nullptr ? static_cast<const void*>(alpha_beta) : &alpha_host;
  const void* beta = alpha_beta != nullptr ? static_cast<const void*>(alpha_beta + 1) : &beta_host;
  MP_CUBLAS_CHECK(lt::api().matmul(handle, d.op, alpha, b.data, d.a, a.data, d.b, beta,
                                   out.raw_data(), d.c, out.raw_data(), d.c, &algo, ctx.workspace,
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
                     lt::ScaleMode::kNone};
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
  return LtOperand{scratch.raw_data(), to, stored_k_major(s), nullptr, lt::ScaleMode::kNone};
}

// A side as an fp32 operand (high-precision tensors converted, quantized ones decoded).
LtOperand f32_side(const GemmSide& s, Tensor& scratch) {
  if (const auto* t = std::get_if<const Tensor*>(&s.op)) {
    if ((*t)->dtype() == DType::kFloat32) {
      return LtOperand{(*t)->raw_data(), DType::kFloat32, !s.transposed, nullptr,
                       lt::ScaleMode::kNone};
    }
    const int64_t n = (*t)->numel().value;
    scratch = Tensor::empty((*t)->shape(), DType::kFloat32, (*t)->device());
    MP_CUDA_CHECK(launch_bf16_to_f32(static_cast<const uint16_t*>((*t)->raw_data()),
                                     scratch.data<float>(), n, stream_now()));
    return LtOperand{scratch.raw_data(), DType::kFloat32, !s.transposed, nullptr,
                     lt::ScaleMode::kNone};
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

lt::PathOperand path_operand(const GemmSide& s) {
  if (const auto* t = std::get_if<const Tensor*>(&s.op)) {
    return lt::PathOperand{false, ScalingMode::kCurrentTensor, (*t)->dtype()};
  }
  const QuantizedTensor& q = *std::get<const QuantizedTensor*>(s.op);
  return lt::PathOperand{true, q.mode, q.format};
}

// Per-tensor FP8 (sm_89+): TN form on the K-major copies, scale_inv as the A/B scales
// (D = scale_a * scale_b * sum(qa * qb)).
void native_per_tensor(const GemmProblem& p, const QuantizedTensor& qa, const QuantizedTensor& qb,
                       Tensor& out, const GemmOptions& options) {
  check_fp8_dims(p, "per-tensor FP8");
  const Tensor& da = copy_data(qa, p.a.transposed);
  const Tensor& db = copy_data(qb, p.b.transposed);
  check_aligned(da.raw_data(), p.a.name, p.role);
  check_aligned(db.raw_data(), p.b.name, p.role);
  const LtOperand a{da.raw_data(), qa.format, true, copy_scale(qa, p.a.transposed).raw_data(),
                    lt::ScaleMode::kScalar32F};
  const LtOperand b{db.raw_data(), qb.format, true, copy_scale(qb, p.b.transposed).raw_data(),
                    lt::ScaleMode::kScalar32F};
  lt_matmul(p, a, b, out, options, options.fast_accumulation);
}

// MXFP8 native on compute capability 10.x: TN form again. A columnwise MXFP8 copy is the logical
// [M,K] matrix with 32x1 blocks, i.e. the transpose of the K-major operand, so it is transposed on
// the device (bytes, lossless) and its scales are read transposed. The scales are padded and
// swizzled into cuBLASLt's 128x4 tiles.
void native_mxfp8(const GemmProblem& p, const QuantizedTensor& qa, const QuantizedTensor& qb,
                  Tensor& out, const GemmOptions& options) {
  check_fp8_dims(p, "MXFP8");
  Tensor tdata[2], swz[2];
  LtOperand ops[2];
  const GemmSide* sides[2] = {&p.a, &p.b};
  const QuantizedTensor* qs[2] = {&qa, &qb};
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
                                      stride_r, stride_c, static_cast<uint8_t*>(swz[i].raw_data()),
                                      stream_now()));
    ops[i] = LtOperand{kmajor, q.format, true, swz[i].raw_data(), lt::ScaleMode::kVec32Ue8m0};
  }
  lt_matmul(p, ops[0], ops[1], out, options, false);
}

// Block scaling natively on sm_90 (cuBLASLt >= 12.9): both copies are K-major (the rowwise copy,
// or the stored transpose), their fp32 scales [outer, K/128] (1x128) or [ceil(outer/128), K/128]
// (128x128) are rewritten into cuBLASLt's VEC128_32F / BLK128x128_32F layouts. Fast accumulation
// stays off (the recipe's rule; cuBLASLt's block-scaled kernels promote every 128 along K).
void native_block(const GemmProblem& p, const QuantizedTensor& qa, const QuantizedTensor& qb,
                  const lt::PathDecision& d, Tensor& out, const GemmOptions& options) {
  Tensor conv[2];
  LtOperand ops[2];
  const GemmSide* sides[2] = {&p.a, &p.b};
  const QuantizedTensor* qs[2] = {&qa, &qb};
  const lt::ScaleMode modes[2] = {d.a_scale, d.b_scale};
  const int64_t k_blocks = lt::ceil_div(p.k, 128);
  for (int i = 0; i < 2; ++i) {
    const QuantizedTensor& q = *qs[i];
    const Tensor& data = copy_data(q, sides[i]->transposed);
    const Tensor& sinv = copy_scale(q, sides[i]->transposed);
    const int64_t outer = i == 0 ? p.r : p.s;
    const bool tiles = modes[i] == lt::ScaleMode::kBlk128x128_32F;
    const int64_t n =
        tiles ? lt::blk128_scale_elems(outer, k_blocks) : lt::vec128_scale_elems(outer, k_blocks);
    conv[i] = Tensor::empty(Shape{n}, DType::kFloat32, data.device());
    MP_CUDA_CHECK(launch_block_scales(sinv.data<float>(), outer, k_blocks, tiles,
                                      conv[i].data<float>(), stream_now()));
    ops[i] = LtOperand{data.raw_data(), q.format, true, conv[i].raw_data(), modes[i]};
  }
  lt_matmul(p, ops[0], ops[1], out, options, false);
}

// NVFP4 natively on cc 10.x (cuBLASLt >= 12.8): E2M1 data of the K-major copies (rowwise, or the
// stored transpose), their E4M3 block codes [outer, K/16] swizzled into 128x4 tiles
// (VEC16_UE4M3), and the two global decode scales folded into alpha on the device (device
// pointer mode: no host round trip for the amaxes).
void native_nvfp4(const GemmProblem& p, const QuantizedTensor& qa, const QuantizedTensor& qb,
                  Tensor& out, const GemmOptions& options) {
  Tensor swz[2];
  LtOperand ops[2];
  const GemmSide* sides[2] = {&p.a, &p.b};
  const QuantizedTensor* qs[2] = {&qa, &qb};
  const float* amax[2] = {nullptr, nullptr};
  const int64_t k_blocks = p.k / 16;
  for (int i = 0; i < 2; ++i) {
    const QuantizedTensor& q = *qs[i];
    const bool col = sides[i]->transposed;
    const Tensor& data = copy_data(q, col);
    const Tensor& sinv = copy_scale(q, col);
    const int64_t outer = i == 0 ? p.r : p.s;
    swz[i] = Tensor::empty(Shape{lt::swizzled_128x4_bytes(outer, k_blocks)}, DType::kE4M3,
                           data.device());
    MP_CUDA_CHECK(launch_swizzle_e8m0(static_cast<const uint8_t*>(sinv.raw_data()), outer, k_blocks,
                                      k_blocks, 1, static_cast<uint8_t*>(swz[i].raw_data()),
                                      stream_now()));
    const Tensor& global_amax = col ? q.columnwise_amax : q.amax;
    MP_CHECK_INPUT(global_amax.device() == out.device(),
                   "gemm_{}: the {} global amax of NVFP4 operand {} is on {}, not {}",
                   gemm_role_name(p.role), col ? "columnwise" : "rowwise", sides[i]->name,
                   global_amax.device().str(), out.device().str());
    amax[i] = global_amax.data<float>();
    ops[i] = LtOperand{data.raw_data(), DType::kE2M1, true, swz[i].raw_data(),
                       lt::ScaleMode::kVec16Ue4m3};
  }
  Tensor alpha_beta = Tensor::empty(Shape{2}, DType::kFloat32, out.device());
  MP_CUDA_CHECK(launch_nvfp4_alpha(amax[0], amax[1], options.accumulate ? 1.0f : 0.0f,
                                   alpha_beta.data<float>(), stream_now()));
  lt_matmul(p, ops[0], ops[1], out, options, false, alpha_beta.data<float>());
}

}  // namespace

lt::PathDecision gemm_cuda_path(const GemmProblem& p, int device) {
  lt::PathQuery q;
  q.a = path_operand(p.a);
  q.b = path_operand(p.b);
  q.compute_capability = compute_capability(device);
  q.cublaslt_version = cublaslt_runtime_version();
  q.r = p.r, q.s = p.s, q.k = p.k;
  return lt::choose_gemm_path(q);
}

// Scratch tensors (decoded copies, transposes, converted scales) are freed with cudaFreeAsync on
// the rank's stream, i.e. after the GEMM queued before them has run.
void gemm_cuda(const GemmProblem& p, Tensor& out, const GemmOptions& options) {
  const int device = out.device().index;
  DeviceScope scope(device);
  if (p.k == 0) {
    // An empty sum (a weight gradient over an expert that received no tokens): cuBLASLt takes no
    // K = 0 problem. The result is +0 as on the CPU, or the output unchanged when accumulating.
    if (!options.accumulate) {
      MP_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes().value, stream_now()));
    }
    return;
  }
  const lt::PathDecision d = gemm_cuda_path(p, device);
  const QuantizedTensor* qa = as_quantized(p.a);
  const QuantizedTensor* qb = as_quantized(p.b);
  switch (d.path) {
    case lt::GemmPath::kNativeDirect: {
      // Both high precision with the same dtype: native fp32 or bf16 GEMM, no copies.
      const Tensor& ta = *std::get<const Tensor*>(p.a.op);
      const Tensor& tb = *std::get<const Tensor*>(p.b.op);
      lt_matmul(p, LtOperand{ta.raw_data(), ta.dtype(), !p.a.transposed},
                LtOperand{tb.raw_data(), tb.dtype(), !p.b.transposed}, out, options, false);
      return;
    }
    case lt::GemmPath::kNativeScaled:
      MP_CHECK(qa != nullptr && qb != nullptr,
               "gemm_{}: a native scaled path needs two quantized "
               "operands",
               gemm_role_name(p.role));
      switch (d.a_scale) {
        case lt::ScaleMode::kScalar32F:
          native_per_tensor(p, *qa, *qb, out, options);
          return;
        case lt::ScaleMode::kVec32Ue8m0:
          native_mxfp8(p, *qa, *qb, out, options);
          return;
        case lt::ScaleMode::kVec128_32F:
        case lt::ScaleMode::kBlk128x128_32F:
          native_block(p, *qa, *qb, d, out, options);
          return;
        case lt::ScaleMode::kVec16Ue4m3:
          native_nvfp4(p, *qa, *qb, out, options);
          return;
        case lt::ScaleMode::kNone:
          break;
      }
      MP_FAIL("gemm_{}: native scaled path without a scale mode", gemm_role_name(p.role));
    case lt::GemmPath::kEmulatedBf16: {
      // MXFP8 emulated exactly: each element q * 2^(e-127) has at most 4 significant bits and an
      // exponent in bf16's range, so decoding to bf16 is lossless (except values below bf16's
      // smallest subnormal 2^-133, which only arise with block scales below 2^-124 and are
      // rounded to nearest even), then a bf16 GEMM with fp32 accumulation.
      Tensor sa, sb;
      const LtOperand a = decode_side(p.a, DType::kBFloat16, sa);
      const LtOperand b = decode_side(p.b, DType::kBFloat16, sb);
      lt_matmul(p, a, b, out, options, false);
      return;
    }
    case lt::GemmPath::kEmulatedF32:
    case lt::GemmPath::kCpu: {
      // Everything else: decode exactly to fp32 (the CPU reference's values), fp32 GEMM.
      Tensor sa, sb;
      const LtOperand a = f32_side(p.a, sa);
      const LtOperand b = f32_side(p.b, sb);
      lt_matmul(p, a, b, out, options, false);
      return;
    }
  }
}

}  // namespace detail
}  // namespace meshproof::kernels
#endif  // MESHPROOF_HAVE_CUDA
