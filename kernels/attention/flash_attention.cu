// CUDA fused causal attention (kernels/attention/flash_attention.h): tiles of keys in shared
// memory, one warp per row, an online softmax in float32; the [B, A, S, S] probabilities never
// exist.
//   forward, grid (ceil(S / kRows), A, B), kRows warps: warp w owns query row i = tile * kRows + w,
//     keeps q_i and its output accumulator in registers (lane L holds columns L, L+32, ...), and
//     walks the key tiles j0 = 0, T, 2T, ... up to the block's last row. Per tile: lane jj gets
//     score s_ij (a warp-sum of the lanes' partial dots), the tile max updates m, the accumulator
//     and l are rescaled by exp(m_old - m_new) once per tile, then o += p_ij v_j key by key.
//     out_i = o / l (stored in the activation dtype), lse_i = m + log(l) (float32).
//   backward, two kernels (no atomics, so deterministic):
//     dQ, grid as the forward: D_i = sum_c dO_ic O_ic (saved to d_scratch), then over key tiles
//       j <= i: p = exp(s_ij - lse_i), ds = p (dO_i . v_j - D_i) scale, dQ_i += ds k_j;
//     dK/dV, grid (ceil(S / kRows), KV, B): warp w owns key row j; for each query head of the
//       group in head order, query tiles i >= j (Q, dO, lse and D of the tile in shared memory):
//       dV_j += p dO_i, dK_j += ds q_i; stored after the group's last head.
// The block-wide loops (tile loads and __syncthreads) run the same trip count in every warp;
// only the per-row work is skipped by warps whose row is past S or before the tile (warp-uniform
// branches), so every shuffle has all 32 lanes and every barrier all warps.
#include "kernels/ops/ops_cuda.h"
#include "kernels/ops/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kRows = 8;         // warps (rows) per block
constexpr int kMaxPerLane = 8;   // head_dim <= 256
constexpr int kMaxKeyTile = 32;  // one score per lane
constexpr unsigned kFull = 0xffffffffu;

struct FlashDims {
  int64_t batch, seq, heads, d, kv;
  // The grouped qkv layout of kernels/attention/attention.h.
  __device__ int64_t width() const { return (heads + 2 * kv) * d; }
  __device__ int64_t group_base(int64_t a) const {
    return (a / (heads / kv)) * (heads / kv + 2) * d;
  }
  __device__ int64_t q_col(int64_t a) const { return group_base(a) + (a % (heads / kv)) * d; }
  __device__ int64_t k_col(int64_t a) const { return group_base(a) + (heads / kv) * d; }
  __device__ int64_t v_col(int64_t a) const { return k_col(a) + d; }
};

// Butterfly reductions: every lane ends with the same value (IEEE + and max are commutative, so
// partner lanes compute identical results at each step).
__device__ inline float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, off));
  return v;
}

// Lane `lane`'s columns of a d-vector at p (zeros past d).
template <typename T>
__device__ inline void load_row(const T* p, int64_t d, int lane, float (&r)[kMaxPerLane]) {
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t c = lane + t * kWarp;
    r[t] = c < d ? detail::load(p, c) : 0.0f;
  }
}

template <typename T>
__device__ inline void store_row(T* p, int64_t d, int lane, const float (&r)[kMaxPerLane]) {
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t c = lane + t * kWarp;
    if (c < d) detail::store(p, c, r[t]);
  }
}

// sum_c a_c * tile[c] over the lane's columns, then across the warp.
__device__ inline float warp_dot(const float (&a)[kMaxPerLane], const float* tile, int64_t d,
                                 int lane) {
  float part = 0.0f;
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t c = lane + t * kWarp;
    if (c < d) part = fmaf(a[t], tile[c], part);
  }
  return warp_sum(part);
}

// Rows [row0, row0 + tile) of columns [col, col + d) of a [rows, width] matrix into dst [tile][d]
// as float (zeros past `rows`), by the whole block.
template <typename T>
__device__ inline void load_tile(const T* base, int64_t width, int64_t col, int64_t row0,
                                 int64_t rows, int tile, int64_t d, float* dst) {
  for (int64_t idx = threadIdx.x; idx < tile * d; idx += blockDim.x) {
    const int64_t jj = idx / d, c = idx % d;
    dst[idx] = row0 + jj < rows ? detail::load(base + (row0 + jj) * width + col, c) : 0.0f;
  }
}

