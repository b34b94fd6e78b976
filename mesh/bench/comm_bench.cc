#include "mesh/bench/comm_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <set>

#include "kernels/core/error.h"
#include "kernels/core/tensor.h"

namespace meshproof::mesh {

using kernels::DType;
using kernels::Elements;
using kernels::Shape;
using kernels::Tensor;

namespace {

// Small integers: every rank-order fp32 sum is exact, so the expected values are exact.
float bench_value(int global_rank, int64_t k) {
  return static_cast<float>(global_rank * 7 + k % 13);
}

Tensor filled(int64_t n, int global_rank, int64_t offset, kernels::Device device) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) v[static_cast<size_t>(k)] = bench_value(global_rank, offset + k);
  Tensor host = Tensor::from_vector(Shape{n}, v);
  return host.on(device);
}

Tensor on_device(const std::vector<float>& v, kernels::Device device) {
  Tensor host = Tensor::from_vector(Shape{static_cast<int64_t>(v.size())}, v);
  return host.on(device);
}

struct Case {
  CollectiveKind kind;
  ReduceOp op;
};

// One call of `c.kind` on fresh buffers; returns the number of wrong output elements.
int64_t run_and_check(Communicator& c, const Case& cs, int64_t count, kernels::Device dev) {
  const int n = c.size();
  const int me = c.ranks()[static_cast<size_t>(c.rank())];
  const std::vector<int>& members = c.ranks();
  std::vector<float> got;
  std::function<float(int64_t)> want;
  const float fn = static_cast<float>(n);
  auto reduce_expect = [&](int64_t k) {
    float acc = bench_value(members[0], k);
    for (int s = 1; s < n; ++s) {
      const float x = bench_value(members[static_cast<size_t>(s)], k);
      acc = cs.op == ReduceOp::kMax ? std::max(acc, x) : acc + x;
    }
    return cs.op == ReduceOp::kAvg ? acc / fn : acc;
  };
  switch (cs.kind) {
    case CollectiveKind::kAllGather: {
      const int64_t per = count / n;
      Tensor in = filled(per, me, 0, dev);
      Tensor out = Tensor::empty(Shape{per * n}, DType::kFloat32, dev);
      c.all_gather(in, out);
      got = out.to_vector<float>();
      want = [&, per](int64_t i) {
        return bench_value(members[static_cast<size_t>(i / per)], i % per);
      };
      break;
    }
    case CollectiveKind::kReduceScatter: {
      const int64_t per = count / n;
      Tensor in = filled(per * n, me, 0, dev);
      Tensor out = Tensor::empty(Shape{per}, DType::kFloat32, dev);
      c.reduce_scatter(in, out, cs.op);
      got = out.to_vector<float>();
      const int64_t off = c.rank() * per;
      want = [&, off](int64_t k) { return reduce_expect(off + k); };
      break;
    }
    case CollectiveKind::kAllReduce: {
      Tensor buf = filled(count, me, 0, dev);
      c.all_reduce(buf, cs.op);
      got = buf.to_vector<float>();
      want = reduce_expect;
      break;
    }
    case CollectiveKind::kBroadcast: {
      Tensor buf = filled(count, me, 0, dev);
      c.broadcast(buf, 0);
      got = buf.to_vector<float>();
      want = [&](int64_t k) { return bench_value(members[0], k); };
      break;
    }
    case CollectiveKind::kBarrier:
      c.barrier();
      return 0;
    case CollectiveKind::kAllToAll: {
      // Uniform counts: out[s * per + k] = member s's element rank() * per + k.
      const int64_t per = count / n;
      Tensor in = filled(per * n, me, 0, dev);
      Tensor out = Tensor::empty(Shape{per * n}, DType::kFloat32, dev);
      const std::vector<int64_t> counts(static_cast<size_t>(n), per);
      c.all_to_all_v(in, counts, out, counts);
      got = out.to_vector<float>();
      const int64_t off = c.rank() * per;
      want = [&, per, off](int64_t i) {
        return bench_value(members[static_cast<size_t>(i / per)], off + i % per);
      };
      break;
    }
    case CollectiveKind::kSend:
    case CollectiveKind::kRecv:
      MP_FAIL("bench comm: {} is point-to-point, not one of the benched collectives",
              collective_name(cs.kind));
  }
  int64_t wrong = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    if (got[k] != want(static_cast<int64_t>(k))) ++wrong;
  }
  return wrong;
}

// Times `iters` calls on preallocated buffers (the check ran separately on fresh ones).
double time_calls(Communicator& c, const Case& cs, int64_t count, kernels::Device dev, int warmup,
                  int iters) {
  const int n = c.size();
  const int me = c.ranks()[static_cast<size_t>(c.rank())];
  const int64_t per = count / n;
  Tensor a, b;
  switch (cs.kind) {
    case CollectiveKind::kAllGather:
      a = filled(per, me, 0, dev);
      b = Tensor::empty(Shape{per * n}, DType::kFloat32, dev);
      break;
    case CollectiveKind::kReduceScatter:
      a = filled(per * n, me, 0, dev);
      b = Tensor::empty(Shape{per}, DType::kFloat32, dev);
      break;
    case CollectiveKind::kAllToAll:
      a = filled(per * n, me, 0, dev);
      b = Tensor::empty(Shape{per * n}, DType::kFloat32, dev);
      break;
    default:
      a = filled(count, me, 0, dev);
      break;
  }
  auto once = [&] {
    switch (cs.kind) {
      case CollectiveKind::kAllGather:
        c.all_gather(a, b);
        break;
      case CollectiveKind::kReduceScatter:
        c.reduce_scatter(a, b, cs.op);
        break;
      case CollectiveKind::kAllReduce:
        c.all_reduce(a, cs.op);
        break;
      case CollectiveKind::kBroadcast:
        c.broadcast(a, 0);
        break;
      case CollectiveKind::kBarrier:
        c.barrier();
        break;
      case CollectiveKind::kAllToAll: {
        const std::vector<int64_t> counts(static_cast<size_t>(n), per);
        c.all_to_all_v(a, counts, b, counts);
        break;
      }
      case CollectiveKind::kSend:
      case CollectiveKind::kRecv:
        MP_FAIL("bench comm: {} is point-to-point, not one of the benched collectives",
                collective_name(cs.kind));
    }
  };
  for (int i = 0; i < warmup; ++i) once();
  c.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) once();
  kernels::synchronize_current();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

}  // namespace

