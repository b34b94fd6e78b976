// CUDA softmax cross-entropy (kernels/ops/cross_entropy.h): one block per row, max and sum of
// exponentials in double by block tree reductions (the CPU sums serially in double), so the per-row
// losses agree with the CPU to ~1e-15 relative and dlogits to 1 ulp of the stored dtype. The
// per-row losses stay on the device and one thread adds them in row order (the CPU's serial
// order), so only the 8-byte total crosses to the host. The vocabulary-parallel pieces keep their
// per-row doubles on the device the same way (docs/design.md, "Host-device traffic per step").
#include "kernels/ops/ops_cuda.h"
#include "kernels/ops/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda {
namespace {

constexpr int kRowThreads = 256;

// The quiet NaN that marks a row whose target lies outside the vocabulary.
__device__ inline double bad_target() { return __longlong_as_double(0x7ff8000000000000LL); }

// The maximum of one row of v logits, as double, over the block (every thread gets it).
template <typename T>
__device__ double block_row_max(const T* row, int64_t v, double* shared) {
  double part_max = -INFINITY;
  for (int64_t c = threadIdx.x; c < v; c += blockDim.x)
    part_max = fmax(part_max, static_cast<double>(detail::load(row, c)));
  return detail::block_max(part_max, shared);
}

template <typename T>
__global__ void cross_entropy_kernel(const T* logits, const int32_t* targets, int64_t v,
                                     double grad_scale, double* row_loss, T* dlogits) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const T* row = logits + r * v;
  const double mx = block_row_max(row, v, shared);
  double part_sum = 0.0;
  for (int64_t c = threadIdx.x; c < v; c += blockDim.x)
    part_sum += exp(static_cast<double>(detail::load(row, c)) - mx);
  const double log_z = mx + log(detail::block_sum(part_sum, shared));
  const int32_t t = targets[r];
  const bool valid = t >= 0 && t < v;  // else no read: a NaN loss the dispatch reports
  if (threadIdx.x == 0)
    row_loss[r] = valid ? log_z - static_cast<double>(detail::load(row, t)) : bad_target();
  if (dlogits == nullptr) return;
  for (int64_t c = threadIdx.x; c < v; c += blockDim.x) {
    const double prob = exp(static_cast<double>(detail::load(row, c)) - log_z);
    detail::store_d(dlogits, r * v + c, grad_scale * (prob - (c == t ? 1.0 : 0.0)));
  }
}

// One thread: the CPU's `total += row_loss[r]` for r = 0, 1, ... (rounded adds, no reordering).
__global__ void row_sum_kernel(const double* row_loss, int64_t m, double* out) {
  double total = 0.0;
  for (int64_t r = 0; r < m; ++r) total = __dadd_rn(total, row_loss[r]);
  out[0] = total;
}

template <typename T>
__global__ void shard_max_kernel(const T* logits, int64_t v, double* row_max) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const double mx = block_row_max(logits + r * v, v, shared);  // max is exact: the CPU's bits
  if (threadIdx.x == 0) row_max[r] = mx;
}

template <typename T>
__global__ void shard_sums_kernel(const T* logits, const int32_t* targets, int64_t v,
                                  int64_t vocab_begin, int64_t vocab, const double* row_max,
                                  double* sum_exp, double* target_logit) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const T* row = logits + r * v;
  const double mx = row_max[r];
  double part_sum = 0.0;
  for (int64_t c = threadIdx.x; c < v; c += blockDim.x)
    part_sum += exp(static_cast<double>(detail::load(row, c)) - mx);
  const double sum = detail::block_sum(part_sum, shared);
  if (threadIdx.x != 0) return;
  sum_exp[r] = sum;
  const int64_t t = targets[r], col = t - vocab_begin;
  double tl = 0.0;
  if (t < 0 || t >= vocab)
    tl = bad_target();  // the loss piece reports the target
  else if (col >= 0 && col < v)
    tl = static_cast<double>(detail::load(row, col));
  target_logit[r] = tl;
}

__global__ void combine_ranks_kernel(const double* every, int ranks, int64_t m, bool max,
                                     double* out) {
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < m;
       r += int64_t{gridDim.x} * blockDim.x) {
    double o = every[r];
    for (int t = 1; t < ranks; ++t) {
      const double x = every[t * m + r];
      // The host's std::max(o, x) keeps o unless o < x; fmax would differ on a NaN.
      o = max ? (o < x ? x : o) : __dadd_rn(o, x);
    }
    out[r] = o;
  }
}

__global__ void log_z_kernel(const double* row_max, const double* sum_exp, int64_t m,
                             double* log_z) {
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < m;
       r += int64_t{gridDim.x} * blockDim.x)
    log_z[r] = __dadd_rn(row_max[r], log(sum_exp[r]));
}

// One thread, rows in order: the CPU's `total += log_z[r] - target[r]` over the counted rows.
__global__ void shard_loss_sum_kernel(const double* log_z, const double* target_logit, int64_t m,
                                      int64_t seq, int sp_size, int sp_rank, bool nan_on_bad_target,
                                      double* out) {
  const int64_t sl = seq / sp_size;
  double total = 0.0;
  bool bad = false;
  for (int64_t r = 0; r < m; ++r) {
    const double t = target_logit[r];
    bad = bad || isnan(t);
    if (sp_size == 1 || (r % seq) / sl == sp_rank) total = __dadd_rn(total, __dsub_rn(log_z[r], t));
  }
  out[0] = nan_on_bad_target && bad ? bad_target() : total;
}

