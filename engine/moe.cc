#include "engine/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/cast.h"
#include "kernels/error.h"
#include "kernels/runtime.h"

namespace meshproof::engine::moe {

using kernels::DType;
using kernels::Tensor;

namespace {

// Host float64 copy of a float tensor's elements (exact for fp32 / bf16).
std::vector<double> host_values(const Tensor& t) {
  const Tensor host = t.device().is_cpu() ? t : t.to(kernels::Device::cpu());
  if (host.dtype() == DType::kFloat64) return host.to_vector<double>();
  return kernels::cast_to(host, DType::kFloat64).to_vector<double>();
}

// Writes doubles into `out` (any float dtype, any device), each rounded once to its dtype.
void store(Tensor& out, const std::vector<double>& v) {
  Tensor d = Tensor::from_vector<double>(out.shape(), v);
  if (out.dtype() != DType::kFloat64) d = kernels::cast_to(d, out.dtype());
  out.copy_from(out.device().is_cpu() ? d : d.to(out.device()));
}

int64_t width(const Tensor& t) { return t.shape().rank() == 2 ? t.shape()[1] : 0; }

}  // namespace

Routing route(const Tensor& logits, int64_t top_k, MoeRouter router) {
  const bool f64 = logits.dtype() == DType::kFloat64;
  MP_CHECK((f64 || logits.dtype() == DType::kFloat32) && logits.shape().rank() == 2,
           "moe::route: logits must be float32 (or float64) [T, E], got {}", logits.describe());
  // Rounded once to float in fp32 mode; kept in double in float64 mode.
  const auto round = [f64](double v) {
    return f64 ? v : static_cast<double>(static_cast<float>(v));
  };
  Routing r;
  r.tokens = logits.shape()[0];
  r.experts = logits.shape()[1];
  r.top_k = top_k;
  MP_CHECK(top_k >= 1 && top_k <= r.experts, "moe::route: top_k {} not in [1, {}]", top_k,
           r.experts);
  const std::vector<double> l = host_values(logits);
  const size_t e_n = static_cast<size_t>(r.experts), k_n = static_cast<size_t>(top_k);
  r.probs.resize(l.size());
  r.expert.resize(static_cast<size_t>(r.tokens) * k_n);
  r.weight.resize(r.expert.size());
  std::vector<int32_t> order(e_n);
  for (int64_t t = 0; t < r.tokens; ++t) {
    const double* row = l.data() + static_cast<size_t>(t) * e_n;
    double* p = r.probs.data() + static_cast<size_t>(t) * e_n;
    if (router == MoeRouter::kSoftmax) {
      const double mx = *std::max_element(row, row + e_n);
      double sum = 0;
      for (size_t e = 0; e < e_n; ++e) sum += std::exp(row[e] - mx);
      for (size_t e = 0; e < e_n; ++e) p[e] = round(std::exp(row[e] - mx) / sum);
    } else {
      for (size_t e = 0; e < e_n; ++e) p[e] = round(1.0 / (1.0 + std::exp(-row[e])));
    }
    // Top k by probability; equal probabilities keep the lower expert index first.
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [p](int32_t a, int32_t b) { return p[a] > p[b]; });
    double chosen = 0;
    for (size_t j = 0; j < k_n; ++j) chosen += p[order[j]];
    for (size_t j = 0; j < k_n; ++j) {
      r.expert[static_cast<size_t>(t) * k_n + j] = order[j];
      r.weight[static_cast<size_t>(t) * k_n + j] = round(p[order[j]] / chosen);
    }
  }
  return r;
}