template <typename T>
__global__ void __launch_bounds__(kRows* kWarp)
    flash_forward_kernel(const T* qkv, FlashDims dm, int tile, float scale, T* out, float* lse) {
  extern __shared__ float smem[];  // K tile [tile][d], then V tile [tile][d]
  float* ks = smem;
  float* vs = smem + tile * dm.d;
  const int lane = static_cast<int>(threadIdx.x) & (kWarp - 1);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t a = blockIdx.y, b = blockIdx.z, seq = dm.seq, d = dm.d, w = dm.width();
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRows, i = i0 + warp;
  const bool active = i < seq;
  const T* rows = qkv + b * seq * w;  // this batch's rows
  float q[kMaxPerLane], o[kMaxPerLane];
  load_row(rows + (active ? i : 0) * w + dm.q_col(a), d, lane, q);
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) o[t] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int64_t last = (i0 + kRows < seq ? i0 + kRows : seq) - 1;  // block-uniform
  for (int64_t j0 = 0; j0 <= last; j0 += tile) {
    __syncthreads();  // every warp is done with the previous tile
    load_tile(rows, w, dm.k_col(a), j0, seq, tile, d, ks);
    load_tile(rows, w, dm.v_col(a), j0, seq, tile, d, vs);
    __syncthreads();
    if (!active || j0 > i) continue;                                        // warp-uniform
    const int n = static_cast<int>(tile < i + 1 - j0 ? tile : i + 1 - j0);  // keys j <= i
    float s_mine = -INFINITY;  // lane jj: the score of key j0 + jj
    for (int jj = 0; jj < n; ++jj) {
      const float s = warp_dot(q, ks + jj * d, d, lane) * scale;
      if (lane == jj) s_mine = s;
    }
    const float m_new = fmaxf(m, warp_max(s_mine));
    const float alpha = expf(m - m_new);  // 0 on the first tile (m = -inf, m_new finite)
    const float p_mine = lane < n ? expf(s_mine - m_new) : 0.0f;
    l = l * alpha + warp_sum(p_mine);
#pragma unroll
    for (int t = 0; t < kMaxPerLane; ++t) o[t] *= alpha;
    for (int jj = 0; jj < n; ++jj) {
      const float p = __shfl_sync(kFull, p_mine, jj);
      const float* v = vs + jj * d;
#pragma unroll
      for (int t = 0; t < kMaxPerLane; ++t) {
        const int64_t c = lane + t * kWarp;
        if (c < d) o[t] = fmaf(p, v[c], o[t]);
      }
    }
    m = m_new;
  }
  if (!active) return;
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) o[t] = o[t] / l;
  store_row(out + (b * seq + i) * dm.heads * d + a * d, d, lane, o);
  if (lane == 0) lse[(b * dm.heads + a) * seq + i] = m + logf(l);
}

template <typename T>
__global__ void __launch_bounds__(kRows* kWarp)
    flash_backward_dq_kernel(const T* dout, const T* qkv, const T* out, const float* lse,
                             FlashDims dm, int tile, float scale, float* big_d, T* dqkv) {
  extern __shared__ float smem[];  // K tile [tile][d], then V tile [tile][d]
  float* ks = smem;
  float* vs = smem + tile * dm.d;
  const int lane = static_cast<int>(threadIdx.x) & (kWarp - 1);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t a = blockIdx.y, b = blockIdx.z, seq = dm.seq, d = dm.d, w = dm.width();
  const int64_t h = dm.heads * d;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRows, i = i0 + warp;
  const bool active = i < seq;
  const int64_t ii = active ? i : 0;
  const int64_t row = (b * dm.heads + a) * seq + ii;  // (b, a, i) in lse / D
  const T* rows = qkv + b * seq * w;
  float q[kMaxPerLane], dO[kMaxPerLane], dq[kMaxPerLane];
  load_row(rows + ii * w + dm.q_col(a), d, lane, q);
  load_row(dout + (b * seq + ii) * h + a * d, d, lane, dO);
  load_row(out + (b * seq + ii) * h + a * d, d, lane, dq);  // O_i, only for D_i
  float part = 0.0f;
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) part = fmaf(dO[t], dq[t], part);  // zeros past d
  const float big_di = warp_sum(part);                                    // D_i = dO_i . O_i
  if (active && lane == 0) big_d[row] = big_di;
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) dq[t] = 0.0f;
  const float lse_i = active ? lse[row] : 0.0f;
  const int64_t last = (i0 + kRows < seq ? i0 + kRows : seq) - 1;
  for (int64_t j0 = 0; j0 <= last; j0 += tile) {
    __syncthreads();
    load_tile(rows, w, dm.k_col(a), j0, seq, tile, d, ks);
    load_tile(rows, w, dm.v_col(a), j0, seq, tile, d, vs);
    __syncthreads();
    if (!active || j0 > i) continue;
    const int n = static_cast<int>(tile < i + 1 - j0 ? tile : i + 1 - j0);
    for (int jj = 0; jj < n; ++jj) {
      const float s = warp_dot(q, ks + jj * d, d, lane) * scale;
      const float dp = warp_dot(dO, vs + jj * d, d, lane);
      const float p = expf(s - lse_i);
      const float ds = p * (dp - big_di) * scale;
      const float* k = ks + jj * d;
#pragma unroll
      for (int t = 0; t < kMaxPerLane; ++t) {
        const int64_t c = lane + t * kWarp;
        if (c < d) dq[t] = fmaf(ds, k[c], dq[t]);
      }
    }
  }
  if (!active) return;
  store_row(dqkv + (b * seq + i) * w + dm.q_col(a), d, lane, dq);
}

