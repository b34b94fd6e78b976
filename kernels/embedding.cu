// CUDA token + position embedding (kernels/embedding.h). Forward is elementwise and bitwise the
// CPU's (tok + pos as one float add, RNE on a bf16 store). Backward is deterministic and atomic
// free: the dispatch groups the flat positions by token row on the host (counting sort, positions
// in increasing order), and one block per distinct row adds its positions in that order, one
// thread per column: the CPU's accumulation order, so dtok is bitwise the CPU's. dpos walks the
// batches in order per (s, column): bitwise as well.
#include "kernels/ops_cuda.h"
#include "kernels/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda {
namespace {

template <typename T>
__global__ void embedding_forward_kernel(const int32_t* ids, const T* tok, const T* pos,
                                         int64_t vocab_begin, int64_t rows, int64_t seq, int64_t h,
                                         int64_t total, T* x) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t flat = i / h, c = i % h, s = flat % seq;
    const int64_t row = ids[flat] - vocab_begin;
    const bool held = row >= 0 && row < rows;  // another shard's id: a zero row
    if (pos == nullptr) {
      detail::store(x, i, held ? detail::load(tok, row * h + c) : 0.0f);
    } else if (held) {
      detail::store(x, i, __fadd_rn(detail::load(tok, row * h + c), detail::load(pos, s * h + c)));
    } else {
      detail::store(x, i, detail::load(pos, s * h + c));
    }
  }
}

// Block k: token row row_ids[k]; threads stride over the columns.
template <typename T>
__global__ void embedding_dtok_kernel(const T* dx, int64_t h, const int32_t* row_ids,
                                      const int32_t* row_start, const int32_t* row_pos,
                                      float* dtok) {
  const int64_t k = blockIdx.x;
  float* tr = dtok + static_cast<int64_t>(row_ids[k]) * h;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    float acc = tr[c];
    for (int32_t e = row_start[k]; e < row_start[k + 1]; ++e)
      acc = __fadd_rn(acc, detail::load(dx, static_cast<int64_t>(row_pos[e]) * h + c));
    tr[c] = acc;
  }
}

template <typename T>
__global__ void embedding_dpos_kernel(const T* dx, int64_t batch, int64_t seq, int64_t h,
                                      float* dpos) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;  // s * h + c
  if (i >= seq * h) return;
  float acc = dpos[i];
  for (int64_t b = 0; b < batch; ++b) acc = __fadd_rn(acc, detail::load(dx, b * seq * h + i));
  dpos[i] = acc;
}

template <typename T>
cudaError_t forward(const int32_t* ids, const void* tok, const void* pos, int64_t vocab_begin,
                    int64_t rows, int64_t batch, int64_t seq, int64_t h, void* x, void* stream) {
  const int64_t total = batch * seq * h;
  if (total == 0) return cudaSuccess;
  embedding_forward_kernel<T>
      <<<detail::grid_1d(total), detail::kThreads, 0, detail::as_stream(stream)>>>(
          ids, static_cast<const T*>(tok), static_cast<const T*>(pos), vocab_begin, rows, seq, h,
          total, static_cast<T*>(x));
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward(const void* dx, int64_t batch, int64_t seq, int64_t h, const int32_t* row_ids,
                     const int32_t* row_start, const int32_t* row_pos, int64_t num_rows,
                     float* dtok, float* dpos, void* stream) {
  if (batch * seq * h == 0) return cudaSuccess;
  auto s = detail::as_stream(stream);
  if (num_rows > 0) {
    embedding_dtok_kernel<T><<<static_cast<unsigned>(num_rows), detail::kThreads, 0, s>>>(
        static_cast<const T*>(dx), h, row_ids, row_start, row_pos, dtok);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (dpos == nullptr) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((seq * h + detail::kThreads - 1) / detail::kThreads);
  embedding_dpos_kernel<T>
      <<<blocks, detail::kThreads, 0, s>>>(static_cast<const T*>(dx), batch, seq, h, dpos);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_embedding_forward(const int32_t* ids, const void* tok, const void* pos,
                                     int64_t vocab_begin, int64_t rows, bool bf16, int64_t batch,
                                     int64_t seq, int64_t h, void* x, void* stream) {
  return bf16 ? forward<uint16_t>(ids, tok, pos, vocab_begin, rows, batch, seq, h, x, stream)
              : forward<float>(ids, tok, pos, vocab_begin, rows, batch, seq, h, x, stream);
}

cudaError_t launch_embedding_backward(const void* dx, bool bf16, int64_t batch, int64_t seq,
                                      int64_t h, const int32_t* row_ids, const int32_t* row_start,
                                      const int32_t* row_pos, int64_t num_rows, float* dtok,
                                      float* dpos, void* stream) {
  return bf16 ? backward<uint16_t>(dx, batch, seq, h, row_ids, row_start, row_pos, num_rows, dtok,
                                   dpos, stream)
              : backward<float>(dx, batch, seq, h, row_ids, row_start, row_pos, num_rows, dtok,
                                dpos, stream);
}

}  // namespace meshproof::kernels::cuda
