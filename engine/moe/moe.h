// Mixture-of-experts routing and dispatch (docs/design.md section 27): the router's top-k choice,
// the sort of (token, choice) pairs into per-expert blocks padded to the recipe's row alignment,
// and the permute / combine steps around the expert GEMMs, with their backward. All of it is
// exact index work and double arithmetic rounded once, so the result depends on neither the mesh
// nor the padding: padding rows are zero on the way in and never read on the way out
// (tests/engine/moe/moe_test.cc checks this against an unpadded per-expert loop). The work runs on
// the tensors' device (kernels/moe/moe_route.h, kernels/moe/moe_rows.h); the host keeps only the
// per-expert counts, which size the expert blocks and the exchange (docs/design.md section 37).
//
// Shapes: T tokens (rows of this micro-batch), E experts, k = top_k, H hidden, P padded rows.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config/config.h"
#include "kernels/core/tensor.h"
#include "mesh/core/communicator.h"

namespace meshproof::engine::moe {

// The router's decision for T tokens, on the logits' device.
struct Routing {
  int64_t tokens = 0, experts = 0, top_k = 0;
  kernels::Tensor probs;   // float64 [T, E] probabilities: softmax or sigmoid of the logits
  kernels::Tensor expert;  // int32 [T, k] chosen experts, by descending probability; ties to the
                           // lower expert index
  kernels::Tensor weight;  // float64 [T, k] combine weights: the chosen probabilities divided by
                           // their sum (renormalised over the top k)
  kernels::Tensor counts;  // int64 [E] routed (token, choice) pairs per expert, on the device
  std::vector<int64_t> host_counts;  // [E] the same on the host (the one download of route)
};

// logits: float32 [T, E] (any device). Probabilities are evaluated in double per row and rounded
// once to float; the combine weights likewise. float64 logits (the CPU backend's float64 mode,
// finite-difference checks) keep both in double. On a device the counts are downloaded (E int64:
// the only bytes that cross).
Routing route(const kernels::Tensor& logits, int64_t top_k, MoeRouter router);

// A routing from choices made on the host (tests and tools that route by hand): `expert` [T, k],
// `weight` [T, k], probabilities zero; on the CPU.
Routing routing_from_choices(int64_t experts, int64_t top_k, const std::vector<int32_t>& expert,
                             const std::vector<double>& weight);

// d(objective)/d(logits), [T, E] in `dtype` (the logits') on the routing's device, evaluated in
// double from d/d(weight) (float64 [T, k], combine_backward's) and a per-expert term added to
// d/d(probs) of every token (the load-balancing loss's c * E * f_e * scale; empty: zero; on a
// device its E doubles are uploaded).
kernels::Tensor route_backward(const Routing& r, const kernels::Tensor& d_weight,
                               const std::vector<double>& aux_d_prob, MoeRouter router,
                               kernels::DType dtype);

// Where every (token, choice) pair goes: pairs sorted stably by (expert, token), expert e's rows
// [offset[e], offset[e] + rows[e]) followed by zero rows up to offset[e + 1], a multiple of the
// alignment (0 rows stay 0 unless keep_empty). rows and offset are host integers (from the
// routing's host counts); token and slot live on the routing's device.
struct Dispatch {
  std::vector<int64_t> rows;    // [E] routed pairs per expert
  std::vector<int64_t> offset;  // [E + 1] first row of each expert's padded block; offset[E] = P
  kernels::Tensor token;        // int64 [P] source token of each dispatched row, -1 for padding
  kernels::Tensor slot;         // int64 [T, k] dispatched row of (token, choice)
  int64_t padded_rows() const { return offset.back(); }
};
// keep_empty (quantized recipes): an expert with no routed pair still gets one block of `align`
// zero rows, so that every rank quantizes every expert's operands (the amax MAX-reductions over
// the data ranks run in the same order everywhere) and no quantizer sees an empty tensor; zero
// rows change no amax, no output and no gradient.
Dispatch dispatch(const Routing& r, int64_t align, bool keep_empty = false);

// The load-balancing loss with several micro-batches needs the routing pre-pass (docs/design.md
// "Tensor-parallel experts"): f_e of the global batch must be known before the first backward.
inline bool needs_routing_prepass(const Config& c) {
  return c.model.moe.enabled() && c.model.moe.aux_loss_coef > 0 && c.training.micro_batches > 1;
}

// The recipe's expert row alignment: no columnwise quantization block (32x1 MXFP8, 128x1 block,
// 16x1 NVFP4) spans two experts and per-tensor FP8 GEMMs get M % 16 == 0; 1 for fp32 / bf16.
int64_t row_alignment(RecipeKind recipe);

// x [T, H] -> [P, H]: row slot of the dispatch holds x[token], padding rows are zero.
kernels::Tensor permute(const kernels::Tensor& x, const Dispatch& d);
// out[t] = sum over j in order of weight[t, j] * y[slot[t, j]] in double, rounded once to out's
// dtype. y [P, H], out [T, H].
void combine(const kernels::Tensor& y, const Dispatch& d, const Routing& r, kernels::Tensor& out);
// Backward of combine: dy[slot[t, j]] = weight[t, j] * dout[t] (rounded once; padding rows 0);
// returns d_weight float64 [T, k], d_weight[t, j] = sum_h dout[t, h] * y[slot[t, j], h] in double.
kernels::Tensor combine_backward(const kernels::Tensor& dout, const kernels::Tensor& y,
                                 const Dispatch& d, const Routing& r, kernels::Tensor& dy);
// Backward of permute: dx[t] = sum over j in order of dxp[slot[t, j]] (double, rounded once).
void unpermute_sum(const kernels::Tensor& dxp, const Dispatch& d, const Routing& r,
                   kernels::Tensor& dx);

// The Switch load-balancing statistics of some tokens: routed pairs per expert, summed
// probabilities per expert (summed on the device in token order; E doubles downloaded), and the
// token count (summed over the data-parallel ranks, they give
// the global batch's f_e = count_e / (T k) and P_e = prob_sum_e / T).
struct BalanceStats {
  std::vector<double> count, prob_sum;
  double tokens = 0;
};
BalanceStats balance_stats(const Routing& r);
// Adds `b` into `a` element by element (the statistics of two sets of tokens); a empty: a = b.
void add_balance_stats(BalanceStats& a, const BalanceStats& b);
// The statistics summed over the members of `comm` (all-gathered as doubles on the rank's compute
// device and added in rank order, so every member gets the same bits).
BalanceStats sum_balance_stats(mesh::Communicator& comm, const BalanceStats& local);
// c * E * sum_e f_e * P_e of the global statistics.
double aux_loss(const BalanceStats& global, int64_t top_k, double coef);
// d(objective)/d(probs[t, e]) for every token t: c * E * f_e * scale, where scale = grad_scale,
// the objective's weight of one token's loss (1 / T_global on one rank; the data-parallel
// averaging of the gradients removes the dp factor it carries on a mesh).
std::vector<double> aux_d_prob(const BalanceStats& global, int64_t top_k, double coef,
                               double scale);

// --- Expert parallelism (docs/design.md "Expert parallelism") ---
//
// The members of the dp_shard communicator form groups of `ep` consecutive members; member s is
// ep rank s % ep of the group starting at s - s % ep, and owns the E / ep experts
// [(s % ep) E / ep, (s % ep + 1) E / ep). A source rank dispatches its (token, choice) pairs with
// alignment 1 (its local layout: no padding, it computes no expert); the rows of each expert go
// to the expert's owner in the source's (expert, token) order, counts first, then rows, both by
// all_to_all_v over the dp_shard communicator (zero counts outside the group). The owner lays
// the rows of each of its experts out in (source, token) order, pads each block to the recipe's
// alignment (keep_empty as in `dispatch`), and runs the expert GEMMs on that owner layout; the
// results travel back by the reverse exchange. Experts it does not own get no rows (one block of
// zero rows with keep_empty, so the amax reductions of the quantized recipes still run on every
// rank in the same order).
struct EpExchange {
  int ep = 1;
  int64_t experts = 0;
  std::vector<int64_t> send_rows;  // [members] rows this rank sends to each member (as source)
  std::vector<int64_t> recv_rows;  // [members] rows this rank receives from each (as owner)
  // The owner layout: rows / offset per expert as in Dispatch (0 rows for experts not owned);
  // token[row] = the row's index in the received order (-1 for padding), a host tensor (index
  // bookkeeping; slot is not used).
  Dispatch owner;
  std::vector<int64_t> owner_row;  // [received rows] owner-layout row of each received row
  // [ep * E / ep] rows of local expert l received from group member q, at q * (E / ep) + l: the
  // received order is blocks of these, each a contiguous run of owner-layout rows, so the
  // exchanges move whole blocks (device-to-device copies on a device), never single rows.
  std::vector<int64_t> received;
  int64_t owner_of(int64_t expert, int member) const;  // member index of the expert's owner
};

// Exchanges the per-expert counts of `local` (a dispatch with alignment 1) with the ep group of
// this rank in `comm` (one all_to_all_v of int64 counts) and builds the owner layout. Every
// member of `comm` must call it (members outside the group exchange nothing with this rank).
EpExchange plan_exchange(mesh::Communicator& comm, int ep, const Dispatch& local, int64_t align,
                         bool keep_empty);
// Rows [P_local, W] of the local layout -> [P_owner, W] of the owner layout (zero padding):
// the forward's dispatched inputs and the backward's output gradients.
kernels::Tensor to_owners(mesh::Communicator& comm, const EpExchange& x, const Dispatch& local,
                          const kernels::Tensor& rows);
// Rows [P_owner, W] of the owner layout -> [P_local, W] of the local layout (padding rows of the
// owner layout are not sent): the experts' outputs and the input gradients.
kernels::Tensor from_owners(mesh::Communicator& comm, const EpExchange& x, const Dispatch& local,
                            const kernels::Tensor& rows);

}  // namespace meshproof::engine::moe
