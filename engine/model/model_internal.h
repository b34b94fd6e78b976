// Internal to the model's forward and backward (engine/model/model.cc and the model_*.cc files
// beside it): what they share. The row helpers of the sequence-parallel layout (slice, place,
// gather and reduce-scatter of [B*S, C] activations) and the definitions of GptModel's private
// per-layer views, which every part of the pass reads: the parameter pointers (MlpParams,
// LayerParams), the saved activations (MlpActs, LayerActs) and the quantizing Linear. Only those
// files include it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/model.h"
#include "engine/model/recipe.h"
#include "engine/moe/moe.h"
#include "kernels/core/tensor.h"
#include "kernels/core/units.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ops/cast.h"
#include "kernels/ops/elementwise.h"
#include "kernels/quantize/quantize.h"
#include "kernels/quantize/quantized_tensor.h"
#include "mesh/core/communicator.h"

namespace meshproof::engine {

// The model files name these unqualified, as model.cc did when it held them all.
using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

namespace model_detail {

// Activations live on the rank's compute device (its RankContext: the CPU, or the GPU of a
// CUDA run); the weights handed in must be there too (checked in GptModel::run).
inline Tensor new_tensor(const Shape& shape, DType dtype) { return Tensor::empty(shape, dtype); }

// Copies `rows` rows of `src` starting at row `src_row` into `dst` at row `dst_row` (both
// [*, C] of the same dtype and width, on any device).
inline void copy_rows(Tensor& dst, int64_t dst_row, const Tensor& src, int64_t src_row,
                      int64_t rows) {
  const int64_t row_bytes = src.nbytes().value / std::max<int64_t>(src.shape()[0], 1);
  kernels::copy_bytes(static_cast<char*>(dst.raw_data()) + dst_row * row_bytes, dst.device(),
                      static_cast<const char*>(src.raw_data()) + src_row * row_bytes, src.device(),
                      kernels::Bytes{rows * row_bytes});
}

// Sequence-parallel layout of activations [B*S, C]: tp rank t holds rows b*S + s for
// s in [t*S/tp, (t+1)*S/tp), stored as [B, S/tp, C].
inline Tensor seq_slice(const Tensor& full, int64_t batch, int64_t seq, int tp, int t) {
  const int64_t sl = seq / tp, c = full.numel().value / (batch * seq);
  Tensor out = new_tensor({batch * sl, c}, full.dtype());
  const Tensor src = full.view({batch * seq, c});
  for (int64_t b = 0; b < batch; ++b) copy_rows(out, b * sl, src, b * seq + t * sl, sl);
  return out;
}

// The inverse placement: local rows written into a zero [B*S, C] tensor at their positions.
inline Tensor seq_place(const Tensor& local, int64_t batch, int64_t seq, int tp, int t) {
  const int64_t sl = seq / tp, c = local.numel().value / (batch * sl);
  Tensor out = Tensor::zeros({batch * seq, c}, local.dtype());
  const Tensor src = local.view({batch * sl, c});
  for (int64_t b = 0; b < batch; ++b) copy_rows(out, b * seq + t * sl, src, b * sl, sl);
  return out;
}

// All-gather along the sequence: local [B*S/tp, C] -> full [B*S, C] (any dtype, bytes moved).
inline Tensor seq_gather(mesh::Communicator& comm, const Tensor& local, int64_t batch,
                         int64_t seq) {
  const int tp = comm.size();
  const int64_t sl = seq / tp, c = local.numel().value / (batch * sl);
  Tensor all = new_tensor({tp * batch * sl, c}, local.dtype());
  comm.all_gather(local, all);
  Tensor out = new_tensor({batch * seq, c}, local.dtype());
  for (int t = 0; t < tp; ++t)
    for (int64_t b = 0; b < batch; ++b)
      copy_rows(out, b * seq + t * sl, all, (t * batch + b) * sl, sl);
  return out;
}

// Reduce-scatter (sum) along the sequence: full partial sums [B*S, C] -> this rank's summed
// sequence shard [B*S/tp, C]. fp32 reduction; bf16 travels as fp32 and is rounded once after.
inline Tensor seq_reduce_scatter(mesh::Communicator& comm, const Tensor& full, int64_t batch,
                                 int64_t seq) {
  const int tp = comm.size();
  const int64_t sl = seq / tp, c = full.numel().value / (batch * seq);
  const Tensor f32 =
      (full.dtype() == DType::kFloat32 ? full : kernels::cast_to(full, DType::kFloat32))
          .view({batch * seq, c});
  Tensor send = new_tensor({tp * batch * sl, c}, DType::kFloat32);
  for (int t = 0; t < tp; ++t)
    for (int64_t b = 0; b < batch; ++b)
      copy_rows(send, (t * batch + b) * sl, f32, b * seq + t * sl, sl);
  Tensor out = new_tensor({batch * sl, c}, DType::kFloat32);
  comm.reduce_scatter(send, out, mesh::ReduceOp::kSum);
  return full.dtype() == DType::kFloat32 ? out : kernels::cast_to(out, full.dtype());
}

}  // namespace model_detail

// The model files call these unqualified, as when they were file-local to model.cc.
using model_detail::copy_rows;
using model_detail::new_tensor;
using model_detail::seq_gather;
using model_detail::seq_place;
using model_detail::seq_reduce_scatter;
using model_detail::seq_slice;

// One MLP's parameters (the dense MLP, an expert, the shared expert): fc1 is the gate under SwiGLU,
// up_w only for SwiGLU; biases nullptr with model.bias = false.
template <class T>
struct GptModel::MlpParams {
  T* fc1_w = nullptr;  // [F, H] (fc1, or fc1_gate for SwiGLU)
  T* fc1_b = nullptr;  // [F]
  T* up_w = nullptr;   // [F, H] fc1_up (SwiGLU) or nullptr
  T* up_b = nullptr;
  T* fc2_w = nullptr;  // [H, F]
  T* fc2_b = nullptr;  // [H]
};

// Saved activations of one MLP over its rows (M, or an expert's padded block).
struct GptModel::MlpActs {
  Tensor fc1_out;    // [rows, F] (gate for SwiGLU)
  Tensor up_out;     // [rows, F] SwiGLU only
  Tensor act_out;    // [rows, F]
  Tensor gelu_tanh;  // [rows, F] float64, GELU on the CPU only: the forward's tanh(u), which the
                     // backward reads instead of computing it again (kernels/ops/activation.h)
};

// Parameters of one layer (norm biases absent for RMSNorm; fc1_up only for SwiGLU, where fc1 is
// the gate). An MoE layer (docs/design.md section 27) has no dense MLP (`mlp`'s pointers nullptr)
// and instead the router, the experts and the shared expert.
template <class T>
struct GptModel::LayerParams {
  T* ln1_w = nullptr;
  T* ln1_b = nullptr;   // [H] or nullptr (RMSNorm)
  T* qkv_w = nullptr;   // [(A + 2KV)d, H], rows grouped by KV head (kernels/attention/attention.h)
  T* qkv_b = nullptr;   // [(A + 2KV)d] or nullptr (model.bias = false; every linear bias alike)
  T* proj_w = nullptr;  // [H, H]
  T* proj_b = nullptr;  // [H]
  T* ln2_w = nullptr;
  T* ln2_b = nullptr;
  MlpParams<T> mlp;                   // the dense MLP
  T* router_w = nullptr;              // MoE: float32 [E, H]
  std::vector<MlpParams<T>> experts;  // MoE: E experts
  std::vector<MlpParams<T>> shared;   // MoE with shared_expert: one
};

// Saved activations of one layer (M = B*S rows).
struct GptModel::LayerActs {
  Tensor x_in;                         // [M, H] layer input
  Tensor ln1_out, ln1_mean, ln1_rstd;  // [M, H], [M], [M]
  Tensor qkv;                          // [M, (A + 2KV)d] (q and k rotated under RoPE)
  Tensor probs;                        // [B, A, S, S] (reference attention; undefined when fused)
  Tensor lse;  // [B, A, S] float32 (fused attention on CUDA, kernels/attention/flash_attention.h)
  Tensor attn_out;  // [M, H]
  Tensor x_mid;     // [M, H] after the attention residual
  Tensor ln2_out, ln2_mean, ln2_rstd;
  MlpActs mlp;   // the dense MLP ([M, F] each)
  Tensor x_out;  // [M, H] layer output
  // MoE layers (docs/design.md section 27), P = padded dispatched rows.
  Tensor router_in;      // [M, H] float32 copy of ln2_out (the router's input)
  moe::Routing routing;  // the top-k choice and combine weights
  moe::Dispatch dispatch;
  Tensor x_perm;           // [P, H] dispatched rows, zero padding rows
  MlpActs experts;         // [P, F] each, expert e in rows [offset[e], offset[e + 1])
  Tensor y_perm;           // [P, H] expert outputs
  MlpActs shared;          // [M, F] each (shared expert)
  Tensor shared_out;       // [M, H]
  moe::BalanceStats load;  // the global batch's load-balancing statistics (aux loss > 0)
  double aux_loss = 0;     // this layer's load-balancing loss (global)
  // Expert parallelism (TpContext::ep > 1): `dispatch` is the local layout (alignment 1),
  // x_perm / experts / y_perm are in the owner layout of `ep`, y_local [T k, H] the experts'
  // outputs back in the local layout.
  moe::EpExchange ep;
  Tensor y_local;
};

// The linear layers' GEMMs, quantized by the recipe when it is enabled. Forward operands (X, W)
// are saved per linear in `saved` (with their columnwise copies) for the backward GEMMs.
struct GptModel::Linear {
  Fp8Recipe* recipe = nullptr;  // nullptr or disabled: unquantized fp32/bf16 GEMMs
  bool backward = false;        // keep columnwise copies for the backward pass

