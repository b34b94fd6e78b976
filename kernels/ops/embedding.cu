// CUDA token + position embedding (kernels/ops/embedding.h). Forward is elementwise and bitwise the
// CPU's (tok + pos as one float add, RNE on a bf16 store). Backward is deterministic without
// floating-point atomics: the flat positions are grouped by token row on the device (a stable
// counting sort: integer counts, one block's scan, one warp placing the positions in increasing
// order), and one block per row adds its positions in that order, one thread per column: the
// CPU's accumulation order, so dtok is bitwise the CPU's. dpos walks the batches in order per
// (s, column): bitwise as well. Ids are checked on the device (launch_first_id_outside); nothing
// crosses to the host but the check's 8-byte word (docs/design.md, "Host-device traffic per
// step").
#include "kernels/ops/ops_cuda.h"
#include "kernels/ops/ops_cuda_util.cuh"

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
    // The pass-through cases copy the stored bits, as the CPU does (through fp32 a signalling
    // bf16 NaN would come out quieted); T{} is +0 in both storage types.
    if (pos == nullptr) {
      x[i] = held ? tok[row * h + c] : T{};
    } else if (held) {
      detail::store(x, i, __fadd_rn(detail::load(tok, row * h + c), detail::load(pos, s * h + c)));
    } else {
      x[i] = pos[s * h + c];
    }
  }
}

__global__ void first_id_outside_kernel(const int32_t* ids, int64_t n, int64_t limit,
                                        unsigned long long* first) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t id = ids[i];
    if (id < 0 || id >= limit)
      atomicMin(first, (static_cast<unsigned long long>(i) << 32) | static_cast<uint32_t>(id));
  }
}

// counts[t] = number of flat positions whose id is vocab_begin + t, t in [0, rows). Integer
// atomics: the counts do not depend on the order.
__global__ void embedding_count_kernel(const int32_t* ids, int64_t n, int64_t vocab_begin,
                                       int64_t rows, int32_t* counts) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = ids[i] - vocab_begin;
    if (t >= 0 && t < rows) atomicAdd(counts + t, 1);
  }
}

constexpr int kScanThreads = 1024;

// One block: start[t] = sum of counts[0..t) for t in [0, rows], cursor[t] = start[t]. Thread k
// scans the contiguous chunk k of the rows; the chunk totals are scanned by thread 0 in order.
// Runs in place: `start` may alias `counts` (each thread reads its chunk before writing it).
__global__ void embedding_scan_kernel(int32_t* counts_then_start, int64_t rows, int32_t* cursor) {
  __shared__ int32_t chunk_base[kScanThreads + 1];
  const int64_t per = (rows + kScanThreads - 1) / kScanThreads;
  const int64_t lo = threadIdx.x * per, hi = lo + per < rows ? lo + per : rows;
  int32_t sum = 0;
  for (int64_t t = lo; t < hi; ++t) sum += counts_then_start[t];
  chunk_base[threadIdx.x + 1] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    chunk_base[0] = 0;
    for (int k = 1; k <= kScanThreads; ++k) chunk_base[k] += chunk_base[k - 1];
  }
  __syncthreads();
  int32_t run = chunk_base[threadIdx.x];
  for (int64_t t = lo; t < hi; ++t) {
    const int32_t c = counts_then_start[t];
    counts_then_start[t] = run;
    cursor[t] = run;
    run += c;
  }
  if (threadIdx.x == 0) counts_then_start[rows] = chunk_base[kScanThreads];
}

