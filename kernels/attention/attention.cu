// CUDA causal attention (kernels/attention/attention.h), a direct transcription of the CPU loops:
//   forward: one block per (batch, head, query row i). Threads compute the scores q_i·k_j/sqrt(d)
//     for j <= i (each dot serial over d, as on the CPU); thread 0 forms the max and the sum of
//     exponentials serially in the CPU's j order; probabilities are stored in the compute dtype
//     and the output row is accumulated, one thread per column, from the STORED (rounded)
//     probabilities in j order, like the CPU. Everything is double with explicitly rounded
//     operations (no FMA contraction), so the only difference from the CPU is the device exp()
//     (a few ulp of double): probs and out agree with the CPU to 1 ulp of the stored dtype.
//   backward: kernel A, one block per (b, h, i): dP_ij = dO_i·V_j, rowdot_i = sum_j P_ij dP_ij
//     (serial, CPU order, kept in a double scratch [B*A*S]), dS_ij = P_ij (dP_ij - rowdot_i) scale
//     and dQ_i = sum_j dS_ij K_j. Kernel B, one block per (b, h, key row j): dV_j = sum_{i>=j}
//     P_ij dO_i and dK_j = sum_{i>=j} dS_ij Q_i in increasing i, the CPU's accumulation order.
//     Given the same probs the backward therefore reproduces the CPU's double arithmetic
//     operation for operation: bitwise equal.
// A row of S doubles lives in shared memory: S <= 6000, under the 48 KiB default with the static
// shared scalars (attention.cc checks it).
#include "kernels/ops/ops_cuda.h"
#include "kernels/ops/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda {
namespace {

constexpr int kAttnThreads = 128;

// The double value of v after rounding to T (what the CPU reads back from the stored probs).
__device__ inline double rounded(double v, const float*) {
  return static_cast<double>(__double2float_rn(v));
}
__device__ inline double rounded(double v, const uint16_t*) {
  return static_cast<double>(fmt8::bf16_to_float(fmt8::float_to_bf16(__double2float_rn(v))));
}

struct Dims {
  int64_t batch, seq, heads, d, kv;
  // The grouped qkv layout of kernels/attention/attention.h: row width and head a's q/k/v columns.
  __device__ int64_t width() const { return (heads + 2 * kv) * d; }
  __device__ int64_t group_base(int64_t a) const {
    const int64_t r = heads / kv;
    return (a / r) * (r + 2) * d;
  }
  __device__ int64_t q_col(int64_t a) const { return group_base(a) + (a % (heads / kv)) * d; }
  __device__ int64_t k_col(int64_t a) const { return group_base(a) + (heads / kv) * d; }
  __device__ int64_t v_col(int64_t a) const { return k_col(a) + d; }
};

template <typename T>
__global__ void attention_forward_kernel(const T* qkv, Dims dm, double scale, T* out, T* probs) {
  extern __shared__ double row[];  // [seq]
  __shared__ double total;
  const int64_t seq = dm.seq, d = dm.d, h = dm.heads * d, w = dm.width();
  const int64_t i = blockIdx.x % seq, a = (blockIdx.x / seq) % dm.heads,
                b = blockIdx.x / (seq * dm.heads);
  const int64_t q_col = dm.q_col(a), k_col = dm.k_col(a), v_col = dm.v_col(a);
  const T* q = qkv + (b * seq + i) * w + q_col;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    const T* k = qkv + (b * seq + j) * w + k_col;
    double dot = 0.0;
    for (int64_t c = 0; c < d; ++c)
      dot = __dadd_rn(dot, __dmul_rn(detail::load(q, c), detail::load(k, c)));
    row[j] = __dmul_rn(dot, scale);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double mx = -INFINITY;
    for (int64_t j = 0; j <= i; ++j) mx = mx < row[j] ? row[j] : mx;  // std::max order
    double sum = 0.0;
    for (int64_t j = 0; j <= i; ++j) {
      row[j] = exp(__dsub_rn(row[j], mx));
      sum = __dadd_rn(sum, row[j]);
    }
    total = sum;
  }
  __syncthreads();
  T* pr = probs + ((b * dm.heads + a) * seq + i) * seq;
  for (int64_t j = threadIdx.x; j < seq; j += blockDim.x) {
    if (j <= i) {
      const double p = __ddiv_rn(row[j], total);
      detail::store_d(pr, j, p);
      row[j] = rounded(p, pr);
    } else {
      detail::store(pr, j, 0.0f);
    }
  }
  __syncthreads();
  T* orow = out + (b * seq + i) * h + a * d;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    double acc = 0.0;
    for (int64_t j = 0; j <= i; ++j)
      acc = __dadd_rn(acc, __dmul_rn(row[j], detail::load(qkv, (b * seq + j) * w + v_col + c)));
    detail::store_d(orow, c, acc);
  }
}