  struct Saved {
    kernels::QuantizedTensor x, w;  // quantized forward operands
    // The expert_split_padding_too_small fault only (GptModel::moe_forward): float32 [rows, K],
    // this expert's rows of the grouped columnwise quantization of all experts' inputs, decoded.
    // When defined, the wgrad reads it instead of x's own columnwise copy.
    Tensor x_grouped;
  };
  std::map<std::string, Saved>* saved = nullptr;

  TpContext tp;  // row-parallel outputs and column-parallel input gradients are reduced over it
  int64_t batch = 0, seq = 0;  // of this micro-batch (sequence-parallel layouts)
  // RoPE: the position of each sequence index (the global one: the attention runs on the whole
  // sequence, gathered under sequence parallelism).
  std::vector<int64_t> positions;
  BatchCoords coords;  // of this micro-batch (NVFP4 stochastic rounding's indices)
  // d(objective)/d(one position's loss) of this micro-batch: the MoE load-balancing loss's
  // gradient is scaled like the cross-entropy's.
  double grad_scale = 0;
  // The routing pre-pass (GptModel::routing_stats): each MoE layer's local statistics go here,
  // not reduced over the data ranks.
  std::vector<moe::BalanceStats>* routing = nullptr;

  bool quantized() const { return recipe != nullptr && recipe->enabled(); }

