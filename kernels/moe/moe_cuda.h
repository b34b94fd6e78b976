// Launchers of the MoE kernels (moe_route.cu, moe_rows.cu), called by kernels/moe/moe_route.cc and
// kernels/moe/moe_rows.cc after their checks. Plain pointers and sizes only (every pointer a device
// pointer), `stream` the rank's cudaStream_t; each returns the launch status as an int
// (cudaError_t), so this header has no CUDA dependency.
#pragma once

#include <cstdint>

namespace meshproof::kernels::cuda {

// One thread per token: route_row on float32 logits (the router runs in fp32; float64 logits are
// the CPU's finite-difference mode).
int launch_moe_route(const float* logits, int64_t tokens, int64_t experts, int64_t top_k,
                     bool sigmoid, double* probs, int32_t* expert, double* weight, void* stream);
// counts int64 [E]: one block per expert, a fixed-order block sum of the matching pairs.
int launch_moe_expert_counts(const int32_t* expert, int64_t pairs, int64_t experts, int64_t* counts,
                             void* stream);
// sums float64 [E]: one thread per expert, the tokens in order.
int launch_moe_prob_sums(const double* probs, int64_t tokens, int64_t experts, double* sums,
                         void* stream);
// out [T, E] (float32, bfloat16 bits when `bf16`): route_backward_row per token into `scratch`
// float64 [T, E], then rounded once into out.
int launch_moe_route_backward(const double* probs, const int32_t* expert, const double* weight,
                              const double* d_weight, const double* aux, int64_t tokens,
                              int64_t experts, int64_t top_k, bool sigmoid, double* scratch,
                              void* out, bool bf16, void* stream);

// token int64 [P] (pre-filled with -1 here), slot int64 [T k]: one block per expert computes its
// block start from counts int64 [E] and scans the pairs in order with a block prefix sum.
int launch_moe_dispatch(const int32_t* expert, int64_t pairs, int64_t top_k, int64_t experts,
                        const int64_t* counts, int64_t align, bool keep_empty, int64_t padded,
                        int64_t* token, int64_t* slot, void* stream);
// out [P, row_bytes]: the row of token[p] or zeros.
int launch_moe_permute(const void* x, int64_t row_bytes, const int64_t* token, int64_t padded,
                       void* out, void* stream);
// Element types of y, dout, out and dy: 0 float32, 1 bfloat16 (the activations' dtypes on a
// device).
int launch_moe_combine(const void* y, int y_type, const int64_t* slot, const double* weight,
                       int64_t tokens, int64_t top_k, int64_t width, void* out, int out_type,
                       void* stream);
int launch_moe_combine_backward(const void* dout, int dout_type, const void* y, int y_type,
                                const int64_t* slot, const double* weight, int64_t tokens,
                                int64_t top_k, int64_t width, int64_t padded, void* dy, int dy_type,
                                double* d_weight, void* stream);

}  // namespace meshproof::kernels::cuda
