// Launchers of the CUDA kernels of the model's op families (one .cu per family: activation.cu,
// adamw.cu, attention.cu, cast.cu, cross_entropy.cu, elementwise.cu, embedding.cu,
// flash_attention.cu, layernorm.cu), called by the device dispatch in the matching .cc after its
// shape/dtype checks. Plain pointers and sizes only; every pointer is a device pointer, `stream` is
// the rank's cudaStream_t (kernels::current_context().stream). Kernels are enqueued asynchronously
// and each launcher returns the launch status (the .cc checks it with MP_CUDA_CHECK; the .cu files
// use no MP_* macros and no fmt).
//
// Element types: activations are float32 or bfloat16 (`bf16` selects; bf16 is read as float and
// written with RNE via kernels/core/formats.h, like the CPU BFloat16); parameter gradients are
// float32. float64 is CPU-only (the dispatch rejects it).
//
// Numerics against the CPU reference (the same formulas, evaluated in double where the CPU uses
// double; explicit __*_rn intrinsics wherever the CPU result must be matched bit for bit, so nvcc
// cannot contract a*b+c into an FMA the CPU does not do):
//   bitwise: cast, add_bias_, add_, scale_, dropout masks and outputs, AdamW, embedding forward,
//     embedding backward (same per-row summation order).
//   bitwise given the same saved probabilities: attention backward.
//   deterministic (bitwise run to run) but not bitwise to the CPU: bias_grad and the
//     LayerNorm/RMSNorm dweight/dbias, parallel per-column reductions whose fixed order
//     (kernels/ops/column_reduce.h, reproduced on the host by column_sum_fixed_order) differs from
//     the CPU's serial row sum: within 1 ulp of float32 + 2 m 2^-53 (|g0| + sum_r |t_r|) of the
//     CPU.
//   1 ulp of the stored dtype, plus ~1e-15 of the largest magnitude where the formula cancels:
//     activations (device tanh/exp in double differ from glibc's by ~1 ulp of double), norm
//     outputs and dx (block tree reductions in double instead of a serial double sum: ~1e-15
//     relative before the final rounding), attention forward (max/sum serial in the CPU order;
//     only the device exp differs; out within 2 ulp(1) * max|v| since it sums rounded probs),
//     cross entropy (block reductions in double; the loss within ~1e-15 relative).
//   float32 arithmetic against the double reference: the fused attention (flash_attention.cu),
//     within the bound derived in tests/kernels/attention/flash_attention_bound.h.
// tests/kernels/ops/ops_cuda_test.cc checks each of these statements.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace meshproof::kernels::cuda {

// cast.cu: dst[i] = src[i] converted (float32 <-> bfloat16, RNE).
cudaError_t launch_cast(const void* src, bool src_bf16, void* dst, bool dst_bf16, int64_t n,
                        void* stream);

// elementwise.cu
cudaError_t launch_add_bias(void* y, const void* bias, bool bf16, int64_t m, int64_t n,
                            void* stream);
// dbias[c] = float(dbias[c] + sum_r dy[r, c]): a parallel per-column sum in double in the fixed
// order of kernels/ops/column_reduce.h; `partial` is a device scratch of column_chunks(m) * n
// doubles.
cudaError_t launch_bias_grad(const void* dy, bool bf16, int64_t m, int64_t n, double* partial,
                             float* dbias, void* stream);
cudaError_t launch_add(void* x, const void* y, bool bf16, int64_t n, void* stream);
cudaError_t launch_scale(void* x, bool bf16, int64_t n, double alpha, void* stream);
// out[i] = keep(i) ? in[i] / (1-p) : 0 with keep(i) = philox_uniform(seed, stream_id, first + i)
// >= p; p == 0 copies.
cudaError_t launch_dropout(const void* in, void* out, bool bf16, int64_t n, double p, uint64_t seed,
                           uint64_t stream_id, uint64_t first_index, void* stream);

// activation.cu
cudaError_t launch_gelu_forward(const void* x, void* y, bool bf16, int64_t n, void* stream);
cudaError_t launch_gelu_backward(const void* dy, const void* x, void* dx, bool bf16, int64_t n,
                                 void* stream);
cudaError_t launch_relu_forward(const void* x, void* y, bool bf16, int64_t n, void* stream);
cudaError_t launch_relu_backward(const void* dy, const void* x, void* dx, bool bf16, int64_t n,
                                 void* stream);
