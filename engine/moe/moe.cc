#include "engine/moe/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "kernels/moe/moe_route.h"
#include "kernels/moe/moe_row.h"
#include "kernels/moe/moe_rows.h"

namespace meshproof::engine::moe {

using kernels::DType;
using kernels::Tensor;

Routing route(const Tensor& logits, int64_t top_k, MoeRouter router) {
  MP_CHECK(logits.defined() && logits.shape().rank() == 2,
           "moe::route: logits must be float32 (or float64) [T, E], got {}",
           logits.defined() ? logits.describe() : "undefined");
  Routing r;
  r.tokens = logits.shape()[0];
  r.experts = logits.shape()[1];
  r.top_k = top_k;
  kernels::MoeRouteOut o = kernels::moe_route(logits, top_k, router == MoeRouter::kSigmoid);
  r.probs = std::move(o.probs);
  r.expert = std::move(o.expert);
  r.weight = std::move(o.weight);
  r.counts = kernels::moe_expert_counts(r.expert, r.experts);
  r.host_counts = r.counts.to_vector<int64_t>();  // E int64: what crosses on a device
  return r;
}

Routing routing_from_choices(int64_t experts, int64_t top_k, const std::vector<int32_t>& expert,
                             const std::vector<double>& weight) {
  MP_CHECK(experts >= 1 && top_k >= 1 && expert.size() % static_cast<size_t>(top_k) == 0 &&
               weight.size() == expert.size(),
           "moe::routing_from_choices: {} choices and {} weights for top_k {} over {} experts",
           expert.size(), weight.size(), top_k, experts);
  Routing r;
  r.tokens = static_cast<int64_t>(expert.size()) / top_k;
  r.experts = experts;
  r.top_k = top_k;
  r.probs = Tensor::zeros({r.tokens, experts}, DType::kFloat64, kernels::Device::cpu());
  r.expert = Tensor::from_vector<int32_t>({r.tokens, top_k}, expert);
  r.weight = Tensor::from_vector<double>({r.tokens, top_k}, weight);
  r.counts = kernels::moe_expert_counts(r.expert, experts);
  r.host_counts = r.counts.to_vector<int64_t>();
  return r;
}

Tensor route_backward(const Routing& r, const Tensor& d_weight,
                      const std::vector<double>& aux_d_prob, MoeRouter router, DType dtype) {
  MP_CHECK(aux_d_prob.empty() || aux_d_prob.size() == static_cast<size_t>(r.experts),
           "moe::route_backward: {} aux terms for {} experts", aux_d_prob.size(), r.experts);
  const Tensor aux =
      aux_d_prob.empty()
          ? Tensor()
          : Tensor::from_vector<double>({r.experts}, aux_d_prob).on(r.probs.device());
  return kernels::moe_route_backward(r.probs, r.expert, r.weight, d_weight, aux,
                                     router == MoeRouter::kSigmoid, dtype);
}

Dispatch dispatch(const Routing& r, int64_t align, bool keep_empty) {
  MP_CHECK(align >= 1, "moe::dispatch: alignment {} must be >= 1", align);
  MP_CHECK(r.host_counts.size() == static_cast<size_t>(r.experts),
           "moe::dispatch: {} counts for {} experts", r.host_counts.size(), r.experts);
  Dispatch d;
  d.rows = r.host_counts;
  d.offset.assign(static_cast<size_t>(r.experts) + 1, 0);
  for (size_t e = 0; e < d.rows.size(); ++e)
    d.offset[e + 1] = d.offset[e] + kernels::moe_row::padded_block(d.rows[e], align, keep_empty);
  kernels::MoeDispatchOut o =
      kernels::moe_dispatch(r.expert, r.counts, align, keep_empty, d.padded_rows());
  d.token = std::move(o.token);
  d.slot = std::move(o.slot);
  return d;
}

int64_t row_alignment(RecipeKind recipe) {
  switch (recipe) {
    case RecipeKind::kFp32:
    case RecipeKind::kBf16:
      return 1;
    case RecipeKind::kDelayed:
    case RecipeKind::kCurrent:
    case RecipeKind::kNvfp4:
      return 16;
    case RecipeKind::kMxfp8:
      return 32;
    case RecipeKind::kBlock:
      return 128;
  }
  return 1;
}

Tensor permute(const Tensor& x, const Dispatch& d) { return kernels::moe_permute(x, d.token); }

void combine(const Tensor& y, const Dispatch& d, const Routing& r, Tensor& out) {
  MP_CHECK(y.shape()[0] == d.padded_rows() && out.shape()[0] == r.tokens,
           "moe::combine: y {} and out {} for {} tokens and {} dispatched rows", y.describe(),
           out.describe(), r.tokens, d.padded_rows());
  kernels::moe_combine(y, d.slot, r.weight, out);
}

Tensor combine_backward(const Tensor& dout, const Tensor& y, const Dispatch& d, const Routing& r,
                        Tensor& dy) {
  return kernels::moe_combine_backward(dout, y, d.slot, r.weight, dy);
}

void unpermute_sum(const Tensor& dxp, const Dispatch& d, const Routing& /*r*/, Tensor& dx) {
  kernels::moe_combine(dxp, d.slot, Tensor(), dx);
}

BalanceStats balance_stats(const Routing& r) {
  BalanceStats s;
  s.count.assign(r.host_counts.begin(), r.host_counts.end());  // exact: counts < 2^53
  s.prob_sum = kernels::moe_prob_sums(r.probs).to_vector<double>();
  s.tokens = static_cast<double>(r.tokens);
  return s;
}

void add_balance_stats(BalanceStats& a, const BalanceStats& b) {
  if (a.count.empty() && a.tokens == 0) {
    a = b;
    return;
  }
  MP_CHECK(a.count.size() == b.count.size() && a.prob_sum.size() == b.prob_sum.size(),
           "moe::add_balance_stats: statistics of {} and {} experts", a.count.size(),
           b.count.size());
  for (size_t e = 0; e < a.count.size(); ++e) {
    a.count[e] += b.count[e];
    a.prob_sum[e] += b.prob_sum[e];
  }
  a.tokens += b.tokens;
}

BalanceStats sum_balance_stats(mesh::Communicator& comm, const BalanceStats& local) {
  const int n = comm.size();
  const auto e_n = static_cast<std::ptrdiff_t>(local.count.size());
  std::vector<double> v = local.count;
  v.insert(v.end(), local.prob_sum.begin(), local.prob_sum.end());
  v.push_back(local.tokens);
  const auto m = static_cast<int64_t>(v.size());
  const kernels::Device dev = kernels::current_context().device;
  Tensor mine = Tensor::from_vector<double>({m}, v);
  mine = mine.on(dev);
  Tensor all = Tensor::empty({n * m}, DType::kFloat64, dev);
  comm.all_gather(mine, all);
  const std::vector<double> every = all.to_vector<double>();
  std::vector<double> sum(every.begin(), every.begin() + m);
  for (int t = 1; t < n; ++t)
    for (int64_t r = 0; r < m; ++r)
      sum[static_cast<size_t>(r)] += every[static_cast<size_t>(t * m + r)];
  BalanceStats out;
  out.count.assign(sum.begin(), sum.begin() + e_n);
  out.prob_sum.assign(sum.begin() + e_n, sum.begin() + 2 * e_n);
  out.tokens = sum.back();
  return out;
}

double aux_loss(const BalanceStats& g, int64_t top_k, double coef) {
  if (g.tokens == 0) return 0.0;
  const double e_n = static_cast<double>(g.count.size());
  double sum = 0;
  for (size_t e = 0; e < g.count.size(); ++e)
    sum += g.count[e] / (g.tokens * static_cast<double>(top_k)) * (g.prob_sum[e] / g.tokens);
  return coef * e_n * sum;
}

std::vector<double> aux_d_prob(const BalanceStats& g, int64_t top_k, double coef, double scale) {
  std::vector<double> out(g.count.size(), 0.0);
  if (g.tokens == 0) return out;
  const double e_n = static_cast<double>(g.count.size());
  for (size_t e = 0; e < g.count.size(); ++e)
    out[e] = coef * e_n * g.count[e] / (g.tokens * static_cast<double>(top_k)) * scale;
  return out;
}

int64_t EpExchange::owner_of(int64_t expert, int member) const {
  const int64_t per = experts / ep;
  return member - member % ep + expert / per;
}

EpExchange plan_exchange(mesh::Communicator& comm, int ep, const Dispatch& local, int64_t align,
                         bool keep_empty) {
  const int n = comm.size(), me = comm.rank();
  const auto e_n = static_cast<int64_t>(local.rows.size());
  MP_CHECK(ep >= 1 && n % ep == 0 && e_n % ep == 0 && align >= 1,
           "moe::plan_exchange: ep {} must divide the {} members of {} and the {} experts "
           "(alignment {})",
           ep, n, comm.describe(), e_n, align);
  for (int64_t e = 0; e < e_n; ++e)
    MP_CHECK(local.offset[static_cast<size_t>(e) + 1] - local.offset[static_cast<size_t>(e)] ==
                 local.rows[static_cast<size_t>(e)],
             "moe::plan_exchange: the local dispatch must have alignment 1 (expert {} has {} "
             "rows in a block of {})",
             e, local.rows[static_cast<size_t>(e)],
             local.offset[static_cast<size_t>(e) + 1] - local.offset[static_cast<size_t>(e)]);
  EpExchange x;
  x.ep = ep;
  x.experts = e_n;
  const int64_t per = e_n / ep;
  const int base = me - me % ep;
  const auto un = static_cast<size_t>(n);
  // Counts: member base + r gets this rank's rows of its experts [r per, (r + 1) per).
  std::vector<int64_t> counts_n(un, 0);
  for (int r = 0; r < ep; ++r) counts_n[static_cast<size_t>(base + r)] = per;
  std::vector<int64_t> mine;
  for (int r = 0; r < ep; ++r)
    for (int64_t e = r * per; e < (r + 1) * per; ++e)
      mine.push_back(local.rows[static_cast<size_t>(e)]);
  const kernels::Tensor send =
      kernels::Tensor::from_vector<int64_t>({static_cast<int64_t>(mine.size())}, mine);
  kernels::Tensor recv = kernels::Tensor::zeros({ep * per}, DType::kInt64, kernels::Device::cpu());
  comm.all_to_all_v(send, counts_n, recv, counts_n);
  // got[q * per + l]: rows of local expert l from group member q.
  const std::vector<int64_t> got = recv.to_vector<int64_t>();
  x.send_rows.assign(un, 0);
  x.recv_rows.assign(un, 0);
  for (int r = 0; r < ep; ++r)
    for (int64_t l = 0; l < per; ++l) {
      x.send_rows[static_cast<size_t>(base + r)] += local.rows[static_cast<size_t>(r * per + l)];
      x.recv_rows[static_cast<size_t>(base + r)] += got[static_cast<size_t>(r * per + l)];
    }
  // The owner layout over all E experts: only this rank's have rows.
  const int64_t first = (me % ep) * per;
  Dispatch& o = x.owner;
  o.rows.assign(static_cast<size_t>(e_n), 0);
  for (int q = 0; q < ep; ++q)
    for (int64_t l = 0; l < per; ++l)
      o.rows[static_cast<size_t>(first + l)] += got[static_cast<size_t>(q * per + l)];
  o.offset.assign(static_cast<size_t>(e_n) + 1, 0);
  for (int64_t e = 0; e < e_n; ++e)
    o.offset[static_cast<size_t>(e) + 1] =
        o.offset[static_cast<size_t>(e)] +
        kernels::moe_row::padded_block(o.rows[static_cast<size_t>(e)], align, keep_empty);
  std::vector<int64_t> token(static_cast<size_t>(o.padded_rows()), -1);
  // Received order: member q, then its rows of local expert l in its (token) order; in the
  // owner layout each expert's rows follow in (member, token) order.
  std::vector<int64_t> next(static_cast<size_t>(per));
  for (int64_t l = 0; l < per; ++l)
    next[static_cast<size_t>(l)] = o.offset[static_cast<size_t>(first + l)];
  int64_t received = 0;
  for (int q = 0; q < ep; ++q)
    for (int64_t l = 0; l < per; ++l)
      for (int64_t i = 0; i < got[static_cast<size_t>(q * per + l)]; ++i) {
        const int64_t row = next[static_cast<size_t>(l)]++;
        x.owner_row.push_back(row);
        token[static_cast<size_t>(row)] = received++;
      }
  o.token = Tensor::from_vector<int64_t>({o.padded_rows()}, token);
  x.received = got;
  return x;
}

namespace {

// Calls f(received_row, owner_row, n) for every block of the received order (member q, local
// expert l): n rows that sit at received_row.. in the received order and at owner_row.. in the
// owner layout.
template <typename F>
void for_each_block(const EpExchange& x, int me, F&& f) {
  const int64_t per = x.experts / x.ep, first = (me % x.ep) * per;
  std::vector<int64_t> next(static_cast<size_t>(per));
  for (int64_t l = 0; l < per; ++l)
    next[static_cast<size_t>(l)] = x.owner.offset[static_cast<size_t>(first + l)];
  int64_t at = 0;
  for (int q = 0; q < x.ep; ++q)
    for (int64_t l = 0; l < per; ++l) {
      const int64_t n = x.received[static_cast<size_t>(q * per + l)];
      if (n > 0) f(at, next[static_cast<size_t>(l)], n);
      at += n;
      next[static_cast<size_t>(l)] += n;
    }
}

void check_rows(const Tensor& t, int64_t rows, const char* what) {
  MP_CHECK(t.shape().rank() == 2 && t.shape()[0] == rows, "moe::{}: {} rows for a layout of {}",
           what, t.describe(), rows);
}

}  // namespace

// On a device every step stays there: the all_to_all_v moves device buffers (the local
// communicator's device-to-device copies, NCCL under mpi) and the owner layout is assembled by
// one device-to-device copy per (member, expert) block.
kernels::Tensor to_owners(mesh::Communicator& comm, const EpExchange& x, const Dispatch& local,
                          const kernels::Tensor& rows) {
  check_rows(rows, local.padded_rows(), "to_owners");
  const int64_t w = rows.shape()[1];
  const kernels::Device dev = rows.device();
  // The local layout is the experts' rows in expert order, and member base + r owns a contiguous
  // run of experts: the send buffer is the local layout itself.
  std::vector<int64_t> sc(x.send_rows.size()), rc(x.recv_rows.size());
  for (size_t m = 0; m < sc.size(); ++m) {
    sc[m] = x.send_rows[m] * w;
    rc[m] = x.recv_rows[m] * w;
  }
  const int64_t received = static_cast<int64_t>(x.owner_row.size());
  kernels::Tensor recv = kernels::Tensor::empty({received, w}, rows.dtype(), dev);
  comm.all_to_all_v(rows, sc, recv, rc);
  kernels::Tensor out = kernels::Tensor::zeros({x.owner.padded_rows(), w}, rows.dtype(), dev);
  for_each_block(x, comm.rank(), [&](int64_t at, int64_t row, int64_t n) {
    kernels::Tensor dst = out.slice_rows(row, row + n);
    dst.copy_from(recv.slice_rows(at, at + n));
  });
  return out;
}

kernels::Tensor from_owners(mesh::Communicator& comm, const EpExchange& x, const Dispatch& local,
                            const kernels::Tensor& rows) {
  check_rows(rows, x.owner.padded_rows(), "from_owners");
  const int64_t w = rows.shape()[1];
  const kernels::Device dev = rows.device();
  const int64_t received = static_cast<int64_t>(x.owner_row.size());
  kernels::Tensor send = kernels::Tensor::empty({received, w}, rows.dtype(), dev);
  for_each_block(x, comm.rank(), [&](int64_t at, int64_t row, int64_t n) {
    kernels::Tensor dst = send.slice_rows(at, at + n);
    dst.copy_from(rows.slice_rows(row, row + n));
  });
  std::vector<int64_t> sc(x.recv_rows.size()), rc(x.send_rows.size());
  for (size_t m = 0; m < sc.size(); ++m) {
    sc[m] = x.recv_rows[m] * w;
    rc[m] = x.send_rows[m] * w;
  }
  // Received in member order = expert order: the local layout (alignment 1, no padding).
  kernels::Tensor out = kernels::Tensor::zeros({local.padded_rows(), w}, rows.dtype(), dev);
  comm.all_to_all_v(send, sc, out, rc);
  return out;
}

}  // namespace meshproof::engine::moe
