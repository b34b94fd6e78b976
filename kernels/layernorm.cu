// CUDA LayerNorm / RMSNorm (kernels/layernorm.h). One block per row for the row statistics and
// dx: per-thread partial sums in double combined by a warp-shuffle tree (block_sum), where the
// CPU sums serially in double; the difference is ~1e-15 relative before the final rounding, so y,
// mean, rstd and dx agree with the CPU to 1 ulp of the stored dtype. dweight/dbias use one thread
// per column that walks the rows in the CPU's order with explicitly rounded double ops: bitwise
// equal to the CPU.
#include "kernels/ops_cuda.h"
#include "kernels/ops_cuda_util.cuh"

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

// One thread per column: dw[c] += sum_r dy * n, db[c] += sum_r dy, rows in order, each double op
// rounded explicitly as on the CPU (no FMA).
template <typename T>
__global__ void norm_backward_dw_kernel(const T* dy, const T* x, const T* mean_in, const T* rstd_in,
                                        int64_t m, int64_t h, float* dw, float* db) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= h) return;
  double dw_acc = 0.0, db_acc = 0.0;
  for (int64_t r = 0; r < m; ++r) {
    const double mean = mean_in ? static_cast<double>(detail::load(mean_in, r)) : 0.0;
    const double rstd = detail::load(rstd_in, r);
    const double n = __dmul_rn(__dsub_rn(detail::load(x, r * h + c), mean), rstd);
    const double d = detail::load(dy, r * h + c);
    dw_acc = __dadd_rn(dw_acc, __dmul_rn(d, n));
    db_acc = __dadd_rn(db_acc, d);
  }
  dw[c] = __double2float_rn(__dadd_rn(static_cast<double>(dw[c]), dw_acc));
  if (db) db[c] = __double2float_rn(__dadd_rn(static_cast<double>(db[c]), db_acc));
}

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
                     const void* rstd, int64_t m, int64_t h, void* dx, float* dw, float* db,
                     void* stream) {
  if (m == 0 || h == 0) return cudaSuccess;
  auto s = detail::as_stream(stream);
  norm_backward_dx_kernel<T><<<static_cast<unsigned>(m), kRowThreads, 0, s>>>(
      static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w),
      static_cast<const T*>(mean), static_cast<const T*>(rstd), h, static_cast<T*>(dx));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const auto cols = static_cast<unsigned>((h + detail::kThreads - 1) / detail::kThreads);
  norm_backward_dw_kernel<T><<<cols, detail::kThreads, 0, s>>>(
      static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(mean),
      static_cast<const T*>(rstd), m, h, dw, db);
  return cudaGetLastError();
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
                                 int64_t h, void* dx, float* dweight, float* dbias, void* stream) {
  return bf16 ? backward<uint16_t>(dy, x, weight, mean, rstd, m, h, dx, dweight, dbias, stream)
              : backward<float>(dy, x, weight, mean, rstd, m, h, dx, dweight, dbias, stream);
}

}  // namespace meshproof::kernels::cuda