cudaError_t launch_swiglu_forward(const void* gate, const void* up, void* y, bool bf16, int64_t n,
                                  void* stream);
cudaError_t launch_swiglu_backward(const void* dy, const void* gate, const void* up, void* dgate,
                                   void* dup, bool bf16, int64_t n, void* stream);

// layernorm.cu: x [m, h]; mean (nullptr for RMSNorm) and rstd [m] in x's dtype; bias may be
// nullptr (RMSNorm); dweight/dbias float32 [h], accumulated into (dbias nullptr for RMSNorm) by
// per-column reductions in the order of kernels/ops/column_reduce.h; `partial` is a device scratch
// of (dbias ? 2 : 1) * column_chunks(m) * h doubles.
cudaError_t launch_norm_forward(const void* x, const void* weight, const void* bias, bool bf16,
                                bool rms, double eps, int64_t m, int64_t h, void* y, void* mean,
                                void* rstd, void* stream);
cudaError_t launch_norm_backward(const void* dy, const void* x, const void* weight,
                                 const void* mean, const void* rstd, bool bf16, int64_t m,
                                 int64_t h, void* dx, double* partial, float* dweight, float* dbias,
                                 void* stream);

// attention.cu: layouts of kernels/attention/attention.h (kv_heads KV groups, KV | heads).
// `row_scratch` is a device double buffer of batch*heads*seq elements, `kv_scratch` of
// batch*kv_heads*seq*2*d (backward only: a group's dk/dv summed over its heads).
cudaError_t launch_attention_forward(const void* qkv, bool bf16, int64_t batch, int64_t seq,
                                     int64_t heads, int64_t head_dim, int64_t kv_heads, void* out,
                                     void* probs, void* stream);
cudaError_t launch_attention_backward(const void* dout, const void* qkv, const void* probs,
                                      bool bf16, int64_t batch, int64_t seq, int64_t heads,
                                      int64_t head_dim, int64_t kv_heads, double* row_scratch,
                                      double* kv_scratch, void* dqkv, void* stream);
// flash_attention.cu: the fused attention of kernels/attention/flash_attention.h, float32
// arithmetic, lse float32 [batch*heads*seq]. `key_tile` (1..32) keys per shared-memory tile,
// head_dim <= 256; anything else returns cudaErrorInvalidValue. The backward's `d_scratch` is a
// device float buffer of batch*heads*seq elements (D_i, written by the dQ kernel, read by the dK/dV
// kernel).
cudaError_t launch_flash_attention_forward(const void* qkv, bool bf16, int64_t batch, int64_t seq,
                                           int64_t heads, int64_t head_dim, int64_t kv_heads,
                                           int64_t key_tile, void* out, float* lse, void* stream);
cudaError_t launch_flash_attention_backward(const void* dout, const void* qkv, const void* out,
                                            const float* lse, bool bf16, int64_t batch, int64_t seq,
                                            int64_t heads, int64_t head_dim, int64_t kv_heads,
                                            int64_t key_tile, float* d_scratch, void* dqkv,
                                            void* stream);
// RoPE in place on the q and k heads of a fused qkv (kernels/attention/attention.h); `cos_sin`
// holds (cos, sign*sin) per (s, pair i) as seq*(d/2)*2 doubles (computed on the host).
cudaError_t launch_rope(void* qkv, bool bf16, int64_t batch, int64_t seq, int64_t heads,
                        int64_t head_dim, int64_t kv_heads, const double* cos_sin, void* stream);

// cross_entropy.cu: row_loss[r] = logsumexp(logits[r]) - logits[r, target[r]] (double, device);
// dlogits (nullptr = forward only) = grad_scale * (softmax - onehot). A target outside [0, v)
// reads nothing: its row loss is NaN (the dispatch then scans the targets and reports it).
cudaError_t launch_cross_entropy(const void* logits, const int32_t* targets, bool bf16, int64_t m,
                                 int64_t v, double grad_scale, double* row_loss, void* dlogits,
                                 void* stream);
// out[0] = sum of row_loss[0..m) added in row order by one thread (the CPU's serial sum).
cudaError_t launch_row_sum(const double* row_loss, int64_t m, double* out, void* stream);
// Vocabulary-parallel pieces (kernels/ops/cross_entropy.h), per-row doubles on the device:
// row_max[r] = max_c logits[r, c] (-inf for v = 0).
cudaError_t launch_cross_entropy_shard_max(const void* logits, bool bf16, int64_t m, int64_t v,
                                           double* row_max, void* stream);