std::vector<CommBenchRow> run_comm_bench(RankComms& comms, const CommBenchOptions& options) {
  MP_CHECK_INPUT(options.iters >= 1 && options.warmup_iters >= 0,
                 "bench comm: iterations must be >= 1 (got {}) and warmup >= 0 (got {})",
                 options.iters, options.warmup_iters);
  MP_CHECK_INPUT(!options.counts.empty(), "bench comm: no sizes given");
  const DeviceMesh& mesh = comms.mesh();
  Communicator& world =
      comms.group({MeshDim::kPp, MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kTp});
  // Distinct multi-rank groupings: dim sets that partition the world the same way run once.
  std::vector<DimSet> sets;
  std::set<std::vector<std::vector<int>>> seen;
  for (unsigned bits = 1; bits < (1u << kNumGroupDims); ++bits) {
    const DimSet d = DimSet::from_bits(bits);
    if (mesh.group_size(d) < 2) continue;
    if (seen.insert(mesh.groups(d)).second) sets.push_back(d);
  }
  const std::vector<Case> cases = {{CollectiveKind::kAllReduce, ReduceOp::kSum},
                                   {CollectiveKind::kAllReduce, ReduceOp::kAvg},
                                   {CollectiveKind::kAllReduce, ReduceOp::kMax},
                                   {CollectiveKind::kAllGather, ReduceOp::kSum},
                                   {CollectiveKind::kReduceScatter, ReduceOp::kSum},
                                   {CollectiveKind::kReduceScatter, ReduceOp::kAvg},
                                   {CollectiveKind::kBroadcast, ReduceOp::kSum},
                                   {CollectiveKind::kAllToAll, ReduceOp::kSum}};
  std::vector<CommBenchRow> rows;
  for (const DimSet& d : sets) {
    Communicator& c = comms.group(d);
    const int n = c.size();
    for (const Case& cs : cases) {
      for (const Elements requested : options.counts) {
        MP_CHECK_INPUT(requested.value >= 1, "bench comm: size of {} elements", requested.value);
        // all_gather / reduce_scatter / all_to_all need a count divisible by the group size.
        int64_t count = requested.value;
        if (cs.kind == CollectiveKind::kAllGather || cs.kind == CollectiveKind::kReduceScatter ||
            cs.kind == CollectiveKind::kAllToAll) {
          count = std::max<int64_t>(count / n, 1) * n;
        }
        const int64_t wrong = run_and_check(c, cs, count, options.device);
        const double secs =
            time_calls(c, cs, count, options.device, options.warmup_iters, options.iters);
        // World-wide: the slowest rank's time and the total of wrong elements.
        // On the bench device: the nccl communicator only takes device buffers.
        Tensor agg = on_device(std::vector<float>{static_cast<float>(secs)}, options.device);
        world.all_reduce(agg, ReduceOp::kMax);
        Tensor w = on_device(std::vector<float>{static_cast<float>(wrong)}, options.device);
        world.all_reduce(w, ReduceOp::kSum);
        CommBenchRow row;
        row.group = d.str();
        row.group_size = n;
        row.kind = cs.kind;
        row.op = cs.op;
        row.count = Elements(count);
        row.size = kernels::Bytes(count * 4);
        const double t = agg.to_vector<float>()[0];
        row.time_us = t * 1e6;
        row.algbw_gbs = t > 0 ? static_cast<double>(row.size.value) / t / 1e9 : 0.0;
        row.busbw_gbs = row.algbw_gbs * bus_bandwidth_factor(cs.kind, n);
        row.wrong = static_cast<int64_t>(w.to_vector<float>()[0]);
        rows.push_back(row);
      }
    }
  }
  return rows;
}

std::string format_comm_bench(const std::vector<CommBenchRow>& rows) {
  std::string out = fmt::format(
      "#{:>14} {:>5} {:>15} {:>12} {:>10} {:>6} {:>6} {:>10} {:>8} {:>8} {:>7}\n", "group", "ranks",
      "collective", "size(B)", "count", "type", "redop", "time(us)", "algbw", "busbw", "#wrong");
  out += fmt::format("#{:>14} {:>5} {:>15} {:>12} {:>10} {:>6} {:>6} {:>10} {:>8} {:>8} {:>7}\n",
                     "", "", "", "", "(elems)", "", "", "", "(GB/s)", "(GB/s)", "");
  for (const CommBenchRow& r : rows) {
    const bool reduces =
        r.kind == CollectiveKind::kAllReduce || r.kind == CollectiveKind::kReduceScatter;
    out += fmt::format(
        " {:>14} {:>5} {:>15} {:>12} {:>10} {:>6} {:>6} {:>10.1f} {:>8.3f} {:>8.3f} {:>7}\n",
        r.group, r.group_size, collective_name(r.kind), r.size.value, r.count.value, "float",
        reduces ? reduce_op_name(r.op) : "none", r.time_us, r.algbw_gbs, r.busbw_gbs, r.wrong);
  }
  return out;
}

}  // namespace meshproof::mesh