Tensor route_backward(const Routing& r, const std::vector<double>& d_weight,
                      const std::vector<double>& aux_d_prob, MoeRouter router, DType dtype) {
  const size_t e_n = static_cast<size_t>(r.experts), k_n = static_cast<size_t>(r.top_k);
  MP_CHECK(d_weight.size() == r.expert.size() && aux_d_prob.size() == e_n,
           "moe::route_backward: {} weight gradients for {} choices, {} aux terms for {} experts",
           d_weight.size(), r.expert.size(), aux_d_prob.size(), e_n);
  std::vector<double> out(r.probs.size());
  std::vector<double> dp(e_n);
  for (int64_t t = 0; t < r.tokens; ++t) {
    const double* p = r.probs.data() + static_cast<size_t>(t) * e_n;
    const int32_t* ex = r.expert.data() + static_cast<size_t>(t) * k_n;
    const double* w = r.weight.data() + static_cast<size_t>(t) * k_n;
    const double* dw = d_weight.data() + static_cast<size_t>(t) * k_n;
    // w_j = p_j / S, S = sum over the chosen of p: dL/dp_j = (dw_j - sum_i dw_i w_i) / S.
    double chosen = 0, dot = 0;
    for (size_t j = 0; j < k_n; ++j) {
      chosen += p[ex[j]];
      dot += dw[j] * w[j];
    }
    for (size_t e = 0; e < e_n; ++e) dp[e] = aux_d_prob[e];
    for (size_t j = 0; j < k_n; ++j) dp[static_cast<size_t>(ex[j])] += (dw[j] - dot) / chosen;
    double* o = out.data() + static_cast<size_t>(t) * e_n;
    if (router == MoeRouter::kSoftmax) {
      double s = 0;
      for (size_t e = 0; e < e_n; ++e) s += p[e] * dp[e];
      for (size_t e = 0; e < e_n; ++e) o[e] = p[e] * (dp[e] - s);
    } else {
      for (size_t e = 0; e < e_n; ++e) o[e] = dp[e] * p[e] * (1.0 - p[e]);
    }
  }
  const Tensor d = Tensor::from_vector<double>({r.tokens, r.experts}, out);
  return dtype == DType::kFloat64 ? d : kernels::cast_to(d, dtype);  // rounded once
}

