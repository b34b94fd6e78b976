// CUDA LayerNorm / RMSNorm (kernels/ops/layernorm.h). One block per row for the row statistics and
// dx: per-thread partial sums in double combined by a warp-shuffle tree (block_sum), where the
// CPU sums serially in double; the difference is ~1e-15 relative before the final rounding, so y,
// mean, rstd and dx agree with the CPU to 1 ulp of the stored dtype. dweight/dbias are parallel
// per-column reductions in a fixed order (kernels/ops/column_reduce.h): deterministic run to run,
// and within that header's bound of the CPU's serial row sums (no longer bitwise).
#include "kernels/ops/column_reduce.cuh"
#include "kernels/ops/ops_cuda.h"
#include "kernels/ops/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda {
namespace {

constexpr int kRowThreads = 256;

// mean == nullptr and bias == nullptr: RMSNorm (y = x * rstd * w).
template <typename T>
__global__ void norm_forward_kernel(const T* x, const T* w, const T* b, bool rms, double eps,
                                    int64_t h, T* y, T* mean_out, T* rstd_out) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * h;
  double mean = 0.0;
  if (!rms) {
    double part = 0.0;
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) part += detail::load(xr, c);
    mean = detail::block_sum(part, shared) / static_cast<double>(h);
  }
  double part_sq = 0.0;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    const double d = static_cast<double>(detail::load(xr, c)) - mean;
    part_sq += d * d;
  }
  const double rstd = 1.0 / sqrt(detail::block_sum(part_sq, shared) / static_cast<double>(h) + eps);
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    const double xv = detail::load(xr, c), wv = detail::load(w, c);
    if (rms) {
      detail::store_d(y, r * h + c, __dmul_rn(__dmul_rn(xv, rstd), wv));
    } else {
      const double n = __dmul_rn(xv - mean, rstd);
      detail::store_d(y, r * h + c, __dadd_rn(__dmul_rn(n, wv), detail::load(b, c)));
    }
  }
  if (threadIdx.x == 0) {
    if (!rms) detail::store_d(mean_out, r, mean);
    detail::store_d(rstd_out, r, rstd);
  }
}

// dx = rstd * (g - mean(g) - n * mean(g * n)), g = dy * w (no mean(g) term for RMSNorm).
template <typename T>
__global__ void norm_backward_dx_kernel(const T* dy, const T* x, const T* w, const T* mean_in,
                                        const T* rstd_in, int64_t h, T* dx) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const double mean = mean_in ? static_cast<double>(detail::load(mean_in, r)) : 0.0;
  const double rstd = detail::load(rstd_in, r);
  double part_g = 0.0, part_gn = 0.0;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    const double n = (static_cast<double>(detail::load(x, r * h + c)) - mean) * rstd;
    const double g = static_cast<double>(detail::load(dy, r * h + c)) * detail::load(w, c);
    part_g += g;
    part_gn += g * n;
  }
  const double sum_g = detail::block_sum(part_g, shared);
  const double sum_gn = detail::block_sum(part_gn, shared);
  const double mean_g = mean_in ? sum_g / static_cast<double>(h) : 0.0;
  const double mean_gn = sum_gn / static_cast<double>(h);
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    const double n = (static_cast<double>(detail::load(x, r * h + c)) - mean) * rstd;
    const double g = static_cast<double>(detail::load(dy, r * h + c)) * detail::load(w, c);
    detail::store_d(dx, r * h + c, rstd * (g - mean_g - n * mean_gn));
  }
}

// The weight (and bias) gradient terms of row r, column c: dy * n and dy, with
// n = (x - mean) * rstd, each double operation rounded as on the CPU (no FMA). K = 2 for
// LayerNorm (dw, db), 1 for RMSNorm (dw; mean is nullptr).
template <typename T, int kK>
struct NormGradTerm {
  static constexpr int K = kK;
  const T* dy;
  const T* x;
  const T* mean;
  const T* rstd;
  int64_t h;
  __device__ void operator()(int64_t r, int64_t c, double* t) const {
    const double mu = mean ? static_cast<double>(detail::load(mean, r)) : 0.0;
    const double n = __dmul_rn(__dsub_rn(detail::load(x, r * h + c), mu), detail::load(rstd, r));
    const double d = detail::load(dy, r * h + c);
    t[0] = __dmul_rn(d, n);
    if constexpr (kK == 2) t[1] = d;
  }
};

template <typename T>
cudaError_t forward(const void* x, const void* w, const void* b, bool rms, double eps, int64_t m,
                    int64_t h, void* y, void* mean, void* rstd, void* stream) {
  if (m == 0) return cudaSuccess;
  norm_forward_kernel<T><<<static_cast<unsigned>(m), kRowThreads, 0, detail::as_stream(stream)>>>(
      static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(b), rms, eps, h,
      static_cast<T*>(y), static_cast<T*>(mean), static_cast<T*>(rstd));
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward(const void* dy, const void* x, const void* w, const void* mean,
                     const void* rstd, int64_t m, int64_t h, void* dx, double* partial, float* dw,
                     float* db, void* stream) {
  if (m == 0 || h == 0) return cudaSuccess;
  auto s = detail::as_stream(stream);
  norm_backward_dx_kernel<T><<<static_cast<unsigned>(m), kRowThreads, 0, s>>>(
      static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w),
      static_cast<const T*>(mean), static_cast<const T*>(rstd), h, static_cast<T*>(dx));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if (db == nullptr) {
    return detail::column_reduce(
        NormGradTerm<T, 1>{static_cast<const T*>(dy), static_cast<const T*>(x), nullptr,
                           static_cast<const T*>(rstd), h},
        m, h, partial, dw, nullptr, s);
  }
  return detail::column_reduce(
      NormGradTerm<T, 2>{static_cast<const T*>(dy), static_cast<const T*>(x),
                         static_cast<const T*>(mean), static_cast<const T*>(rstd), h},
      m, h, partial, dw, db, s);
}

}  // namespace

cudaError_t launch_norm_forward(const void* x, const void* weight, const void* bias, bool bf16,
                                bool rms, double eps, int64_t m, int64_t h, void* y, void* mean,
                                void* rstd, void* stream) {
  return bf16 ? forward<uint16_t>(x, weight, bias, rms, eps, m, h, y, mean, rstd, stream)
              : forward<float>(x, weight, bias, rms, eps, m, h, y, mean, rstd, stream);
}

cudaError_t launch_norm_backward(const void* dy, const void* x, const void* weight,
                                 const void* mean, const void* rstd, bool bf16, int64_t m,
                                 int64_t h, void* dx, double* partial, float* dweight, float* dbias,
                                 void* stream) {
  return bf16 ? backward<uint16_t>(dy, x, weight, mean, rstd, m, h, dx, partial, dweight, dbias,
                                   stream)
              : backward<float>(dy, x, weight, mean, rstd, m, h, dx, partial, dweight, dbias,
                                stream);
}

}  // namespace meshproof::kernels::cuda
