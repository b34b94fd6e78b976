// The transformer's forward and backward (embedding, attention, dense and MoE MLPs, LM head and
// loss, under TP/SP), readable top to bottom in one file as llm.c writes its model.
// Over 600 lines on purpose: the layers share the private per-layer views (MlpWeights,
// LayerWeights, LayerActs, the quantizing Linear) defined here; moving the MoE layer out would put
// those definitions in an internal header for one caller. The routing, dispatch and token
// exchange themselves are engine/moe/moe.cc.
#include "engine/model/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "engine/moe/moe.h"
#include "kernels/attention/attention.h"
#include "kernels/attention/flash_attention.h"
#include "kernels/core/runtime.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ops/activation.h"
#include "kernels/ops/cast.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/embedding.h"
#include "kernels/ops/layernorm.h"
#include "kernels/quantize/quantize_rules.h"
#include "kernels/random/philox.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

namespace {

// Activations live on the rank's compute device (its RankContext: the CPU, or the GPU of a
// CUDA run); the weights handed in must be there too (checked in GptModel::run).
Tensor new_tensor(const Shape& shape, DType dtype) { return Tensor::empty(shape, dtype); }

// The CUDA backend runs the fused (flash) attention, which never stores the [B, A, S, S]
// probabilities; the CPU backend keeps the exact reference kernel (goldens are CPU bitwise).
// Head dims above the fused kernels' limit fall back to the reference on CUDA as well.
bool use_fused_attention(const Tensor& qkv, const kernels::AttentionShape& shape) {
  return qkv.device().is_cuda() && kernels::flash_attention_supported(shape);
}

// Copies `rows` rows of `src` starting at row `src_row` into `dst` at row `dst_row` (both
// [*, C] of the same dtype and width, on any device).
void copy_rows(Tensor& dst, int64_t dst_row, const Tensor& src, int64_t src_row, int64_t rows) {
  const int64_t row_bytes = src.nbytes().value / std::max<int64_t>(src.shape()[0], 1);
  kernels::copy_bytes(static_cast<char*>(dst.raw_data()) + dst_row * row_bytes, dst.device(),
                      static_cast<const char*>(src.raw_data()) + src_row * row_bytes, src.device(),
                      kernels::Bytes{rows * row_bytes});
}

// Dropout stream of one site of one layer in one step.
kernels::DropoutKey dropout_key(uint64_t seed, const BatchCoords& c, int64_t layer,
                                std::string_view site, int64_t seq, int64_t hidden) {
  return {seed,
          kernels::philox_stream(fmt::format("dropout.step{}.layers.{}.{}", c.step, layer, site)),
          static_cast<uint64_t>(c.row_begin * seq * hidden)};
}

// Sequence-parallel layout of activations [B*S, C]: tp rank t holds rows b*S + s for
// s in [t*S/tp, (t+1)*S/tp), stored as [B, S/tp, C].
Tensor seq_slice(const Tensor& full, int64_t batch, int64_t seq, int tp, int t) {
  const int64_t sl = seq / tp, c = full.numel().value / (batch * seq);
  Tensor out = new_tensor({batch * sl, c}, full.dtype());
  const Tensor src = full.view({batch * seq, c});
  for (int64_t b = 0; b < batch; ++b) copy_rows(out, b * sl, src, b * seq + t * sl, sl);
  return out;
}

// The inverse placement: local rows written into a zero [B*S, C] tensor at their positions.
Tensor seq_place(const Tensor& local, int64_t batch, int64_t seq, int tp, int t) {
  const int64_t sl = seq / tp, c = local.numel().value / (batch * sl);
  Tensor out = Tensor::zeros({batch * seq, c}, local.dtype());
  const Tensor src = local.view({batch * sl, c});
  for (int64_t b = 0; b < batch; ++b) copy_rows(out, b * seq + t * sl, src, b * sl, sl);
  return out;
}

// All-gather along the sequence: local [B*S/tp, C] -> full [B*S, C] (any dtype, bytes moved).
Tensor seq_gather(mesh::Communicator& comm, const Tensor& local, int64_t batch, int64_t seq) {
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
Tensor seq_reduce_scatter(mesh::Communicator& comm, const Tensor& full, int64_t batch,
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

// The attention shape of this rank's qkv weight rows: whole KV groups of (A/KV + 2) x d rows.
kernels::AttentionShape local_attention(const ModelConfig& m, const Tensor& qkv_w, int64_t batch,
                                        int64_t seq) {
  const int64_t d = m.hidden / m.heads, kv = kv_heads_of(m), r = m.heads / kv;
  const int64_t groups = qkv_w.shape()[0] / ((r + 2) * d);
  return {batch, seq, groups * r, d, groups};
}

// This tp rank's rows [begin, end) of the vocabulary under vocabulary parallelism: torch.chunk
// rows (ceil(V / tp) each, trailing chunks smaller or empty), the layout's Shard(0) box.
struct VocabRange {
  int64_t begin = 0, end = 0;
  int64_t rows() const { return end - begin; }
};
VocabRange vocab_range(int64_t vocab, int tp, int rank) {
  const int64_t chunk = (vocab + tp - 1) / tp;
  const int64_t begin = std::min<int64_t>(rank * chunk, vocab);
  return {begin, std::min<int64_t>(begin + chunk, vocab)};
}

// Per-row doubles of every rank of `comm` (float64 [M] on the rank's device), gathered (bytes)
// and combined in rank order: max or sum. On a CUDA device they stay there.
Tensor tp_combine(mesh::Communicator& comm, const Tensor& mine, bool max) {
  Tensor all = Tensor::empty({comm.size() * mine.numel().value}, DType::kFloat64, mine.device());
  comm.all_gather(mine, all);
  return kernels::cross_entropy_combine_ranks(all, comm.size(), max);
}

// The vocabulary-parallel loss (Megatron's parallel cross-entropy, kernels/ops/cross_entropy.h):
// row maxima and then sums of exponentials and target logits combined over tp. Returns the sum
// of the per-row losses (under sequence parallelism, sp_size > 1, only of the rows of this rank's
// sequence shard: the loss is a partial sum over tp like the single-rank path's) and sets log_z
// (float64 [rows] on the logits' device).
double vocab_parallel_loss(mesh::Communicator& comm, const Tensor& logits, const Tensor& targets,
                           const VocabRange& vr, int64_t vocab, int64_t seq, int sp_size,
                           int sp_rank, Tensor& log_z) {
  const Tensor row_max = tp_combine(comm, kernels::cross_entropy_shard_max(logits), true);
  const kernels::CrossEntropyShardSums sums =
      kernels::cross_entropy_shard_sums(logits, targets, vr.begin, vocab, row_max);
  const Tensor sum_exp = tp_combine(comm, sums.sum_exp, false);
  const Tensor target = tp_combine(comm, sums.target_logit, false);
  return kernels::cross_entropy_shard_loss(row_max, sum_exp, target, targets, vocab, seq, sp_size,
                                           sp_rank, log_z);
}

}  // namespace

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

GptModel::GptModel(const Config& config) : config_(config) { validate(config_); }

// The MLP parameters under prefix q ("layers.0.mlp.", "layers.0.moe.experts.1.") looked up by
// `at`: fc1 (or fc1_gate + fc1_up under SwiGLU) and fc2, biases only with model.bias.
template <class T, class At>
GptModel::MlpParams<T> GptModel::mlp_params(const std::string& q, At at) const {
  const bool glu = config_.model.activation == Activation::kSwiGlu;
  const bool bias = config_.model.bias;
  const std::string fc1 = q + (glu ? "fc1_gate" : "fc1");
  MlpParams<T> o;
  o.fc1_w = at(fc1 + ".weight");
  o.fc1_b = bias ? at(fc1 + ".bias") : nullptr;
  o.up_w = glu ? at(q + "fc1_up.weight") : nullptr;
  o.up_b = glu && bias ? at(q + "fc1_up.bias") : nullptr;
  o.fc2_w = at(q + "fc2.weight");
  o.fc2_b = bias ? at(q + "fc2.bias") : nullptr;
  return o;
}

// Layer i's parameters looked up by `at` (name -> T*).
template <class T, class At>
GptModel::LayerParams<T> GptModel::layer_params(int64_t i, At at) const {
  const std::string p = fmt::format("layers.{}.", i);
  const bool ln = config_.model.norm == NormKind::kLayerNorm;
  const bool bias = config_.model.bias;
  LayerParams<T> l;
  l.ln1_w = at(p + "ln1.weight");
  l.ln1_b = ln ? at(p + "ln1.bias") : nullptr;
  l.qkv_w = at(p + "attn.qkv.weight");
  l.qkv_b = bias ? at(p + "attn.qkv.bias") : nullptr;
  l.proj_w = at(p + "attn.proj.weight");
  l.proj_b = bias ? at(p + "attn.proj.bias") : nullptr;
  l.ln2_w = at(p + "ln2.weight");
  l.ln2_b = ln ? at(p + "ln2.bias") : nullptr;
  if (!is_moe_layer(config_.model, i)) {
    l.mlp = mlp_params<T>(p + "mlp.", at);
    return l;
  }
  const MoeConfig& mc = config_.model.moe;
  l.router_w = at(p + "moe.router.weight");
  for (int64_t e = 0; e < mc.experts; ++e)
    l.experts.push_back(mlp_params<T>(fmt::format("{}moe.experts.{}.", p, e), at));
  if (mc.shared_expert) l.shared.push_back(mlp_params<T>(p + "moe.shared.", at));
  return l;
}

GptModel::LayerWeights GptModel::layer_weights(const TensorMap& w, int64_t i) const {
  return layer_params<const Tensor>(i, [&w](const std::string& n) { return &w.at(n); });
}

GptModel::LayerGrads GptModel::layer_grads(TensorMap& g, int64_t i) const {
  return layer_params<Tensor>(i, [&g](const std::string& n) { return &g.at(n); });
}

void GptModel::norm_forward(const Tensor& x, const Tensor& w, const Tensor* b, Tensor& y,
                            Tensor& mean, Tensor& rstd) const {
  if (b) {
    kernels::layernorm_forward(x, w, *b, config_.model.norm_eps, y, mean, rstd);
  } else {
    kernels::rmsnorm_forward(x, w, config_.model.norm_eps, y, rstd);
  }
}

void GptModel::norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                             const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor* db) const {
  if (db) {
    kernels::layernorm_backward(dy, x, w, mean, rstd, dx, dw, *db);
  } else {
    kernels::rmsnorm_backward(dy, x, w, rstd, dx, dw);
  }
}

GptModel::MlpActs GptModel::mlp_acts(int64_t rows, int64_t f, DType dt) const {
  MlpActs a;
  a.fc1_out = new_tensor({rows, f}, dt);
  a.act_out = new_tensor({rows, f}, dt);
  if (config_.model.activation == Activation::kSwiGlu) a.up_out = new_tensor({rows, f}, dt);
  if (config_.model.activation == Activation::kGelu && kernels::current_context().device.is_cpu())
    a.gelu_tanh = new_tensor({rows, f}, DType::kFloat64);
  return a;
}

// out = fc2(act(fc1(x))) with the linears named q + "fc1" (or "fc1_gate" / "fc1_up") and
// q + "fc2"; fc2 is row-parallel (out is the sequence shard under sequence parallelism). `a` is
// allocated for x's rows (mlp_acts).
void GptModel::mlp_forward(const MlpWeights& w, const std::string& q, const Tensor& x,
                           Linear& linear, MlpActs& a, Tensor& out) const {
  const Activation act = config_.model.activation;
  linear.forward(q + (act == Activation::kSwiGlu ? "fc1_gate" : "fc1"), x, *w.fc1_w, w.fc1_b,
                 a.fc1_out);
  switch (act) {
    case Activation::kGelu:
      kernels::gelu_forward(a.fc1_out, a.act_out, a.gelu_tanh.defined() ? &a.gelu_tanh : nullptr);
      break;
    case Activation::kRelu:
      kernels::relu_forward(a.fc1_out, a.act_out);
      break;
    case Activation::kSwiGlu:
      linear.forward(q + "fc1_up", x, *w.up_w, w.up_b, a.up_out);
      kernels::swiglu_forward(a.fc1_out, a.up_out, a.act_out);
      break;
  }
  linear.forward(q + "fc2", a.act_out, *w.fc2_w, w.fc2_b, out, true);
}

// dy: dL/d(out) of mlp_forward; dx (allocated, x's shape) receives dL/dx.
void GptModel::mlp_backward(const MlpWeights& w, MlpGrads& g, const std::string& q,
                            const Tensor& dy, const Tensor& x, const MlpActs& a, Linear& linear,
                            Tensor& dx) const {
  const DType dt = x.dtype();
  const int64_t rows = x.shape()[0], f = w.fc1_w->shape()[0];
  Tensor d_act = new_tensor({rows, f}, dt);
  linear.backward_row(q + "fc2", dy, a.act_out, *w.fc2_w, *g.fc2_w, g.fc2_b, d_act);
  Tensor d_fc1 = new_tensor({rows, f}, dt);
  switch (config_.model.activation) {
    case Activation::kGelu:
      kernels::gelu_backward(d_act, a.fc1_out, d_fc1,
                             a.gelu_tanh.defined() ? &a.gelu_tanh : nullptr);
      linear.backward_pass(q + "fc1", d_fc1, x, *w.fc1_w, *g.fc1_w, g.fc1_b, dx, true);
      break;
    case Activation::kRelu:
      kernels::relu_backward(d_act, a.fc1_out, d_fc1);
      linear.backward_pass(q + "fc1", d_fc1, x, *w.fc1_w, *g.fc1_w, g.fc1_b, dx, true);
      break;
    case Activation::kSwiGlu: {
      Tensor d_up = new_tensor({rows, f}, dt);
      kernels::swiglu_backward(d_act, a.fc1_out, a.up_out, d_fc1, d_up);
      linear.backward_pass(q + "fc1_gate", d_fc1, x, *w.fc1_w, *g.fc1_w, g.fc1_b, dx, true);
      Tensor dx_up = new_tensor(dx.shape(), dt);
      linear.backward_pass(q + "fc1_up", d_up, x, *w.up_w, *g.up_w, g.up_b, dx_up, true);
      kernels::add_(dx, dx_up);
      break;
    }
  }
}

namespace {
// Rows [begin, end) of every activation of an MLP (an expert's block of the grouped tensors).
template <class Acts>
Acts slice_acts(const Acts& a, int64_t begin, int64_t end) {
  Acts s;
  s.fc1_out = a.fc1_out.slice_rows(begin, end);
  s.act_out = a.act_out.slice_rows(begin, end);
  if (a.up_out.defined()) s.up_out = a.up_out.slice_rows(begin, end);
  if (a.gelu_tanh.defined()) s.gelu_tanh = a.gelu_tanh.slice_rows(begin, end);
  return s;
}
}  // namespace

// The expert_split_padding_too_small fault (docs/design.md section 27): TransformerEngine #2966's
// grouped quantization. Each expert's rows of x [P, K] (blocks: the padded dispatch) are laid out
// back to back with every expert's rows padded to `padding` (16) instead of the recipe's
// alignment B (32 MXFP8, 128 block), the total padded with zero rows to a multiple of B (the
// quantizer's), and quantized in ONE columnwise call, so a 32x1 / 128x1 block can hold rows of
// two experts (its scale from the larger amax). Each expert's GEMM then reads its slice of that
// grouped tensor as a grouped GEMM does, assuming its rows start on a block boundary: data row
// at + r, scale block at / B + r / B (the correct block is (at + r) / B; the two agree whenever
// B divides at, i.e. with the recipe's padding). Returns, per expert, its rows decoded that way
// as float32 [block rows, K] (the block's padding rows zero), on x's device.
std::vector<Tensor> GptModel::grouped_columnwise(const Tensor& x, const moe::Dispatch& blocks,
                                                 int64_t padding, const std::string& linear,
                                                 Fp8Recipe& recipe) const {
  const size_t experts = blocks.rows.size();
  const int64_t k = x.shape()[1];
  const bool mx = config_.recipe.kind == RecipeKind::kMxfp8;
  const int64_t align = moe::row_alignment(config_.recipe.kind);  // B: 32 or 128
  std::vector<int64_t> at(experts + 1, 0);  // each expert's first row in the grouped tensor
  for (size_t e = 0; e < experts; ++e)
    at[e + 1] = at[e] + (blocks.rows[e] + padding - 1) / padding * padding;
  const int64_t total = std::max<int64_t>(align, (at[experts] + align - 1) / align * align);
  Tensor grouped = Tensor::zeros({total, k}, x.dtype(), x.device());
  for (size_t e = 0; e < experts; ++e) {
    if (blocks.rows[e] == 0) continue;
    Tensor dst = grouped.slice_rows(at[e], at[e] + blocks.rows[e]);
    dst.copy_from(x.slice_rows(blocks.offset[e], blocks.offset[e] + blocks.rows[e]));
  }
  const kernels::QuantizedTensor q =
      recipe.quantize(linear, Fp8Role::kInput, grouped, {.rowwise = false, .columnwise = true});
  MP_CHECK(q.mode == (mx ? kernels::ScalingMode::kMxfp8 : kernels::ScalingMode::kBlock1x128),
           "expert_split_padding_too_small: {} quantized as {}, expected MXFP8 or 1x128 blocks",
           linear, kernels::scaling_mode_name(q.mode));
  // Decoded on the host (the fault's path; the CPU FP8 GEMM decodes its operands the same way).
  const Tensor data = q.columnwise_data.to(kernels::Device::cpu());
  const Tensor scale = q.columnwise_scale_inv.to(kernels::Device::cpu());
  const auto* d = static_cast<const uint8_t*>(data.raw_data());
  const auto* s8 = static_cast<const uint8_t*>(scale.raw_data());
  const auto* sf = static_cast<const float*>(scale.raw_data());
  const bool e5m2 = q.format == DType::kE5M2;
  const int64_t mb = (total + 127) / 128;  // block: scale columns of the transpose [K, M]
  std::vector<Tensor> out;
  for (size_t e = 0; e < experts; ++e) {
    const int64_t rows = blocks.offset[e + 1] - blocks.offset[e];
    std::vector<float> v(static_cast<size_t>(rows * k), 0.0f);
    for (int64_t r = 0; r < blocks.rows[e]; ++r) {
      const int64_t m = at[e] + r, block = at[e] / align + r / align;
      for (int64_t c = 0; c < k; ++c)
        v[static_cast<size_t>(r * k + c)] =
            mx ? kernels::rules::decode_fp8(d[m * k + c], e5m2) *
                     kernels::fmt8::e8m0_to_float(s8[block * k + c])
               : kernels::rules::decode_fp8(d[c * total + m], e5m2) * sf[c * mb + block];
    }
    Tensor t = Tensor::from_vector<float>({rows, k}, v);
    out.push_back(x.device().is_cpu() ? std::move(t) : t.to(x.device()));
  }
  return out;
}

// The MoE layer's MLP branch (docs/design.md section 27): fp32 router, top-k, dispatch into
// per-expert blocks padded to the recipe's alignment, the experts' GEMMs block by block in
// expert order (every expert, also one with no rows here, so that the amax reductions of the
// quantized recipes run in the same order on every rank), combine, shared expert.
void GptModel::moe_forward(const LayerWeights& w, int64_t layer, Linear& linear, LayerActs& a,
                           Tensor& out) const {
  const MoeConfig& mc = config_.model.moe;
  const DType dt = a.ln2_out.dtype();
  const int64_t rows = a.ln2_out.shape()[0];
  const std::string q = fmt::format("layers.{}.moe.", layer);
  // fp32 router (float64 only in the CPU backend's float64 mode).
  const DType rdt = dt == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  MP_CHECK(w.router_w->dtype() == rdt,
           "GptModel: {}router.weight must be handed in as {} (the router runs in fp32), got {}", q,
           kernels::dtype_name(rdt), w.router_w->describe());
  a.router_in = dt == rdt ? a.ln2_out : kernels::cast_to(a.ln2_out, rdt);
  Tensor logits = new_tensor({rows, mc.experts}, rdt);
  if (linear.tp.router_fp32) {
    kernels::gemm_fprop(&a.router_in, w.router_w, logits);
  } else {  // the router_not_fp32 fault: bf16 operands and output
    const Tensor x16 = kernels::cast_to(a.router_in, DType::kBFloat16);
    const Tensor w16 = kernels::cast_to(*w.router_w, DType::kBFloat16);
    Tensor l16 = new_tensor({rows, mc.experts}, DType::kBFloat16);
    kernels::gemm_fprop(&x16, &w16, l16);
    logits = kernels::cast_to(l16, rdt);
  }
  a.routing = moe::route(logits, mc.top_k, mc.router);
  // Expert parallelism: this rank dispatches unpadded rows to the experts' owners and computes
  // the experts it owns on the owner layout (padded there).
  const bool ep = linear.tp.ep > 1;
  const int64_t align = moe::row_alignment(config_.recipe.kind);
  a.dispatch =
      ep ? moe::dispatch(a.routing, 1) : moe::dispatch(a.routing, align, linear.quantized());
  if (ep)
    a.ep =
        moe::plan_exchange(*linear.tp.expert, linear.tp.ep, a.dispatch, align, linear.quantized());
  const moe::Dispatch& blocks = ep ? a.ep.owner : a.dispatch;
  if (mc.aux_loss_coef > 0) {
    // f_e and P_e over the global batch: the statistics summed over the data-parallel ranks in
    // rank order, so every rank (and every mesh) gets the same aux loss. With micro-batches the
    // routing pre-pass has summed them over every micro-batch too (TpContext::moe_load); the
    // pre-pass itself only records this rank's.
    const moe::BalanceStats s = moe::balance_stats(a.routing);
    if (linear.routing != nullptr) {
      (*linear.routing)[static_cast<size_t>(layer)] = s;
    } else if (linear.tp.moe_load != nullptr) {
      a.load = linear.tp.moe_load->at(static_cast<size_t>(layer));
    } else if (linear.tp.data != nullptr && linear.tp.data->size() > 1) {
      a.load = moe::sum_balance_stats(*linear.tp.data, s);
    } else {
      a.load = s;
    }
    a.aux_loss = moe::aux_loss(a.load, mc.top_k, mc.aux_loss_coef);
  }
  a.x_perm = moe::permute(a.ln2_out, a.dispatch);
  if (ep) a.x_perm = moe::to_owners(*linear.tp.expert, a.ep, a.dispatch, a.x_perm);
  const int64_t padded = blocks.padded_rows(), h = a.ln2_out.shape()[1];
  // Tensor-parallel experts (docs/design.md "Tensor-parallel experts"): each expert's fc1 holds
  // this tp rank's F / tp rows, fc2 its columns; the expert blocks are token rows, not sequence
  // positions, so fc2's partial sums are all-reduced per block (never reduce-scattered along the
  // sequence) and under sequence parallelism the combined [M, H] output is cut to this rank's
  // sequence shard afterwards.
  Linear el = linear.experts();
  a.experts = mlp_acts(padded, w.experts.front().fc1_w->shape()[0], dt);
  a.y_perm = new_tensor({padded, h}, dt);
  for (int64_t e = 0; e < mc.experts; ++e) {
    const int64_t b = blocks.offset[static_cast<size_t>(e)];
    const int64_t end = blocks.offset[static_cast<size_t>(e) + 1];
    MlpActs ea = slice_acts(a.experts, b, end);
    Tensor ye = a.y_perm.slice_rows(b, end);
    mlp_forward(w.experts[static_cast<size_t>(e)], fmt::format("{}experts.{}.", q, e),
                a.x_perm.slice_rows(b, end), el, ea, ye);
  }
  // The expert_split_padding_too_small fault: the wgrad inputs of every expert linear (x_perm
  // for fc1 / fc1_gate / fc1_up, act_out for fc2) replaced by their rows of one grouped
  // columnwise quantization. Only MXFP8 and block scaling have columnwise blocks along the tokens
  // that a 16-row split can break (the fault's `needs`).
  const bool token_blocks =
      config_.recipe.kind == RecipeKind::kMxfp8 || config_.recipe.kind == RecipeKind::kBlock;
  if (linear.tp.expert_split_padding > 0 && linear.backward && linear.quantized() && token_blocks) {
    const bool glu = config_.model.activation == Activation::kSwiGlu;
    const std::vector<std::pair<std::string, const Tensor*>> inputs = {
        {glu ? "fc1_gate" : "fc1", &a.x_perm},
        {"fc1_up", glu ? &a.x_perm : nullptr},
        {"fc2", &a.experts.act_out}};
    for (const auto& [lin, x] : inputs) {
      if (x == nullptr) continue;
      const std::vector<Tensor> rows =
          grouped_columnwise(*x, blocks, linear.tp.expert_split_padding,
                             fmt::format("{}experts.{}", q, lin), *linear.recipe);
      for (int64_t e = 0; e < mc.experts; ++e)
        linear.saved->at(fmt::format("{}experts.{}.{}", q, e, lin)).x_grouped =
            rows[static_cast<size_t>(e)];
    }
  }
  if (ep) a.y_local = moe::from_owners(*linear.tp.expert, a.ep, a.dispatch, a.y_perm);
  const bool sp = linear.tp.sp();
  if (sp) {
    Tensor full = new_tensor({rows, h}, dt);
    moe::combine(ep ? a.y_local : a.y_perm, a.dispatch, a.routing, full);
    out.copy_from(
        seq_slice(full, linear.batch, linear.seq, linear.tp.comm->size(), linear.tp.comm->rank()));
  } else {
    moe::combine(ep ? a.y_local : a.y_perm, a.dispatch, a.routing, out);
  }
  if (!w.shared.empty()) {
    // The shared expert is a dense MLP over every row: the dense tp / sp path.
    a.shared = mlp_acts(rows, w.shared.front().fc1_w->shape()[0], dt);
    a.shared_out = new_tensor(out.shape(), dt);
    mlp_forward(w.shared.front(), q + "shared.", a.ln2_out, linear, a.shared, a.shared_out);
    kernels::add_(out, a.shared_out);
  }
}

// Backward of moe_forward: d_out = dL/d(out) [M, H]; d_ln2 (allocated) receives dL/d(ln2_out).
void GptModel::moe_backward(const LayerWeights& w, LayerGrads& g, int64_t layer, Linear& linear,
                            const LayerActs& a, const Tensor& d_out, Tensor& d_ln2) const {
  const MoeConfig& mc = config_.model.moe;
  const DType dt = a.ln2_out.dtype();
  const int64_t rows = a.ln2_out.shape()[0], h = a.ln2_out.shape()[1];
  const bool ep = linear.tp.ep > 1;
  const moe::Dispatch& blocks = ep ? a.ep.owner : a.dispatch;
  const int64_t padded = blocks.padded_rows();
  const std::string q = fmt::format("layers.{}.moe.", layer);
  // Under sequence parallelism d_out is this rank's sequence shard: the combine backward needs
  // every row's (gathered along the sequence); the experts' and the router's input gradients are
  // then whole on every tp rank and cut to the shard at the end. The gradients of the
  // TP-replicated router weight and expert fc2 biases, which the executor sums over tp under
  // sequence parallelism, are added on tp rank 0 only (whole there, zero elsewhere: exact).
  const bool sp = linear.tp.sp();
  const bool replicated_grads = !sp || linear.tp.comm->rank() == 0;
  const Tensor d_out_all =
      sp ? seq_gather(*linear.tp.comm, d_out, linear.batch, linear.seq) : d_out;
  Linear el = linear.experts();
  Tensor d_y = new_tensor({a.dispatch.padded_rows(), h}, dt);
  const Tensor d_weight =
      moe::combine_backward(d_out_all, ep ? a.y_local : a.y_perm, a.dispatch, a.routing, d_y);
  if (ep) d_y = moe::to_owners(*linear.tp.expert, a.ep, a.dispatch, d_y);
  Tensor d_xp = Tensor::zeros({padded, h}, dt);
  for (int64_t e = 0; e < mc.experts; ++e) {
    const int64_t b = blocks.offset[static_cast<size_t>(e)];
    const int64_t end = blocks.offset[static_cast<size_t>(e) + 1];
    Tensor dxe = d_xp.slice_rows(b, end);
    MlpGrads ge = g.experts[static_cast<size_t>(e)];
    if (!replicated_grads) ge.fc2_b = nullptr;
    if (linear.tp.expert_grad_factor == 1.0) {
      mlp_backward(w.experts[static_cast<size_t>(e)], ge, fmt::format("{}experts.{}.", q, e),
                   d_y.slice_rows(b, end), a.x_perm.slice_rows(b, end),
                   slice_acts(a.experts, b, end), el, dxe);
    } else {
      // The expert_grad_scaled_by_ep fault: this block's weight gradients computed into zero
      // tensors, multiplied by the factor in double and added into the accumulated ones.
      std::vector<Tensor> own;
      own.reserve(6);  // the pointers below stay valid
      auto zero = [&own](Tensor* t) -> Tensor* {
        if (t == nullptr) return nullptr;
        own.push_back(Tensor::zeros(t->shape(), t->dtype(), t->device()));
        return &own.back();
      };
      MlpGrads tmp{zero(ge.fc1_w), zero(ge.fc1_b), zero(ge.up_w),
                   zero(ge.up_b),  zero(ge.fc2_w), zero(ge.fc2_b)};
      mlp_backward(w.experts[static_cast<size_t>(e)], tmp, fmt::format("{}experts.{}.", q, e),
                   d_y.slice_rows(b, end), a.x_perm.slice_rows(b, end),
                   slice_acts(a.experts, b, end), el, dxe);
      for (auto [dst, src] : {std::pair{ge.fc1_w, tmp.fc1_w}, std::pair{ge.fc1_b, tmp.fc1_b},
                              std::pair{ge.up_w, tmp.up_w}, std::pair{ge.up_b, tmp.up_b},
                              std::pair{ge.fc2_w, tmp.fc2_w}, std::pair{ge.fc2_b, tmp.fc2_b}}) {
        if (dst == nullptr) continue;
        Tensor v = kernels::cast_to(src->to(kernels::Device::cpu()), DType::kFloat64);
        double* p = v.data<double>();
        for (int64_t i = 0; i < v.numel().value; ++i) p[i] *= linear.tp.expert_grad_factor;
        Tensor add = kernels::cast_to(v, dst->dtype());
        kernels::add_(*dst, add.on(dst->device()));
      }
    }
  }
  if (ep) d_xp = moe::from_owners(*linear.tp.expert, a.ep, a.dispatch, d_xp);
  const auto shard = [&](const Tensor& full) {  // this rank's sequence shard of [M, *] rows
    return seq_slice(full, linear.batch, linear.seq, linear.tp.comm->size(),
                     linear.tp.comm->rank());
  };
  if (sp) {
    Tensor d_experts = new_tensor({rows, h}, dt);
    moe::unpermute_sum(d_xp, a.dispatch, a.routing, d_experts);
    d_ln2.copy_from(shard(d_experts));
  } else {
    moe::unpermute_sum(d_xp, a.dispatch, a.routing, d_ln2);
  }
  if (!w.shared.empty()) {
    Tensor d_shared = new_tensor(d_ln2.shape(), dt);
    mlp_backward(w.shared.front(), g.shared.front(), q + "shared.", d_out, a.ln2_out, a.shared,
                 linear, d_shared);
    kernels::add_(d_ln2, d_shared);
  }
  // Router: through the combine weights and the load-balancing loss, in fp32 (no aux term
  // without the loss: nothing to upload).
  const std::vector<double> aux =
      mc.aux_loss_coef > 0 ? moe::aux_d_prob(a.load, mc.top_k, mc.aux_loss_coef, linear.grad_scale)
                           : std::vector<double>{};
  const Tensor d_logits =
      moe::route_backward(a.routing, d_weight, aux, mc.router, a.router_in.dtype());
  if (replicated_grads)
    kernels::gemm_wgrad(&d_logits, &a.router_in, *g.router_w, {.accumulate = true});
  Tensor d_router_in = new_tensor({rows, h}, a.router_in.dtype());
  kernels::gemm_dgrad(&d_logits, w.router_w, d_router_in);
  if (sp) d_router_in = shard(d_router_in);
  kernels::add_(d_ln2, dt == d_router_in.dtype() ? d_router_in : kernels::cast_to(d_router_in, dt));
}

// x_out = x_mid + dropout(fc2(act(fc1(ln2(x_mid))))),  x_mid = x_in +
// dropout(proj(attn(qkv(ln1(x_in)))))
void GptModel::layer_forward(const LayerWeights& w, int64_t layer, const BatchCoords& coords,
                             int64_t batch, Linear& linear, LayerActs& a) const {
  const ModelConfig& m = config_.model;
  const int64_t seq = config_.training.seq_len, rows = batch * seq, h = m.hidden;
  const DType dt = a.x_in.dtype();
  // This rank's share of the heads and of F (everything under tensor parallelism; TP-local
  // weights hold whole KV groups: QKV rows are grouped by KV head).
  const kernels::AttentionShape attn = local_attention(m, *w.qkv_w, batch, seq);
  const int64_t heads = attn.heads, hl = heads * attn.head_dim, qkv_w = attn.qkv_width();
  const std::string p = fmt::format("layers.{}.", layer);
  // Rows of the residual stream on this rank (the sequence shard under sequence parallelism).
  const bool sp = linear.tp.sp();
  const int64_t rl = sp ? rows / linear.tp.comm->size() : rows;

  // Attention block.
  a.ln1_out = new_tensor({rl, h}, dt);
  a.ln1_mean = new_tensor({rl}, dt);
  a.ln1_rstd = new_tensor({rl}, dt);
  norm_forward(a.x_in, *w.ln1_w, w.ln1_b, a.ln1_out, a.ln1_mean, a.ln1_rstd);
  if (sp) a.ln1_out = seq_gather(*linear.tp.comm, a.ln1_out, batch, seq);
  a.qkv = new_tensor({rows, qkv_w}, dt);
  linear.forward(p + "attn.qkv", a.ln1_out, *w.qkv_w, w.qkv_b, a.qkv);
  if (m.position == PositionKind::kRope)
    kernels::rope_forward(a.qkv, attn, m.rope_theta, linear.positions);
  a.attn_out = new_tensor({rows, hl}, dt);
  if (use_fused_attention(a.qkv, attn)) {
    a.lse = new_tensor({batch, heads, seq}, DType::kFloat32);
    kernels::flash_attention_forward(a.qkv, attn, a.attn_out, a.lse);
  } else {
    a.probs = new_tensor({batch, heads, seq, seq}, dt);
    kernels::attention_forward(a.qkv, attn, a.attn_out, a.probs);
  }
  Tensor proj_out = new_tensor({rl, h}, dt);
  linear.forward(p + "attn.proj", a.attn_out, *w.proj_w, w.proj_b, proj_out, true);
  a.x_mid = new_tensor({rl, h}, dt);
  kernels::dropout_forward(proj_out, m.dropout,
                           dropout_key(config_.seed, coords, layer, "attn", seq, h), a.x_mid);
  kernels::add_(a.x_mid, a.x_in);

  // MLP block.
  a.ln2_out = new_tensor({rl, h}, dt);
  a.ln2_mean = new_tensor({rl}, dt);
  a.ln2_rstd = new_tensor({rl}, dt);
  norm_forward(a.x_mid, *w.ln2_w, w.ln2_b, a.ln2_out, a.ln2_mean, a.ln2_rstd);
  if (sp) a.ln2_out = seq_gather(*linear.tp.comm, a.ln2_out, batch, seq);
  Tensor fc2_out = new_tensor({rl, h}, dt);
  if (w.router_w != nullptr) {
    moe_forward(w, layer, linear, a, fc2_out);
  } else {
    a.mlp = mlp_acts(rows, w.mlp.fc1_w->shape()[0], dt);
    mlp_forward(w.mlp, p + "mlp.", a.ln2_out, linear, a.mlp, fc2_out);
  }
  a.x_out = new_tensor({rl, h}, dt);
  kernels::dropout_forward(fc2_out, m.dropout,
                           dropout_key(config_.seed, coords, layer, "mlp", seq, h), a.x_out);
  kernels::add_(a.x_out, a.x_mid);
}

// On entry dx holds dL/dx_out [M, H]; on return dL/dx_in. Weight gradients are added into g.
void GptModel::layer_backward(const LayerWeights& w, LayerGrads& g, int64_t layer,
                              const BatchCoords& coords, int64_t batch, Linear& linear,
                              const LayerActs& a, Tensor& dx) const {
  const ModelConfig& m = config_.model;
  const int64_t seq = config_.training.seq_len, rows = batch * seq, h = m.hidden;
  const DType dt = a.x_in.dtype();
  const kernels::AttentionShape attn = local_attention(m, *w.qkv_w, batch, seq);
  const int64_t hl = attn.heads * attn.head_dim, qkv_w = attn.qkv_width();
  const std::string p = fmt::format("layers.{}.", layer);
  const int64_t rl = linear.tp.sp() ? rows / linear.tp.comm->size() : rows;

  // MLP block: dx is dL/dx_out = dL/dx_mid (residual path) + the MLP branch below.
  Tensor d_fc2 = new_tensor({rl, h}, dt);
  kernels::dropout_backward(dx, m.dropout, dropout_key(config_.seed, coords, layer, "mlp", seq, h),
                            d_fc2);
  Tensor d_ln2 = new_tensor({rl, h}, dt);
  if (w.router_w != nullptr) {
    moe_backward(w, g, layer, linear, a, d_fc2, d_ln2);
  } else {
    mlp_backward(w.mlp, g.mlp, p + "mlp.", d_fc2, a.ln2_out, a.mlp, linear, d_ln2);
  }
  Tensor d_mid = new_tensor({rl, h}, dt);
  norm_backward(d_ln2, a.x_mid, *w.ln2_w, a.ln2_mean, a.ln2_rstd, d_mid, *g.ln2_w, g.ln2_b);
  kernels::add_(d_mid, dx);  // residual

  // Attention block.
  Tensor d_proj = new_tensor({rl, h}, dt);
  kernels::dropout_backward(d_mid, m.dropout,
                            dropout_key(config_.seed, coords, layer, "attn", seq, h), d_proj);
  Tensor d_attn = new_tensor({rows, hl}, dt);
  linear.backward_row(p + "attn.proj", d_proj, a.attn_out, *w.proj_w, *g.proj_w, g.proj_b, d_attn);
  Tensor d_qkv = new_tensor({rows, qkv_w}, dt);
  if (a.lse.defined()) {
    kernels::flash_attention_backward(d_attn, a.qkv, a.attn_out, a.lse, attn, d_qkv);
  } else {
    kernels::attention_backward(d_attn, a.qkv, a.probs, attn, d_qkv);
  }
  if (m.position == PositionKind::kRope)
    kernels::rope_backward(d_qkv, attn, m.rope_theta, linear.positions);
  Tensor d_ln1 = new_tensor({rl, h}, dt);
  linear.backward_pass(p + "attn.qkv", d_qkv, a.ln1_out, *w.qkv_w, *g.qkv_w, g.qkv_b, d_ln1, true);
  norm_backward(d_ln1, a.x_in, *w.ln1_w, a.ln1_mean, a.ln1_rstd, dx, *g.ln1_w, g.ln1_b);
  kernels::add_(dx, d_mid);  // residual
}

// One micro-batch's state on one stage between its forward and its backward: the tokens, the
// quantized GEMM operands the forward saved, the layers' activations and, on the last stage, the
// head's activations and the loss gradient (docs/design.md section 33). The whole model is the
// one stage of pp = 1. Held on the heap: `linear` points at `saved`.
struct GptModel::StageState {
  StageLayers span;
  BatchCoords coords;
  int64_t batch = 0, rows = 0;
  bool sp = false;
  int tp_size = 1, tp_rank = 0;
  int64_t rl = 0;      // rows of this rank's residual stream (its sequence shard under SP)
  Tensor ids;          // int32 [B, S] on the compute device
  Tensor targets;      // int32 [rl] (this rank's sequence shard under SP)
  Tensor all_targets;  // int32 [B*S]
  bool recompute = false;
  std::map<std::string, Linear::Saved> saved;  // quantized GEMM operands for the backward
  Linear linear;
  std::vector<LayerActs> acts;    // [span.count]
  std::vector<double> layer_aux;  // [span.count] the layers' MoE load-balancing losses
  // Last stage: the residual stream entering the final norm, its outputs, the lm_head input and
  // the loss gradient of the logits.
  Tensor x_last, xf, f_mean, f_rstd, head_in, d_logits;
  bool head_gather = false;
  double loss_sum = 0;  // cross-entropy sum of the micro-batch's positions (last stage)
};

std::shared_ptr<GptModel::StageState> GptModel::stage_forward(
    const StageLayers& span, const TensorMap& w, const Tensor& tokens, const Tensor& input,
    const BatchCoords& coords, double grad_scale, Fp8Recipe* recipe, const TpContext& tp,
    UnitHooks* units, bool training, Tensor& output, double& loss,
    std::vector<moe::BalanceStats>* routing) const {
  auto before = [units](int64_t unit, Pass pass) {
    if (units) units->before(unit, pass);
  };
  const ModelConfig& m = config_.model;
  const int64_t seq = config_.training.seq_len;
  MP_CHECK_INPUT(
      tokens.dtype() == DType::kInt32 && tokens.shape().rank() == 2 && tokens.shape()[1] == seq + 1,
      "GptModel: tokens must be int32 [B, {}], got {}", seq + 1, tokens.describe());
  MP_CHECK(span.count >= 1 && span.first >= 0 && span.first + span.count <= m.layers &&
               span.first_stage == (span.first == 0) &&
               span.last_stage == (span.first + span.count == m.layers),
           "GptModel: stage layers [{}, {}) of {} layers (first {}, last {})", span.first,
           span.first + span.count, m.layers, span.first_stage, span.last_stage);
  auto st = std::make_shared<StageState>();
  st->span = span;
  st->coords = coords;
  const int64_t batch = tokens.shape()[0], rows = batch * seq, h = m.hidden;
  st->batch = batch;
  st->rows = rows;
  const bool root = span.first_stage || span.last_stage;
  // The root unit (this stage's embeddings and/or head) stays gathered for the whole
  // micro-batch (FSDP2 keeps the root module's parameters between forward and backward).
  if (root) before(kRootUnit, Pass::kForward);
  const kernels::Device device = kernels::current_context().device;
  const Tensor& first_w = span.first_stage ? w.at("embed.tok") : input;
  const DType dt = first_w.dtype();
  MP_CHECK_INPUT(first_w.device() == device, "GptModel: {} on {} but this rank computes on {}",
                 span.first_stage ? "weights" : "stage input", first_w.device().str(),
                 device.str());

  // Split tokens (int32 [B, S + 1]) into inputs [B, S] and next-token targets [B*S] on the
  // compute device: two strided copies (host tokens cross once; tokens made on the device, as a
  // CUDA session's are, never cross).
  const kernels::Device dev = device;
  Tensor ids = Tensor::empty({batch, seq}, DType::kInt32, dev);
  Tensor targets = Tensor::empty({rows}, DType::kInt32, dev);
  {
    const int64_t row_bytes = seq * 4, token_pitch = (seq + 1) * 4;
    const auto* t = static_cast<const char*>(tokens.raw_data());
    kernels::copy_bytes_2d(ids.raw_data(), dev, row_bytes, t, tokens.device(), token_pitch,
                           row_bytes, batch);
    kernels::copy_bytes_2d(targets.raw_data(), dev, row_bytes, t + 4, tokens.device(), token_pitch,
                           row_bytes, batch);
  }

  // Forward.
  const bool recompute = config_.training.recompute && training;
  st->recompute = recompute;
  // With recompute the forward keeps nothing for the backward (rowwise copies only); the
  // recomputed forward produces the columnwise copies.
  st->linear = Linear{recipe, training && !recompute, &st->saved, tp, batch, seq, {}, coords};
  Linear& linear = st->linear;
  linear.grad_scale = grad_scale;
  linear.routing = routing;
  if (routing) routing->assign(static_cast<size_t>(m.layers), {});
  if (m.position == PositionKind::kRope) {
    // The global position of every sequence index; with the fault, each sequence shard's
    // tokens numbered from 0 (S/tp positions per shard).
    const int64_t period = tp.sp() && !tp.rope_global_positions ? seq / tp.comm->size() : seq;
    linear.positions.resize(static_cast<size_t>(seq));
    for (int64_t s = 0; s < seq; ++s) linear.positions[static_cast<size_t>(s)] = s % period;
  }
  const bool vp = m.vocab_parallel && tp.active();
  const bool learned = m.position == PositionKind::kLearned;
  // Sequence parallelism: the residual stream, final norm, lm_head and loss on this rank's
  // sequence shard (rl rows); the loss and TP-replicated gradients become partial sums.
  const bool sp = tp.sp();
  const int tp_size = sp ? tp.comm->size() : 1, tp_rank = sp ? tp.comm->rank() : 0;
  const int64_t rl = rows / tp_size;
  st->sp = sp;
  st->tp_size = tp_size;
  st->tp_rank = tp_rank;
  st->rl = rl;
  st->all_targets = targets;  // every row's (the vocabulary-parallel loss under SP)
  if (sp)
    MP_CHECK_INPUT(seq % tp_size == 0,
                   "sequence parallelism: training.seq_len = {} is not divisible by tp = {}", seq,
                   tp_size);
  Tensor x;
  if (span.first_stage) {
    const Tensor& tok = w.at("embed.tok");
    // Vocabulary parallelism (docs/design.md section 24): embed.tok and lm_head hold this tp
    // rank's vocabulary rows; a weight handed in with shard padding rows is cut to them here, so
    // the padding never reaches the math.
    const VocabRange vr =
        vp ? vocab_range(m.vocab, tp.comm->size(), tp.comm->rank()) : VocabRange{0, tok.shape()[0]};
    if (vp)
      MP_CHECK(tok.shape()[0] >= vr.rows(),
               "GptModel: embed.tok {} holds fewer than its {} vocabulary rows [{}, {})",
               tok.describe(), vr.rows(), vr.begin, vr.end);
    const Tensor tok_rows = vp ? tok.slice_rows(0, vr.rows()) : tok;
    // Token ids are checked against the vocabulary (vocabulary-parallel) or the rows handed in.
    const int64_t id_range = vp ? m.vocab : tok.shape()[0];
    x = new_tensor({rows, h}, dt);
    if (!vp && learned) {
      kernels::embedding_forward(ids, tok, w.at("embed.pos"), x);
    } else {
      // Masked lookup of the held rows (zeros elsewhere), summed over tp; then the positions.
      kernels::embedding_forward(ids, tok_rows, nullptr, vr.begin, id_range, x);
      if (vp) linear.tp_sum(x);
      if (learned) {
        const Tensor& pos = w.at("embed.pos");
        Tensor pos_rows = new_tensor({rows, h}, dt);
        for (int64_t b = 0; b < batch; ++b) copy_rows(pos_rows, b * seq, pos, 0, seq);
        kernels::add_(x, pos_rows);
      }
    }
    if (sp) x = seq_slice(x, batch, seq, tp_size, tp_rank);
  } else {
    MP_CHECK(input.shape() == Shape({rl, h}),
             "GptModel: stage input {} is not the residual stream [{}, {}]", input.describe(), rl,
             h);
    x = input;
  }
  if (sp) targets = seq_slice(targets.view({rows, 1}), batch, seq, tp_size, tp_rank).view({rl});
  st->ids = ids;
  st->targets = targets;
  st->acts.resize(static_cast<size_t>(span.count));
  // The MoE load-balancing losses of the layers (global values, docs/design.md section 27). Each
  // rank adds them once per position it holds, so the loss summed over the data-parallel ranks
  // and divided by B*S is the cross-entropy plus the aux loss.
  for (int64_t i = span.first; i < span.first + span.count; ++i) {
    LayerActs& a = st->acts[static_cast<size_t>(i - span.first)];
    a.x_in = x;
    before(i, Pass::kForward);
    layer_forward(layer_weights(w, i), i, coords, batch, linear, a);
    if (units) units->after(i, Pass::kForward);
    st->layer_aux.push_back(a.aux_loss);
    x = a.x_out;
    if (recompute) {  // keep only the layer input; backward re-runs the layer
      Tensor in = a.x_in;
      a = LayerActs{};
      a.x_in = in;
    }
  }
  loss = 0;
  if (!span.last_stage) {
    if (recipe) recipe->end_forward();
    output = x;
    return st;
  }
  const bool ln = m.norm == NormKind::kLayerNorm;
  const Tensor& lm_all = m.tied_embeddings ? w.at("embed.tok") : w.at("lm_head.weight");
  const VocabRange vr = vp ? vocab_range(m.vocab, tp.comm->size(), tp.comm->rank())
                           : VocabRange{0, lm_all.shape()[0]};
  if (vp)
    MP_CHECK(lm_all.shape()[0] >= vr.rows(),
             "GptModel: output projection {} holds fewer than its {} vocabulary rows [{}, {})",
             lm_all.describe(), vr.rows(), vr.begin, vr.end);
  // One logit per row of the output projection handed in: V for the real weight (a weight that
  // still carries shard padding rows, the uneven_shard_padding_leak fault, adds classes); under
  // vocabulary parallelism this rank's vocabulary columns, padding cut.
  const Tensor lm_w = vp ? lm_all.slice_rows(0, vr.rows()) : lm_all;
  const int64_t v = lm_w.shape()[0];
  MP_CHECK_INPUT(vp || v >= m.vocab, "GptModel: output projection {} has fewer rows than vocab {}",
                 lm_w.describe(), m.vocab);
  st->x_last = x;
  st->xf = new_tensor({rl, h}, dt);
  st->f_mean = new_tensor({rl}, dt);
  st->f_rstd = new_tensor({rl}, dt);
  norm_forward(x, w.at("final_ln.weight"), ln ? &w.at("final_ln.bias") : nullptr, st->xf,
               st->f_mean, st->f_rstd);
  // Vocabulary-parallel under sequence parallelism: the lm_head input is gathered along the
  // sequence (every position's logits of the held vocabulary columns), like a column-parallel
  // layer's input.
  st->head_gather = vp && sp;
  st->head_in = st->head_gather ? seq_gather(*tp.comm, st->xf, batch, seq) : st->xf;
  const Tensor& head_targets = st->head_gather ? st->all_targets : targets;
  const int64_t hr = st->head_gather ? rows : rl;  // rows of the logits
  Tensor logits = new_tensor({hr, v}, dt);
  kernels::gemm_fprop(&st->head_in, &lm_w, logits);
  if (recipe) recipe->end_forward();
  Tensor log_z;  // vocabulary-parallel: float64 per row, over the whole vocabulary
  const double vp_loss = vp ? vocab_parallel_loss(*tp.comm, logits, head_targets, vr, m.vocab, seq,
                                                  tp_size, tp_rank, log_z)
                            : 0.0;
  if (!training) {
    loss = micro_batch_loss(vp ? vp_loss : kernels::cross_entropy_forward(logits, targets),
                            st->layer_aux, rl);
    return st;
  }
  // The loss and its gradient.
  st->d_logits = new_tensor({hr, v}, dt);
  st->loss_sum = vp_loss;
  if (vp) {
    kernels::cross_entropy_shard_grad(logits, head_targets, vr.begin, m.vocab, log_z, grad_scale,
                                      st->d_logits);
  } else {
    st->loss_sum =
        kernels::cross_entropy_forward_backward(logits, targets, grad_scale, st->d_logits);
  }
  loss = st->loss_sum;
  return st;
}

Tensor GptModel::stage_backward(StageState& st, const TensorMap& w, TensorMap& g,
                                const Tensor& grad_output, UnitHooks* units) const {
  auto before = [units](int64_t unit, Pass pass) {
    if (units) units->before(unit, pass);
  };
  const ModelConfig& m = config_.model;
  const int64_t seq = config_.training.seq_len, h = m.hidden;
  const StageLayers& span = st.span;
  const int64_t batch = st.batch, rows = st.rows, rl = st.rl;
  const bool sp = st.sp;
  const int tp_size = st.tp_size, tp_rank = st.tp_rank;
  Linear& linear = st.linear;
  const TpContext& tp = linear.tp;
  Fp8Recipe* recipe = linear.recipe;
  const bool vp = m.vocab_parallel && tp.active();
  const bool learned = m.position == PositionKind::kLearned;
  const bool root = span.first_stage || span.last_stage;
  if (root) before(kRootUnit, Pass::kBackward);
  Tensor dx;
  if (span.last_stage) {
    const bool ln = m.norm == NormKind::kLayerNorm;
    // The weights are read again: between this micro-batch's forward and its backward the root
    // unit may have been released and gathered again (other micro-batches' passes).
    const Tensor& lm_all = m.tied_embeddings ? w.at("embed.tok") : w.at("lm_head.weight");
    const VocabRange vr = vp ? vocab_range(m.vocab, tp.comm->size(), tp.comm->rank())
                             : VocabRange{0, lm_all.shape()[0]};
    const Tensor lm_w = vp ? lm_all.slice_rows(0, vr.rows()) : lm_all;
    const DType dt = lm_w.dtype();
    Tensor& dlm_all = !m.tied_embeddings          ? g.at("lm_head.weight")
                      : g.contains(kTiedHeadGrad) ? g.at(kTiedHeadGrad)
                                                  : g.at("embed.tok");
    Tensor dlm = vp ? dlm_all.slice_rows(0, vr.rows()) : dlm_all;
    kernels::gemm_wgrad(&st.d_logits, &st.head_in, dlm, {.accumulate = true});
    Tensor d_xf = new_tensor({rl, h}, dt);
    if (st.head_gather) {  // partial sums over the vocabulary shards, scattered along the sequence
      Tensor full = new_tensor({rows, h}, dt);
      kernels::gemm_dgrad(&st.d_logits, &lm_w, full);
      d_xf.copy_from(seq_reduce_scatter(*tp.comm, full, batch, seq));
    } else {
      kernels::gemm_dgrad(&st.d_logits, &lm_w, d_xf);
      if (vp) linear.tp_sum(d_xf);  // partial sums over the vocabulary shards
    }
    st.d_logits = Tensor{};
    dx = new_tensor({rl, h}, dt);
    norm_backward(d_xf, st.x_last, w.at("final_ln.weight"), st.f_mean, st.f_rstd, dx,
                  g.at("final_ln.weight"), ln ? &g.at("final_ln.bias") : nullptr);
  } else {
    MP_CHECK(grad_output.shape() == Shape({rl, h}),
             "GptModel: stage output gradient {} is not the residual stream's [{}, {}]",
             grad_output.describe(), rl, h);
    dx = grad_output;
  }
  for (int64_t i = span.first + span.count - 1; i >= span.first; --i) {
    LayerActs& a = st.acts[static_cast<size_t>(i - span.first)];
    before(i, Pass::kBackward);
    const LayerWeights lw = layer_weights(w, i);
    if (st.recompute) {  // same masks (keyed by coordinates) and the forward's FP8 scales
      if (recipe) recipe->set_recompute(true);
      linear.backward = true;
      layer_forward(lw, i, st.coords, batch, linear, a);
      if (recipe) recipe->set_recompute(false);
    }
    LayerGrads lg = layer_grads(g, i);
    layer_backward(lw, lg, i, st.coords, batch, linear, a, dx);
    if (units) units->after(i, Pass::kBackward);
    a = LayerActs{};  // free this layer's activations and quantized operands
    std::erase_if(st.saved, [prefix = fmt::format("layers.{}.", i)](const auto& kv) {
      return kv.first.starts_with(prefix);
    });
  }
  if (span.first_stage) {
    const Tensor& ids = st.ids;
    const Tensor& tok = w.at("embed.tok");
    const VocabRange vr =
        vp ? vocab_range(m.vocab, tp.comm->size(), tp.comm->rank()) : VocabRange{0, tok.shape()[0]};
    const int64_t id_range = vp ? m.vocab : tok.shape()[0];
    Tensor& dtok_all = g.at("embed.tok");
    Tensor dtok = vp ? dtok_all.slice_rows(0, vr.rows()) : dtok_all;
    Tensor* dpos = learned ? &g.at("embed.pos") : nullptr;
    if (vp && sp) {
      // The held vocabulary rows take every position's gradient (gathered along the sequence);
      // the position table's stays this shard's partial sum, reduced over tp with the other
      // TP-replicated gradients.
      kernels::embedding_backward(seq_gather(*tp.comm, dx, batch, seq), ids, vr.begin, m.vocab,
                                  &dtok, nullptr);
      if (dpos)
        kernels::embedding_backward(seq_place(dx, batch, seq, tp_size, tp_rank), ids, vr.begin,
                                    m.vocab, nullptr, dpos);
    } else {
      if (sp) dx = seq_place(dx, batch, seq, tp_size, tp_rank);  // zeros at the other positions
      if (!vp && learned) {
        kernels::embedding_backward(dx, ids, dtok_all, *dpos);
      } else {
        kernels::embedding_backward(dx, ids, vr.begin, id_range, &dtok, dpos);
      }
    }
  }
  if (root && units) units->after(kRootUnit, Pass::kBackward);
  if (recipe) recipe->end_backward();
  return span.first_stage ? Tensor{} : dx;
}

double GptModel::micro_batch_loss(double cross_entropy, const std::vector<double>& layer_aux,
                                  int64_t rows) {
  double aux = 0;
  for (double a : layer_aux) aux += a;
  return cross_entropy + aux * static_cast<double>(rows);
}

GptModel::StageLoss GptModel::stage_loss_parts(const StageState& st) const {
  return {st.loss_sum, st.rl, st.layer_aux};
}

double GptModel::stage_loss(const StageState& st) const {
  return micro_batch_loss(st.loss_sum, st.layer_aux, st.rl);
}

double GptModel::run(const TensorMap& w, const Tensor& tokens, const BatchCoords& coords,
                     double grad_scale, TensorMap* grads, Fp8Recipe* recipe, const TpContext& tp,
                     UnitHooks* units) const {
  // The whole model is one stage: the same calls in the same order as a stage of pp > 1.
  const StageLayers whole{0, config_.model.layers, true, true};
  Tensor output;
  double loss = 0;
  const std::shared_ptr<StageState> st =
      stage_forward(whole, w, tokens, Tensor{}, coords, grad_scale, recipe, tp, units,
                    grads != nullptr, output, loss);
  if (grads == nullptr) {
    if (units) units->after(kRootUnit, Pass::kForward);
    return loss;
  }
  stage_backward(*st, w, *grads, Tensor{}, units);
  return stage_loss(*st);
}

double GptModel::forward_backward(const TensorMap& weights, const Tensor& tokens,
                                  const BatchCoords& coords, double grad_scale, TensorMap& grads,
                                  Fp8Recipe* recipe, const TpContext& tp, UnitHooks* units) const {
  return run(weights, tokens, coords, grad_scale, &grads, recipe, tp, units);
}

std::vector<moe::BalanceStats> GptModel::routing_stats(const TensorMap& weights,
                                                       const Tensor& tokens,
                                                       const BatchCoords& coords, Fp8Recipe* recipe,
                                                       const TpContext& tp,
                                                       UnitHooks* units) const {
  Tensor output;
  return stage_routing_stats({0, config_.model.layers, true, true}, weights, tokens, Tensor{},
                             coords, recipe, tp, units, output);
}

std::vector<moe::BalanceStats> GptModel::stage_routing_stats(
    const StageLayers& span, const TensorMap& weights, const Tensor& tokens, const Tensor& input,
    const BatchCoords& coords, Fp8Recipe* recipe, const TpContext& tp, UnitHooks* units,
    Tensor& output) const {
  std::vector<moe::BalanceStats> out;
  double loss = 0;
  stage_forward(span, weights, tokens, input, coords, 0.0, recipe, tp, units, false, output, loss,
                &out);
  // The root unit (what the stage holds of the embeddings and head) is released as after
  // run's forward-only pass; a middle stage holds none and never gathered it.
  if (units && (span.first_stage || span.last_stage)) units->after(kRootUnit, Pass::kForward);
  return out;
}

double GptModel::forward_loss(const TensorMap& weights, const Tensor& tokens,
                              const BatchCoords& coords, Fp8Recipe* recipe) const {
  return run(weights, tokens, coords, 0.0, nullptr, recipe, TpContext{}, nullptr);
}

}  // namespace meshproof::engine