Dispatch dispatch(const Routing& r, int64_t align, bool keep_empty) {
  MP_CHECK(align >= 1, "moe::dispatch: alignment {} must be >= 1", align);
  const size_t k_n = static_cast<size_t>(r.top_k);
  Dispatch d;
  d.rows.assign(static_cast<size_t>(r.experts), 0);
  for (int32_t e : r.expert) ++d.rows[static_cast<size_t>(e)];
  d.offset.assign(static_cast<size_t>(r.experts) + 1, 0);
  for (int64_t e = 0; e < r.experts; ++e) {
    const int64_t n = std::max<int64_t>(d.rows[static_cast<size_t>(e)], keep_empty ? 1 : 0);
    d.offset[static_cast<size_t>(e) + 1] =
        d.offset[static_cast<size_t>(e)] + (n + align - 1) / align * align;
  }
  d.token.assign(static_cast<size_t>(d.padded_rows()), -1);
  d.slot.assign(r.expert.size(), -1);
  // Counting sort by expert, tokens ascending within an expert: the stable (expert, token) order.
  std::vector<int64_t> next(d.offset.begin(), d.offset.end() - 1);
  for (int64_t t = 0; t < r.tokens; ++t)
    for (size_t j = 0; j < k_n; ++j) {
      const size_t c = static_cast<size_t>(t) * k_n + j;
      const int64_t row = next[static_cast<size_t>(r.expert[c])]++;
      d.token[static_cast<size_t>(row)] = t;
      d.slot[c] = row;
    }
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

Tensor permute(const Tensor& x, const Dispatch& d) {
  const int64_t h = width(x);
  const int64_t row_bytes = x.nbytes().value / std::max<int64_t>(x.shape()[0], 1);
  const Tensor host = x.device().is_cpu() ? x : x.to(kernels::Device::cpu());
  Tensor out = Tensor::zeros({d.padded_rows(), h}, x.dtype(), kernels::Device::cpu());
  const char* src = static_cast<const char*>(host.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  for (size_t row = 0; row < d.token.size(); ++row)
    if (d.token[row] >= 0)
      std::copy_n(src + d.token[row] * row_bytes, row_bytes,
                  dst + static_cast<int64_t>(row) * row_bytes);
  return x.device().is_cpu() ? out : out.to(x.device());
}

void combine(const Tensor& y, const Dispatch& d, const Routing& r, Tensor& out) {
  const int64_t h = width(y);
  MP_CHECK(y.shape()[0] == d.padded_rows() && out.shape()[0] == r.tokens && width(out) == h,
           "moe::combine: y {} and out {} for {} tokens and {} dispatched rows", y.describe(),
           out.describe(), r.tokens, d.padded_rows());
  const std::vector<double> yv = host_values(y);
  std::vector<double> o(static_cast<size_t>(r.tokens * h));
  const size_t k_n = static_cast<size_t>(r.top_k), hn = static_cast<size_t>(h);
  for (int64_t t = 0; t < r.tokens; ++t)
    for (size_t j = 0; j < k_n; ++j) {
      const size_t c = static_cast<size_t>(t) * k_n + j;
      const double w = r.weight[c];
      const double* src = yv.data() + static_cast<size_t>(d.slot[c]) * hn;
      double* dst = o.data() + static_cast<size_t>(t) * hn;
      for (size_t i = 0; i < hn; ++i) dst[i] = j == 0 ? w * src[i] : dst[i] + w * src[i];
    }
  store(out, o);
}

void combine_backward(const Tensor& dout, const Tensor& y, const Dispatch& d, const Routing& r,
                      Tensor& dy, std::vector<double>& d_weight) {
  const int64_t h = width(y);
  const std::vector<double> yv = host_values(y), dv = host_values(dout);
  std::vector<double> g(static_cast<size_t>(d.padded_rows() * h), 0.0);  // padding rows stay 0
  const size_t k_n = static_cast<size_t>(r.top_k), hn = static_cast<size_t>(h);
  d_weight.assign(r.expert.size(), 0.0);
  for (int64_t t = 0; t < r.tokens; ++t)
    for (size_t j = 0; j < k_n; ++j) {
      const size_t c = static_cast<size_t>(t) * k_n + j;
      const size_t row = static_cast<size_t>(d.slot[c]);
      const double w = r.weight[c];
      const double* go = dv.data() + static_cast<size_t>(t) * hn;
      const double* yr = yv.data() + row * hn;
      double dot = 0;
      for (size_t i = 0; i < hn; ++i) {
        g[row * hn + i] = w * go[i];
        dot += go[i] * yr[i];
      }
      d_weight[c] = dot;
    }
  store(dy, g);
}

void unpermute_sum(const Tensor& dxp, const Dispatch& d, const Routing& r, Tensor& dx) {
  const int64_t h = width(dxp);
  const std::vector<double> v = host_values(dxp);
  std::vector<double> o(static_cast<size_t>(r.tokens * h));
  const size_t k_n = static_cast<size_t>(r.top_k), hn = static_cast<size_t>(h);
  for (int64_t t = 0; t < r.tokens; ++t)
    for (size_t j = 0; j < k_n; ++j) {
      const size_t c = static_cast<size_t>(t) * k_n + j;
      const double* src = v.data() + static_cast<size_t>(d.slot[c]) * hn;
      double* dst = o.data() + static_cast<size_t>(t) * hn;
      for (size_t i = 0; i < hn; ++i) dst[i] = j == 0 ? src[i] : dst[i] + src[i];
    }
  store(dx, o);
}

BalanceStats balance_stats(const Routing& r) {
  BalanceStats s;
  const size_t e_n = static_cast<size_t>(r.experts);
  s.count.assign(e_n, 0.0);
  s.prob_sum.assign(e_n, 0.0);
  s.tokens = static_cast<double>(r.tokens);
  for (int32_t e : r.expert) s.count[static_cast<size_t>(e)] += 1.0;
  for (int64_t t = 0; t < r.tokens; ++t)
    for (size_t e = 0; e < e_n; ++e) s.prob_sum[e] += r.probs[static_cast<size_t>(t) * e_n + e];
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
  if (!dev.is_cpu()) mine = mine.to(dev);
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
  for (int64_t e = 0; e < e_n; ++e) {
    const int64_t rows = std::max<int64_t>(o.rows[static_cast<size_t>(e)], keep_empty ? 1 : 0);
    o.offset[static_cast<size_t>(e) + 1] =
        o.offset[static_cast<size_t>(e)] + (rows + align - 1) / align * align;
  }
  o.token.assign(static_cast<size_t>(o.padded_rows()), -1);
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
        o.token[static_cast<size_t>(row)] = received++;
      }
  return x;
}

namespace {

// Host copy of `t` with its row width and row bytes.
struct HostRows {
  kernels::Tensor host;
  int64_t row_bytes = 0;
};
HostRows host_rows(const kernels::Tensor& t) {
  HostRows h{t.device().is_cpu() ? t : t.to(kernels::Device::cpu()), 0};
  MP_CHECK(t.shape().rank() == 2, "moe: expert-parallel rows must be 2-D, got {}", t.describe());
  h.row_bytes = kernels::dtype_bits(t.dtype()) / 8 * t.shape()[1];
  return h;
}

}  // namespace

kernels::Tensor to_owners(mesh::Communicator& comm, const EpExchange& x, const Dispatch& local,
                          const kernels::Tensor& rows) {
  MP_CHECK(rows.shape()[0] == local.padded_rows(),
           "moe::to_owners: {} rows for a local layout of {}", rows.describe(),
           local.padded_rows());
  const HostRows h = host_rows(rows);
  const int64_t w = rows.shape()[1];
  // The local layout is the experts' rows in expert order, and member base + r owns a contiguous
  // run of experts: the send buffer is the local layout itself.
  std::vector<int64_t> sc(x.send_rows.size()), rc(x.recv_rows.size());
  for (size_t m = 0; m < sc.size(); ++m) {
    sc[m] = x.send_rows[m] * w;
    rc[m] = x.recv_rows[m] * w;
  }
  const int64_t received = static_cast<int64_t>(x.owner_row.size());
  kernels::Tensor recv =
      kernels::Tensor::zeros({received, w}, rows.dtype(), kernels::Device::cpu());
  comm.all_to_all_v(h.host, sc, recv, rc);
  kernels::Tensor out =
      kernels::Tensor::zeros({x.owner.padded_rows(), w}, rows.dtype(), kernels::Device::cpu());
  const char* src = static_cast<const char*>(recv.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  for (int64_t i = 0; i < received; ++i)
    std::copy_n(src + i * h.row_bytes, h.row_bytes,
                dst + x.owner_row[static_cast<size_t>(i)] * h.row_bytes);
  return rows.device().is_cpu() ? out : out.to(rows.device());
}

kernels::Tensor from_owners(mesh::Communicator& comm, const EpExchange& x, const Dispatch& local,
                            const kernels::Tensor& rows) {
  MP_CHECK(rows.shape()[0] == x.owner.padded_rows(),
           "moe::from_owners: {} rows for an owner layout of {}", rows.describe(),
           x.owner.padded_rows());
  const HostRows h = host_rows(rows);
  const int64_t w = rows.shape()[1];
  const int64_t received = static_cast<int64_t>(x.owner_row.size());
  kernels::Tensor send =
      kernels::Tensor::empty({received, w}, rows.dtype(), kernels::Device::cpu());
  const char* src = static_cast<const char*>(h.host.raw_data());
  char* dst = static_cast<char*>(send.raw_data());
  for (int64_t i = 0; i < received; ++i)
    std::copy_n(src + x.owner_row[static_cast<size_t>(i)] * h.row_bytes, h.row_bytes,
                dst + i * h.row_bytes);
  std::vector<int64_t> sc(x.recv_rows.size()), rc(x.send_rows.size());
  for (size_t m = 0; m < sc.size(); ++m) {
    sc[m] = x.recv_rows[m] * w;
    rc[m] = x.send_rows[m] * w;
  }
  // Received in member order = expert order: the local layout (alignment 1, no padding).
  kernels::Tensor out =
      kernels::Tensor::zeros({local.padded_rows(), w}, rows.dtype(), kernels::Device::cpu());
  comm.all_to_all_v(send, sc, out, rc);
  return rows.device().is_cpu() ? out : out.to(rows.device());
}

}  // namespace meshproof::engine::moe
