// One decoder layer of the model (engine/model/model.h GptModel), forward and backward: the norms,
// the attention block (qkv, RoPE, the reference or fused attention, proj) and the residuals with
// their dropout, around the MLP branch (the dense MLP, engine/model/model_mlp.cc, or the MoE
// layer's, engine/model/model_moe.cc). Apart from the stage passes (engine/model/model.cc), which
// run it layer by layer between the embeddings and the head.
#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "engine/config/config.h"
#include "engine/model/model.h"
#include "engine/model/model_internal.h"
#include "kernels/attention/attention.h"
#include "kernels/attention/flash_attention.h"
#include "kernels/core/tensor.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/layernorm.h"
#include "kernels/random/philox.h"

namespace meshproof::engine {

namespace {

// The CUDA backend runs the fused (flash) attention, which never stores the [B, A, S, S]
// probabilities; the CPU backend keeps the exact reference kernel (goldens are CPU bitwise).
// Head dims above the fused kernels' limit fall back to the reference on CUDA as well.
bool use_fused_attention(const Tensor& qkv, const kernels::AttentionShape& shape) {
  return qkv.device().is_cuda() && kernels::flash_attention_supported(shape);
}

// Dropout stream of one site of one layer in one step.
kernels::DropoutKey dropout_key(uint64_t seed, const BatchCoords& c, int64_t layer,
                                std::string_view site, int64_t seq, int64_t hidden) {
  return {seed,
          kernels::philox_stream(fmt::format("dropout.step{}.layers.{}.{}", c.step, layer, site)),
          static_cast<uint64_t>(c.row_begin * seq * hidden)};
}

// The attention shape of this rank's qkv weight rows: whole KV groups of (A/KV + 2) x d rows.
kernels::AttentionShape local_attention(const ModelConfig& m, const Tensor& qkv_w, int64_t batch,
                                        int64_t seq) {
  const int64_t d = m.hidden / m.heads, kv = kv_heads_of(m), r = m.heads / kv;
  const int64_t groups = qkv_w.shape()[0] / ((r + 2) * d);
  return {batch, seq, groups * r, d, groups};
}

}  // namespace

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

}  // namespace meshproof::engine