// sum_exp[r] = sum_c exp(logits[r, c] - row_max[r]); target_logit[r] = logits[r, t - vocab_begin]
// where this shard holds t = targets[r], 0 elsewhere, NaN for t outside [0, vocab).
cudaError_t launch_cross_entropy_shard_sums(const void* logits, const int32_t* targets, bool bf16,
                                            int64_t m, int64_t v, int64_t vocab_begin,
                                            int64_t vocab, const double* row_max, double* sum_exp,
                                            double* target_logit, void* stream);
// out[r] = every[r] op every[m + r] op ... op every[(ranks - 1) m + r] in rank order (op: max or
// +).
cudaError_t launch_combine_ranks(const double* every, int ranks, int64_t m, bool max, double* out,
                                 void* stream);
// log_z[r] = row_max[r] + log(sum_exp[r]); out[0] = sum over counted rows (sp_size 1: all; else
// those with (r % seq) / (seq / sp_size) == sp_rank) of log_z[r] - target_logit[r], in row order,
// by one thread. nan_on_bad_target: out[0] = NaN when any row's target_logit is NaN (counted or
// not), the signal to check the targets.
cudaError_t launch_cross_entropy_shard_loss(const double* row_max, const double* sum_exp,
                                            const double* target_logit, int64_t m, int64_t seq,
                                            int sp_size, int sp_rank, bool nan_on_bad_target,
                                            double* log_z, double* out, void* stream);
// dlogits[r, c] = grad_scale * (exp(logits[r, c] - log_z[r]) - [c == targets[r] - vocab_begin]).
cudaError_t launch_cross_entropy_shard_grad(const void* logits, const int32_t* targets, bool bf16,
                                            int64_t m, int64_t v, int64_t vocab_begin,
                                            const double* log_z, double grad_scale, void* dlogits,
                                            void* stream);

// embedding.cu: the first id outside [0, limit) of ids[0..n) (n < 2^31): *first = the smallest
// (uint64(i) << 32 | uint32(ids[i])) over such i, or ~0 when there is none (the launcher sets it).
cudaError_t launch_first_id_outside(const int32_t* ids, int64_t n, int64_t limit,
                                    unsigned long long* first, void* stream);
// x[b*S + s] = tok[ids[b, s] - vocab_begin] + pos[s] (ids checked on the device first); ids
// outside the `rows` held give a zero token row; pos may be nullptr (no position).
cudaError_t launch_embedding_forward(const int32_t* ids, const void* tok, const void* pos,
                                     int64_t vocab_begin, int64_t rows, bool bf16, int64_t batch,
                                     int64_t seq, int64_t h, void* x, void* stream);
// Deterministic backward without floating-point atomics, grouped on the device. dtok (nullptr:
// not computed): the flat positions f = b*S + s whose id lies in [vocab_begin, vocab_begin + rows)
// are grouped by token row with a stable counting sort (integer counts, a scan, then one warp
// placing positions in increasing order), and each row's positions are added in increasing order
// (the CPU's order). `scratch` holds 2 * rows + 1 + batch * seq int32. dpos (nullptr: not
// computed): for each s, batches b = 0..B-1 in order.
cudaError_t launch_embedding_backward(const void* dx, bool bf16, int64_t batch, int64_t seq,
                                      int64_t h, const int32_t* ids, int64_t vocab_begin,
                                      int64_t rows, int32_t* scratch, float* dtok, float* dpos,
                                      void* stream);

// adamw.cu: the float32 update of kernels/ops/adamw.h, operation for operation.
cudaError_t launch_adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                         int64_t n, bool decay_on, float decay, float beta1, float beta2,
                         float one_minus_beta1, float one_minus_beta2, float step_size,
                         float bc2_sqrt, float eps, void* stream);
// out[0] = sum of squares (double, fixed single-block tree order: deterministic).
cudaError_t launch_sum_of_squares(const void* x, bool bf16, int64_t n, double* out, void* stream);
// out[0] = sum over k of (sum over i of double(x[k][i])^2), each inner sum serial in index order
// and the outer one in k order, every operation a rounded double op: bitwise the host's
// sum_of_squares_total over float32 tensors. `partial` holds `count` doubles (scratch). One
// single-thread block per tensor (serial on purpose: the order is the contract).
cudaError_t launch_sum_of_squares_in_order(const float* const* x, const int64_t* n, int64_t count,
                                           double* partial, double* out, void* stream);

}  // namespace meshproof::kernels::cuda
