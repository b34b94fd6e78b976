// The transformer's forward and backward at the top (engine/model/model.h GptModel): the
// parameter views of a layer, the stage passes (the embeddings on the first stage, the layers, the
// final norm, LM head and loss under vocabulary parallelism on the last) and the whole-model entry
// points built on them, readable top to bottom as llm.c writes its model. A layer's pass is
// engine/model/model_layer.cc, its MLP engine/model/model_mlp.cc and the MoE branch
// engine/model/model_moe.cc; what they share (the sequence-parallel row helpers, the per-layer
// views and the quantizing Linear) is engine/model/model_internal.h.
#include "engine/model/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/model/model_internal.h"
#include "engine/moe/moe.h"
#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "kernels/core/tensor.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/embedding.h"

namespace meshproof::engine {

namespace {

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
