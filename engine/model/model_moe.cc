// The MoE layer's MLP branch (engine/model/model.h GptModel, docs/design.md section 27): the fp32
// router, top-k routing, dispatch into per-expert blocks (exchanged with the experts' owners under
// expert parallelism), the experts' MLPs block by block, combine and the shared expert, forward and
// backward, and the grouped columnwise quantization of the expert_split_padding_too_small fault.
// Apart from the dense layer code because it is its own op family; the routing, dispatch and
// token exchange themselves are engine/moe/moe.cc.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/model.h"
#include "engine/model/model_internal.h"
#include "engine/moe/moe.h"
#include "kernels/core/error.h"
#include "kernels/core/formats.h"
#include "kernels/core/tensor.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ops/cast.h"
#include "kernels/ops/elementwise.h"
#include "kernels/quantize/quantize_rules.h"
#include "kernels/quantize/quantized_tensor.h"

namespace meshproof::engine {

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

}  // namespace meshproof::engine