// Kernel A: row i of dS (into shared), rowdot_i into the scratch, dQ_i into dqkv.
template <typename T>
__global__ void attention_backward_q_kernel(const T* dout, const T* qkv, const T* probs, Dims dm,
                                            double scale, double* rowdot, T* dqkv) {
  extern __shared__ double ds[];  // [seq]: dP_ij, then dS_ij
  __shared__ double dot_pdp;
  const int64_t seq = dm.seq, d = dm.d, h = dm.heads * d, w = dm.width();
  const int64_t i = blockIdx.x % seq, a = (blockIdx.x / seq) % dm.heads,
                b = blockIdx.x / (seq * dm.heads);
  const int64_t q_col = dm.q_col(a), k_col = dm.k_col(a), v_col = dm.v_col(a);
  const T* pr = probs + ((b * dm.heads + a) * seq + i) * seq;
  const T* dorow = dout + (b * seq + i) * h + a * d;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    const T* v = qkv + (b * seq + j) * w + v_col;
    double dp = 0.0;
    for (int64_t c = 0; c < d; ++c)
      dp = __dadd_rn(dp, __dmul_rn(detail::load(dorow, c), detail::load(v, c)));
    ds[j] = dp;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double acc = 0.0;
    for (int64_t j = 0; j <= i; ++j) acc = __dadd_rn(acc, __dmul_rn(detail::load(pr, j), ds[j]));
    dot_pdp = acc;
    rowdot[blockIdx.x] = acc;
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x)
    ds[j] = __dmul_rn(__dmul_rn(detail::load(pr, j), __dsub_rn(ds[j], dot_pdp)), scale);
  __syncthreads();
  T* dq = dqkv + (b * seq + i) * w + q_col;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    double acc = 0.0;
    for (int64_t j = 0; j <= i; ++j)
      acc = __dadd_rn(acc, __dmul_rn(ds[j], detail::load(qkv, (b * seq + j) * w + k_col + c)));
    detail::store_d(dq, c, acc);
  }
}

// Kernel B: one block per (b, KV group g, key row j). For each query head of the group in order:
// column j of dS (into shared, recomputed from the row dots), then dK_j and dV_j accumulated over
// the group's heads (head order, then increasing i: the CPU's order) in the double scratch
// `acc` [B*KV*S, 2d], stored rounded after the last head.
template <typename T>
__global__ void attention_backward_kv_kernel(const T* dout, const T* qkv, const T* probs, Dims dm,
                                             double scale, const double* rowdot, double* acc,
                                             T* dqkv) {
  extern __shared__ double dsc[];  // [seq]: dS_ij for i >= j
  const int64_t seq = dm.seq, d = dm.d, h = dm.heads * d, w = dm.width(), r = dm.heads / dm.kv;
  const int64_t j = blockIdx.x % seq, g = (blockIdx.x / seq) % dm.kv,
                b = blockIdx.x / (seq * dm.kv);
  const int64_t k_col = dm.k_col(g * r), v_col = dm.v_col(g * r);
  double* kv_acc = acc + blockIdx.x * 2 * d;  // [dk (d), dv (d)]
  for (int64_t c = threadIdx.x; c < 2 * d; c += blockDim.x) kv_acc[c] = 0.0;
  const T* v = qkv + (b * seq + j) * w + v_col;
  for (int64_t a = g * r; a < (g + 1) * r; ++a) {
    const int64_t q_col = dm.q_col(a);
    const int64_t head_rows = (b * dm.heads + a) * seq;  // first row of this (b, a) in probs
    __syncthreads();                                     // dsc of the previous head fully read
    for (int64_t i = j + threadIdx.x; i < seq; i += blockDim.x) {
      const T* dorow = dout + (b * seq + i) * h + a * d;
      double dp = 0.0;
      for (int64_t c = 0; c < d; ++c)
        dp = __dadd_rn(dp, __dmul_rn(detail::load(dorow, c), detail::load(v, c)));
      const double p = detail::load(probs, (head_rows + i) * seq + j);
      dsc[i] = __dmul_rn(__dmul_rn(p, __dsub_rn(dp, rowdot[head_rows + i])), scale);
    }
    __syncthreads();
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      double dk = kv_acc[c], dv = kv_acc[d + c];
      for (int64_t i = j; i < seq; ++i) {
        const double p = detail::load(probs, (head_rows + i) * seq + j);
        dv = __dadd_rn(dv, __dmul_rn(p, detail::load(dout, (b * seq + i) * h + a * d + c)));
        dk = __dadd_rn(dk, __dmul_rn(dsc[i], detail::load(qkv, (b * seq + i) * w + q_col + c)));
      }
      kv_acc[c] = dk;
      kv_acc[d + c] = dv;
    }
  }
  T* row = dqkv + (b * seq + j) * w;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    detail::store_d(row + k_col, c, kv_acc[c]);
    detail::store_d(row + v_col, c, kv_acc[d + c]);
  }
}