// One warp places the flat positions in increasing order: chunk by chunk of 32, a lane's slot is
// its row's cursor plus the number of lower lanes with the same row (__match_any_sync), then the
// highest of those lanes advances the cursor. Stable, so each row's positions increase.
__global__ void embedding_fill_kernel(const int32_t* ids, int64_t n, int64_t vocab_begin,
                                      int64_t rows, int32_t* cursor, int32_t* row_pos) {
  const unsigned lane = threadIdx.x;
  for (int64_t base = 0; base < n; base += 32) {
    const int64_t f = base + lane;
    int64_t t = -1;
    if (f < n) {
      t = ids[f] - vocab_begin;
      if (t < 0 || t >= rows) t = -1;
    }
    const unsigned peers = __match_any_sync(0xffffffffu, static_cast<long long>(t));
    const unsigned lower = peers & ((1u << lane) - 1u);
    int32_t slot = 0;
    if (t >= 0) slot = cursor[t] + __popc(lower);
    __syncwarp();
    if (t >= 0) {
      row_pos[slot] = static_cast<int32_t>(f);
      if (lane == 31u - static_cast<unsigned>(__clz(peers))) cursor[t] += __popc(peers);
    }
    __syncwarp();
  }
}

// Rows t = blockIdx.x, blockIdx.x + gridDim.x, ...: positions row_pos[start[t] .. start[t+1])
// added in order, threads striding over the columns; rows without positions are skipped.
template <typename T>
__global__ void embedding_dtok_kernel(const T* dx, int64_t h, int64_t rows, const int32_t* start,
                                      const int32_t* row_pos, float* dtok) {
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const int32_t b = start[t], e = start[t + 1];
    if (b == e) continue;
    float* tr = dtok + t * h;
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      float acc = tr[c];
      for (int32_t k = b; k < e; ++k)
        acc = __fadd_rn(acc, detail::load(dx, static_cast<int64_t>(row_pos[k]) * h + c));
      tr[c] = acc;
    }
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
cudaError_t backward(const void* dx, int64_t batch, int64_t seq, int64_t h, const int32_t* ids,
                     int64_t vocab_begin, int64_t rows, int32_t* scratch, float* dtok, float* dpos,
                     void* stream) {
  if (batch * seq * h == 0) return cudaSuccess;
  auto s = detail::as_stream(stream);
  const int64_t n = batch * seq;
  if (dtok != nullptr && rows > 0) {
    int32_t* start = scratch;            // [rows + 1]: the counts, then their exclusive scan
    int32_t* cursor = start + rows + 1;  // [rows]
    int32_t* row_pos = cursor + rows;    // [n]
    cudaError_t e = cudaMemsetAsync(start, 0, static_cast<size_t>(rows + 1) * sizeof(int32_t), s);
    if (e != cudaSuccess) return e;
    embedding_count_kernel<<<detail::grid_1d(n), detail::kThreads, 0, s>>>(ids, n, vocab_begin,
                                                                           rows, start);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    embedding_scan_kernel<<<1, kScanThreads, 0, s>>>(start, rows, cursor);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    embedding_fill_kernel<<<1, 32, 0, s>>>(ids, n, vocab_begin, rows, cursor, row_pos);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    const auto blocks = static_cast<unsigned>(rows < 65535 ? rows : 65535);
    embedding_dtok_kernel<T><<<blocks, detail::kThreads, 0, s>>>(static_cast<const T*>(dx), h, rows,
                                                                 start, row_pos, dtok);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
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
                                      int64_t h, const int32_t* ids, int64_t vocab_begin,
                                      int64_t rows, int32_t* scratch, float* dtok, float* dpos,
                                      void* stream) {
  return bf16 ? backward<uint16_t>(dx, batch, seq, h, ids, vocab_begin, rows, scratch, dtok, dpos,
                                   stream)
              : backward<float>(dx, batch, seq, h, ids, vocab_begin, rows, scratch, dtok, dpos,
                                stream);
}

cudaError_t launch_first_id_outside(const int32_t* ids, int64_t n, int64_t limit,
                                    unsigned long long* first, void* stream) {
  auto s = detail::as_stream(stream);
  cudaError_t e = cudaMemsetAsync(first, 0xff, sizeof(unsigned long long), s);
  if (e != cudaSuccess || n == 0) return e;
  first_id_outside_kernel<<<detail::grid_1d(n), detail::kThreads, 0, s>>>(ids, n, limit, first);
  return cudaGetLastError();
}

}  // namespace meshproof::kernels::cuda