  // The MoE experts' view (docs/design.md "Tensor-parallel experts"): the same tp group without
  // sequence parallelism, since an expert block's rows are dispatched tokens, not sequence
  // positions (row-parallel outputs and column-parallel input gradients are all-reduced).
  Linear experts() const {
    Linear l = *this;
    l.tp.sequence_parallel = false;
    return l;
  }

  // y = x·wᵀ + b
  // row_parallel: y holds partial sums over the tp shards of K: all-reduced (or, with sequence
  // parallelism, reduce-scattered along the sequence into y's sequence shard), then the bias.
  void forward(const std::string& name, const Tensor& x, const Tensor& w, const Tensor* b,
               Tensor& y, bool row_parallel = false) {
    if (row_parallel && tp.sp()) {
      Tensor full = new_tensor({batch * seq, y.shape()[1]}, y.dtype());
      gemm_forward(name, x, w, full);
      y.copy_from(seq_reduce_scatter(*tp.comm, full, batch, seq));
    } else {
      gemm_forward(name, x, w, y);
      if (row_parallel) tp_sum(y);  // partial sums over the K shards; bias once, after
    }
    if (b) kernels::add_bias_(y, *b);  // model.bias = false: no bias
  }

  // Sums `t` over the tp group in place (fp32 reduction; bf16 tensors travel as fp32).
  // An empty tensor (an MoE expert block with no rows here, docs/design.md "Tensor-parallel
  // experts") is skipped: every tp rank of the group holds the same expert layout.
  void tp_sum(Tensor& t) const {
    if (!tp.active() || t.numel().value == 0) return;
    if (t.dtype() == DType::kFloat32) {
      tp.comm->all_reduce(t, mesh::ReduceOp::kSum);
      return;
    }
    Tensor f = kernels::cast_to(t, DType::kFloat32);
    tp.comm->all_reduce(f, mesh::ReduceOp::kSum);
    t.copy_from(kernels::cast_to(f, t.dtype()));
  }