template <typename T>
__global__ void __launch_bounds__(kRows* kWarp)
    flash_backward_kv_kernel(const T* dout, const T* qkv, const float* lse, const float* big_d,
                             FlashDims dm, int tile, float scale, T* dqkv) {
  // Q tile [tile][d], dO tile [tile][d], then lse and D of the tile's rows [tile] each.
  extern __shared__ float smem[];
  float* qs = smem;
  float* dos = smem + tile * dm.d;
  float* ls = smem + 2 * tile * dm.d;
  float* dd = ls + tile;
  const int lane = static_cast<int>(threadIdx.x) & (kWarp - 1);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t g = blockIdx.y, b = blockIdx.z, seq = dm.seq, d = dm.d, w = dm.width();
  const int64_t h = dm.heads * d, r = dm.heads / dm.kv;
  const int64_t j_first = static_cast<int64_t>(blockIdx.x) * kRows, j = j_first + warp;
  const bool active = j < seq;
  const T* rows = qkv + b * seq * w;
  float k[kMaxPerLane], v[kMaxPerLane], dk[kMaxPerLane], dv[kMaxPerLane];
  load_row(rows + (active ? j : 0) * w + dm.k_col(g * r), d, lane, k);
  load_row(rows + (active ? j : 0) * w + dm.v_col(g * r), d, lane, v);
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) dk[t] = dv[t] = 0.0f;
  for (int64_t a = g * r; a < (g + 1) * r; ++a) {
    const int64_t head_rows = (b * dm.heads + a) * seq;
    // Queries i >= j: the block's first key row bounds every warp's range from below.
    for (int64_t i0 = j_first; i0 < seq; i0 += tile) {
      __syncthreads();
      load_tile(rows, w, dm.q_col(a), i0, seq, tile, d, qs);
      load_tile(dout + b * seq * h, h, a * d, i0, seq, tile, d, dos);
      for (int64_t x = threadIdx.x; x < tile; x += blockDim.x) {
        const bool in = i0 + x < seq;
        ls[x] = in ? lse[head_rows + i0 + x] : 0.0f;
        dd[x] = in ? big_d[head_rows + i0 + x] : 0.0f;
      }
      __syncthreads();
      if (!active) continue;
      const int64_t n = tile < seq - i0 ? tile : seq - i0;
      for (int64_t x = j > i0 ? j - i0 : 0; x < n; ++x) {  // i = i0 + x >= j
        const float s = warp_dot(k, qs + x * d, d, lane) * scale;
        const float dp = warp_dot(v, dos + x * d, d, lane);
        const float p = expf(s - ls[x]);
        const float ds = p * (dp - dd[x]) * scale;
        const float* qrow = qs + x * d;
        const float* dorow = dos + x * d;
#pragma unroll
        for (int t = 0; t < kMaxPerLane; ++t) {
          const int64_t c = lane + t * kWarp;
          if (c < d) {
            dv[t] = fmaf(p, dorow[c], dv[t]);
            dk[t] = fmaf(ds, qrow[c], dk[t]);
          }
        }
      }
    }
  }
  if (!active) return;
  T* dst = dqkv + (b * seq + j) * w;
  store_row(dst + dm.k_col(g * r), d, lane, dk);
  store_row(dst + dm.v_col(g * r), d, lane, dv);
}