// RoPE: one thread per (row, rotated head, pair); the CPU's double formula with explicit
// rounding, so the result is bitwise the CPU's given the same cos/sin table.
template <typename T>
__global__ void rope_kernel(T* qkv, Dims dm, const double* cos_sin, int64_t total) {
  const int64_t half = dm.d / 2, r = dm.heads / dm.kv, rotated = dm.kv * (r + 1);
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < total;
       n += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = n % half, hh = (n / half) % rotated, flat = n / (half * rotated);
    const int64_t t = flat % dm.seq, g = hh / (r + 1), k = hh % (r + 1);
    T* head = qkv + flat * dm.width() + g * (r + 2) * dm.d + k * dm.d;
    const double x0 = detail::load(head, 2 * i), x1 = detail::load(head, 2 * i + 1);
    const double co = cos_sin[(t * half + i) * 2], si = cos_sin[(t * half + i) * 2 + 1];
    detail::store_d(head, 2 * i, __dsub_rn(__dmul_rn(x0, co), __dmul_rn(x1, si)));
    detail::store_d(head, 2 * i + 1, __dadd_rn(__dmul_rn(x0, si), __dmul_rn(x1, co)));
  }
}

template <typename T>
cudaError_t forward(const void* qkv, Dims dm, void* out, void* probs, void* stream) {
  const auto blocks = static_cast<unsigned>(dm.batch * dm.heads * dm.seq);
  const size_t shmem = static_cast<size_t>(dm.seq) * sizeof(double);
  attention_forward_kernel<T><<<blocks, kAttnThreads, shmem, detail::as_stream(stream)>>>(
      static_cast<const T*>(qkv), dm, 1.0 / sqrt(static_cast<double>(dm.d)), static_cast<T*>(out),
      static_cast<T*>(probs));
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward(const void* dout, const void* qkv, const void* probs, Dims dm, double* rowdot,
                     double* kv_acc, void* dqkv, void* stream) {
  const auto blocks = static_cast<unsigned>(dm.batch * dm.heads * dm.seq);
  const auto kv_blocks = static_cast<unsigned>(dm.batch * dm.kv * dm.seq);
  const size_t shmem = static_cast<size_t>(dm.seq) * sizeof(double);
  const double scale = 1.0 / sqrt(static_cast<double>(dm.d));
  auto s = detail::as_stream(stream);
  attention_backward_q_kernel<T><<<blocks, kAttnThreads, shmem, s>>>(
      static_cast<const T*>(dout), static_cast<const T*>(qkv), static_cast<const T*>(probs), dm,
      scale, rowdot, static_cast<T*>(dqkv));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  attention_backward_kv_kernel<T><<<kv_blocks, kAttnThreads, shmem, s>>>(
      static_cast<const T*>(dout), static_cast<const T*>(qkv), static_cast<const T*>(probs), dm,
      scale, rowdot, kv_acc, static_cast<T*>(dqkv));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_attention_forward(const void* qkv, bool bf16, int64_t batch, int64_t seq,
                                     int64_t heads, int64_t head_dim, int64_t kv_heads, void* out,
                                     void* probs, void* stream) {
  const Dims dm{batch, seq, heads, head_dim, kv_heads};
  return bf16 ? forward<uint16_t>(qkv, dm, out, probs, stream)
              : forward<float>(qkv, dm, out, probs, stream);
}

cudaError_t launch_attention_backward(const void* dout, const void* qkv, const void* probs,
                                      bool bf16, int64_t batch, int64_t seq, int64_t heads,
                                      int64_t head_dim, int64_t kv_heads, double* row_scratch,
                                      double* kv_scratch, void* dqkv, void* stream) {
  const Dims dm{batch, seq, heads, head_dim, kv_heads};
  return bf16 ? backward<uint16_t>(dout, qkv, probs, dm, row_scratch, kv_scratch, dqkv, stream)
              : backward<float>(dout, qkv, probs, dm, row_scratch, kv_scratch, dqkv, stream);
}

cudaError_t launch_rope(void* qkv, bool bf16, int64_t batch, int64_t seq, int64_t heads,
                        int64_t head_dim, int64_t kv_heads, const double* cos_sin, void* stream) {
  const Dims dm{batch, seq, heads, head_dim, kv_heads};
  const int64_t total = batch * seq * kv_heads * (heads / kv_heads + 1) * (head_dim / 2);
  if (total == 0) return cudaSuccess;
  auto s = detail::as_stream(stream);
  if (bf16) {
    rope_kernel<uint16_t><<<detail::grid_1d(total), detail::kThreads, 0, s>>>(
        static_cast<uint16_t*>(qkv), dm, cos_sin, total);
  } else {
    rope_kernel<float><<<detail::grid_1d(total), detail::kThreads, 0, s>>>(static_cast<float*>(qkv),
                                                                           dm, cos_sin, total);
  }
  return cudaGetLastError();
}

}  // namespace meshproof::kernels::cuda