  void gemm_forward(const std::string& name, const Tensor& x, const Tensor& w, Tensor& y) {
    if (!quantized()) {
      kernels::gemm_fprop(&x, &w, y);
    } else {
      const kernels::Usage usage{.rowwise = true, .columnwise = backward};
      Saved s{recipe->quantize(name, Fp8Role::kInput, x, usage),
              recipe->quantize(name, Fp8Role::kWeight, w, usage), Tensor()};
      kernels::gemm_fprop(&s.x, &s.w, y, recipe->options(kernels::GemmRole::kFprop));
      if (backward) (*saved)[name] = std::move(s);
    }
  }

  // dW += dyᵀ·x, db += colsum(dy), dx = dy·W
  // column_parallel: dx is a partial sum over the tp shards of W's rows; all-reduce it.
  // With sequence parallelism dx is this rank's sequence shard of the reduced input gradient.
  void backward_pass(const std::string& name, const Tensor& dy, const Tensor& x, const Tensor& w,
                     Tensor& dw, Tensor* db, Tensor& dx, bool column_parallel = false) {
    if (db) kernels::bias_grad(dy, *db);
    if (column_parallel && tp.sp()) {
      Tensor full = new_tensor({batch * seq, dx.shape()[1]}, dx.dtype());
      backward_gemms(name, dy, x, w, dw, full, column_parallel);
      dx.copy_from(seq_reduce_scatter(*tp.comm, full, batch, seq));
      return;
    }
    backward_gemms(name, dy, x, w, dw, dx, column_parallel);
    if (column_parallel) tp_sum(dx);
  }

  // Row-parallel backward: with sequence parallelism dy is a sequence shard; its bias gradient is
  // a partial sum (reduced over tp by the caller) and the GEMMs use dy gathered along the sequence.
  void backward_row(const std::string& name, const Tensor& dy, const Tensor& x, const Tensor& w,
                    Tensor& dw, Tensor* db, Tensor& dx) {
    if (db) kernels::bias_grad(dy, *db);
    if (tp.sp()) {
      backward_gemms(name, seq_gather(*tp.comm, dy, batch, seq), x, w, dw, dx, false);
    } else {
      backward_gemms(name, dy, x, w, dw, dx, false);
    }
  }

  // dy: [batch * seq, N] full-sequence rows of this micro-batch; N columns sharded over tp when
  // column_parallel.
  void backward_gemms(const std::string& name, const Tensor& dy, const Tensor& x, const Tensor& w,
                      Tensor& dw, Tensor& dx, bool column_parallel) {
    if (!quantized()) {
      kernels::gemm_wgrad(&dy, &x, dw, {.accumulate = true});
      kernels::gemm_dgrad(&dy, &w, dx);
      return;
    }
    const Saved& s = saved->at(name);
    // dy's place in the global batch's unsharded gradient (row = global token, column = global
    // output feature).
    const int64_t n = dy.shape().last();
    const bool split = column_parallel && tp.active();
    const TensorPlace place{.step = coords.step,
                            .row0 = coords.row_begin * seq,
                            .col0 = split ? tp.comm->rank() * n : 0,
                            .ld = split ? n * tp.comm->size() : n};
    const kernels::QuantizedTensor qdy = recipe->quantize(
        name, Fp8Role::kGradOutput, dy, {.rowwise = true, .columnwise = true}, place);
    if (s.x_grouped.defined()) {
      // The expert_split_padding_too_small fault: the GEMM of the decoded operands (dy's own
      // columnwise copy, x's rows of the grouped quantization); the CPU FP8 GEMM decodes its
      // operands to these values too.
      const Tensor dy_cols = kernels::dequantize(qdy, kernels::QuantizedCopy::kColumnwise);
      kernels::gemm_wgrad(&dy_cols, &s.x_grouped, dw, {.accumulate = true});
    } else {
      kernels::gemm_wgrad(&qdy, &s.x, dw, recipe->options(kernels::GemmRole::kWgrad, true));
    }
    kernels::gemm_dgrad(&qdy, &s.w, dx, recipe->options(kernels::GemmRole::kDgrad));
  }
};

}  // namespace meshproof::engine