template <typename T>
__global__ void shard_grad_kernel(const T* logits, const int32_t* targets, int64_t v,
                                  int64_t vocab_begin, const double* log_z, double grad_scale,
                                  T* dlogits) {
  const int64_t r = blockIdx.x;
  const T* row = logits + r * v;
  const double lz = log_z[r];
  const int64_t col = static_cast<int64_t>(targets[r]) - vocab_begin;
  for (int64_t c = threadIdx.x; c < v; c += blockDim.x) {
    const double prob = exp(static_cast<double>(detail::load(row, c)) - lz);
    detail::store_d(dlogits, r * v + c, grad_scale * (prob - (c == col ? 1.0 : 0.0)));
  }
}

template <typename T>
cudaError_t run(const void* logits, const int32_t* targets, int64_t m, int64_t v, double grad_scale,
                double* row_loss, void* dlogits, void* stream) {
  if (m == 0) return cudaSuccess;
  cross_entropy_kernel<T><<<static_cast<unsigned>(m), kRowThreads, 0, detail::as_stream(stream)>>>(
      static_cast<const T*>(logits), targets, v, grad_scale, row_loss, static_cast<T*>(dlogits));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_cross_entropy(const void* logits, const int32_t* targets, bool bf16, int64_t m,
                                 int64_t v, double grad_scale, double* row_loss, void* dlogits,
                                 void* stream) {
  return bf16 ? run<uint16_t>(logits, targets, m, v, grad_scale, row_loss, dlogits, stream)
              : run<float>(logits, targets, m, v, grad_scale, row_loss, dlogits, stream);
}

cudaError_t launch_row_sum(const double* row_loss, int64_t m, double* out, void* stream) {
  row_sum_kernel<<<1, 1, 0, detail::as_stream(stream)>>>(row_loss, m, out);
  return cudaGetLastError();
}

cudaError_t launch_cross_entropy_shard_max(const void* logits, bool bf16, int64_t m, int64_t v,
                                           double* row_max, void* stream) {
  if (m == 0) return cudaSuccess;
  const auto s = detail::as_stream(stream);
  const auto blocks = static_cast<unsigned>(m);
  if (bf16)
    shard_max_kernel<uint16_t>
        <<<blocks, kRowThreads, 0, s>>>(static_cast<const uint16_t*>(logits), v, row_max);
  else
    shard_max_kernel<float>
        <<<blocks, kRowThreads, 0, s>>>(static_cast<const float*>(logits), v, row_max);
  return cudaGetLastError();
}

cudaError_t launch_cross_entropy_shard_sums(const void* logits, const int32_t* targets, bool bf16,
                                            int64_t m, int64_t v, int64_t vocab_begin,
                                            int64_t vocab, const double* row_max, double* sum_exp,
                                            double* target_logit, void* stream) {
  if (m == 0) return cudaSuccess;
  const auto s = detail::as_stream(stream);
  const auto blocks = static_cast<unsigned>(m);
  if (bf16)
    shard_sums_kernel<uint16_t><<<blocks, kRowThreads, 0, s>>>(static_cast<const uint16_t*>(logits),
                                                               targets, v, vocab_begin, vocab,
                                                               row_max, sum_exp, target_logit);
  else
    shard_sums_kernel<float><<<blocks, kRowThreads, 0, s>>>(static_cast<const float*>(logits),
                                                            targets, v, vocab_begin, vocab, row_max,
                                                            sum_exp, target_logit);
  return cudaGetLastError();
}

cudaError_t launch_combine_ranks(const double* every, int ranks, int64_t m, bool max, double* out,
                                 void* stream) {
  if (m == 0) return cudaSuccess;
  combine_ranks_kernel<<<detail::grid_1d(m), detail::kThreads, 0, detail::as_stream(stream)>>>(
      every, ranks, m, max, out);
  return cudaGetLastError();
}

cudaError_t launch_cross_entropy_shard_loss(const double* row_max, const double* sum_exp,
                                            const double* target_logit, int64_t m, int64_t seq,
                                            int sp_size, int sp_rank, bool nan_on_bad_target,
                                            double* log_z, double* out, void* stream) {
  const auto s = detail::as_stream(stream);
  if (m > 0) {
    log_z_kernel<<<detail::grid_1d(m), detail::kThreads, 0, s>>>(row_max, sum_exp, m, log_z);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  shard_loss_sum_kernel<<<1, 1, 0, s>>>(log_z, target_logit, m, seq, sp_size, sp_rank,
                                        nan_on_bad_target, out);
  return cudaGetLastError();
}

cudaError_t launch_cross_entropy_shard_grad(const void* logits, const int32_t* targets, bool bf16,
                                            int64_t m, int64_t v, int64_t vocab_begin,
                                            const double* log_z, double grad_scale, void* dlogits,
                                            void* stream) {
  if (m == 0 || v == 0) return cudaSuccess;
  const auto s = detail::as_stream(stream);
  const auto blocks = static_cast<unsigned>(m);
  if (bf16)
    shard_grad_kernel<uint16_t><<<blocks, kRowThreads, 0, s>>>(
        static_cast<const uint16_t*>(logits), targets, v, vocab_begin, log_z, grad_scale,
        static_cast<uint16_t*>(dlogits));
  else
    shard_grad_kernel<float>
        <<<blocks, kRowThreads, 0, s>>>(static_cast<const float*>(logits), targets, v, vocab_begin,
                                        log_z, grad_scale, static_cast<float*>(dlogits));
  return cudaGetLastError();
}

}  // namespace meshproof::kernels::cuda