// The dynamic shared memory a kernel may take without opting in (cudaFuncSetAttribute): the
// backward dK/dV kernel's two [tile][d] float tiles and two [tile] vectors must fit, so a tile of
// 32 keys allows head_dim <= 191 (kFlashKeyTile picks 16 above 128).
constexpr int64_t kDefaultSharedBytes = 48 * 1024;

bool bad_shape(int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t kv_heads,
               int64_t key_tile) {
  return batch <= 0 || seq <= 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 ||
         head_dim <= 0 || head_dim > kMaxPerLane * kWarp || key_tile <= 0 ||
         key_tile > kMaxKeyTile || heads > 65535 || batch > 65535 ||
         (seq + kRows - 1) / kRows > 0x7fffffff ||
         (2 * key_tile * head_dim + 2 * key_tile) * static_cast<int64_t>(sizeof(float)) >
             kDefaultSharedBytes;
}

template <typename T>
cudaError_t forward(const void* qkv, FlashDims dm, int tile, void* out, float* lse, void* stream) {
  const dim3 grid(static_cast<unsigned>((dm.seq + kRows - 1) / kRows),
                  static_cast<unsigned>(dm.heads), static_cast<unsigned>(dm.batch));
  const size_t shmem = 2 * static_cast<size_t>(tile) * static_cast<size_t>(dm.d) * sizeof(float);
  const float scale = 1.0f / sqrtf(static_cast<float>(dm.d));
  flash_forward_kernel<T><<<grid, kRows * kWarp, shmem, detail::as_stream(stream)>>>(
      static_cast<const T*>(qkv), dm, tile, scale, static_cast<T*>(out), lse);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward(const void* dout, const void* qkv, const void* out, const float* lse,
                     FlashDims dm, int tile, float* big_d, void* dqkv, void* stream) {
  const unsigned row_tiles = static_cast<unsigned>((dm.seq + kRows - 1) / kRows);
  const float scale = 1.0f / sqrtf(static_cast<float>(dm.d));
  const size_t tiles = 2 * static_cast<size_t>(tile) * static_cast<size_t>(dm.d) * sizeof(float);
  auto s = detail::as_stream(stream);
  flash_backward_dq_kernel<T>
      <<<dim3(row_tiles, static_cast<unsigned>(dm.heads), static_cast<unsigned>(dm.batch)),
         kRows * kWarp, tiles, s>>>(static_cast<const T*>(dout), static_cast<const T*>(qkv),
                                    static_cast<const T*>(out), lse, dm, tile, scale, big_d,
                                    static_cast<T*>(dqkv));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  // Same stream: the dK/dV kernel starts after every D_i is written.
  flash_backward_kv_kernel<T>
      <<<dim3(row_tiles, static_cast<unsigned>(dm.kv), static_cast<unsigned>(dm.batch)),
         kRows * kWarp, tiles + 2 * static_cast<size_t>(tile) * sizeof(float), s>>>(
          static_cast<const T*>(dout), static_cast<const T*>(qkv), lse, big_d, dm, tile, scale,
          static_cast<T*>(dqkv));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_flash_attention_forward(const void* qkv, bool bf16, int64_t batch, int64_t seq,
                                           int64_t heads, int64_t head_dim, int64_t kv_heads,
                                           int64_t key_tile, void* out, float* lse, void* stream) {
  if (bad_shape(batch, seq, heads, head_dim, kv_heads, key_tile)) return cudaErrorInvalidValue;
  const FlashDims dm{batch, seq, heads, head_dim, kv_heads};
  const int tile = static_cast<int>(key_tile);
  return bf16 ? forward<uint16_t>(qkv, dm, tile, out, lse, stream)
              : forward<float>(qkv, dm, tile, out, lse, stream);
}

cudaError_t launch_flash_attention_backward(const void* dout, const void* qkv, const void* out,
                                            const float* lse, bool bf16, int64_t batch, int64_t seq,
                                            int64_t heads, int64_t head_dim, int64_t kv_heads,
                                            int64_t key_tile, float* d_scratch, void* dqkv,
                                            void* stream) {
  if (bad_shape(batch, seq, heads, head_dim, kv_heads, key_tile)) return cudaErrorInvalidValue;
  const FlashDims dm{batch, seq, heads, head_dim, kv_heads};
  const int tile = static_cast<int>(key_tile);
  return bf16 ? backward<uint16_t>(dout, qkv, out, lse, dm, tile, d_scratch, dqkv, stream)
              : backward<float>(dout, qkv, out, lse, dm, tile, d_scratch, dqkv, stream);
}

}  // namespace meshproof::kernels::cuda
