// A fixed suite of collectives over every multi-rank group of a mesh, run on the `local` or the
// `mpi` launcher. Two parts:
//  - exact checks: integer/half-integer inputs whose sums are exact in fp32; every result is
//    compared with its exact expected value (0 ULP); the number of wrong elements is the exit
//    status (0 = all right);
//  - a digest: pseudo-random fp32 inputs with mixed exponents, whose rank-order sums round; the
//    bits of every result on every rank are written to --out. CTest compares the local and the
//    mpi digest byte for byte (docs/design.md section 2: the backends are bitwise equal).
// Point-to-point send/recv runs on every multi-rank group too (pipeline stages): each member
// passes noisy fp32 and bf16 buffers down the group's chain and back up, two messages per
// hop to check their order; the received bits are checked exactly and written to the digest.
//
// Usage: mesh_comm_suite --launcher local|mpi --mesh dp_shard=2,tp=2 --out FILE
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>

#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "kernels/ops/cast.h"
#include "mesh/core/nccl_check.h"
#include "mesh/local/local_comm.h"
#include "mesh/mpi/mpi_comm.h"
#if MESHPROOF_HAVE_MPI
#include <mpi.h>
#endif

namespace meshproof::mesh {
namespace {

using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

constexpr int64_t kCount = 33;

float exact_value(int rank, int64_t k) {
  return static_cast<float>(rank * 64 + k % 29) + 0.5f * static_cast<float>(k % 2);
}

// Mixed-magnitude values: rank-order fp32 sums of these round (the digest is non-trivial).
float noisy_value(int rank, int64_t k, int salt) {
  uint32_t h = static_cast<uint32_t>(rank) * 2654435761u ^ static_cast<uint32_t>(k) * 40503u ^
               static_cast<uint32_t>(salt) * 97u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  const double m = static_cast<double>(h & 0xFFFFFF) / 16777216.0 - 0.5;
  return static_cast<float>(std::ldexp(m, static_cast<int>((h >> 24) % 9) - 4));
}

Tensor make(int64_t n, const std::function<float(int64_t)>& f) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) v[static_cast<size_t>(k)] = f(k);
  return Tensor::from_vector(Shape{n}, v);
}

void append_bits(std::string& out, std::string_view what, const Tensor& t) {
  out += fmt::format("{}:", what);
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  for (int64_t i = 0; i < t.nbytes().value; ++i) out += fmt::format("{:02x}", p[i]);
  out += "\n";
}

struct RankResult {
  std::string digest;
  int64_t wrong = 0;
  int64_t order_sensitive = 0;  // digest sums that differ from the reverse-order fp32 sum
};

// A pipeline's traffic on group `c`: member i sends to i + 1 (activations), then i + 1 sends back
// to i (their gradients), two messages per hop (the second must arrive second). A chain, never
// a cycle, so it cannot deadlock on MPI's rendezvous sends. Received bytes are checked exactly
// against what the sender wrote and go into the digest.
void point_to_point(Communicator& c, int salt, RankResult& res) {
  const int n = c.size(), me = c.rank();
  const auto global = [&](int member) { return c.ranks()[static_cast<size_t>(member)]; };
  const auto payload = [&](int from, int to, int which) {
    return make(kCount, [&](int64_t k) {
      return noisy_value(global(from) * 8 + global(to), k, 300 + salt * 4 + which);
    });
  };
  const auto exchange = [&](int from, int to, int which) {
    Tensor fp32 = payload(from, to, which);
    Tensor bf16 = kernels::cast_to(fp32, DType::kBFloat16);
    if (me == from) {
      c.send(fp32, to);
      c.send(bf16, to);
    } else if (me == to) {
      Tensor got = Tensor::empty(Shape{kCount}, DType::kFloat32, kernels::Device::cpu());
      Tensor got16 = Tensor::empty(Shape{kCount}, DType::kBFloat16, kernels::Device::cpu());
      c.recv(got, from);
      c.recv(got16, from);
      if (std::memcmp(got.raw_data(), fp32.raw_data(), static_cast<size_t>(fp32.nbytes().value)))
        ++res.wrong;
      if (std::memcmp(got16.raw_data(), bf16.raw_data(), static_cast<size_t>(bf16.nbytes().value)))
        ++res.wrong;
      append_bits(res.digest,
                  fmt::format("{} recv {}<-{} #{}", c.label(), global(to), global(from), which),
                  got);
      append_bits(
          res.digest,
          fmt::format("{} recv bf16 {}<-{} #{}", c.label(), global(to), global(from), which),
          got16);
    }
  };
  for (int i = 0; i + 1 < n; ++i) exchange(i, i + 1, 0);  // forward
  for (int i = n - 1; i > 0; --i) exchange(i, i - 1, 1);  // backward
}

RankResult run_suite(RankComms& comms) {
  RankResult res;
  const int me = comms.rank();
  res.digest = fmt::format("rank {}\n", me);
  for (unsigned bits = 1; bits < (1u << kNumGroupDims); ++bits) {
    const DimSet dims = DimSet::from_bits(bits);
    Communicator& c = comms.group(dims);
    if (c.size() == 1) continue;
    const int n = c.size();
    const std::vector<int>& members = c.ranks();
    auto check = [&](const Tensor& got, const std::function<double(int64_t)>& want) {
      const std::vector<float> g = got.to_vector<float>();
      for (size_t k = 0; k < g.size(); ++k) {
        if (g[k] != static_cast<float>(want(static_cast<int64_t>(k)))) ++res.wrong;
      }
    };
    // Exact part.
    {
      Tensor in = make(kCount, [&](int64_t k) { return exact_value(me, k); });
      Tensor out = Tensor::empty(Shape{n * kCount}, DType::kFloat32, kernels::Device::cpu());
      c.all_gather(in, out);
      check(out, [&](int64_t i) {
        return exact_value(members[static_cast<size_t>(i / kCount)], i % kCount);
      });
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        Tensor buf = make(kCount, [&](int64_t k) { return exact_value(me, k); });
        c.all_reduce(buf, op);
        check(buf, [&](int64_t k) {
          double s = 0, mx = -1e30;
          for (int r : members) {
            s += exact_value(r, k);
            mx = std::max<double>(mx, exact_value(r, k));
          }
          // avg is defined as the (exact) fp32 sum / float(n).
          return op == ReduceOp::kSum ? s
                 : op == ReduceOp::kAvg
                     ? static_cast<double>(static_cast<float>(s) / static_cast<float>(n))
                     : mx;
        });
      }
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        Tensor big = make(n * kCount, [&](int64_t k) { return exact_value(me, k); });
        Tensor o = Tensor::empty(Shape{kCount}, DType::kFloat32, kernels::Device::cpu());
        c.reduce_scatter(big, o, op);
        check(o, [&](int64_t k) {
          double s = 0;
          for (int r : members) s += exact_value(r, c.rank() * kCount + k);
          return op == ReduceOp::kSum
                     ? s
                     : static_cast<double>(static_cast<float>(s) / static_cast<float>(n));
        });
      }
      Tensor b = make(kCount, [&](int64_t k) { return exact_value(me, k); });
      c.broadcast(b, n - 1);
      check(b, [&](int64_t k) { return exact_value(members.back(), k); });
      // all_to_all_v, uneven counts with zeros: member a sends (a + 2b) % 3 elements to member
      // b, element j of that segment exact_value(members[a], 100 b + j).
      auto cnt = [](int a, int b) -> int64_t { return (a + 2 * b) % 3; };
      std::vector<int64_t> sc, rc;
      std::vector<float> send, want;
      for (int b = 0; b < n; ++b) {
        sc.push_back(cnt(c.rank(), b));
        rc.push_back(cnt(b, c.rank()));
        for (int64_t j = 0; j < cnt(c.rank(), b); ++j) send.push_back(exact_value(me, 100 * b + j));
        for (int64_t j = 0; j < cnt(b, c.rank()); ++j)
          want.push_back(exact_value(members[static_cast<size_t>(b)], 100 * c.rank() + j));
      }
      Tensor a_in = Tensor::from_vector(Shape{static_cast<int64_t>(send.size())}, send);
      Tensor a_out = Tensor::zeros(Shape{static_cast<int64_t>(want.size())}, DType::kFloat32,
                                   kernels::Device::cpu());
      c.all_to_all_v(a_in, sc, a_out, rc);
      check(a_out, [&](int64_t k) { return want[static_cast<size_t>(k)]; });
      append_bits(res.digest, fmt::format("{} all_to_all_v", dims.str()), a_out);
    }
    // Digest part.
    const std::string tag = dims.str();
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      Tensor buf =
          make(kCount, [&](int64_t k) { return noisy_value(me, k, static_cast<int>(bits)); });
      c.all_reduce(buf, op);
      append_bits(res.digest, fmt::format("{} all_reduce {}", tag, reduce_op_name(op)), buf);
      if (op == ReduceOp::kSum) {
        // The digest must be able to see a change of reduction order.
        const std::vector<float> got = buf.to_vector<float>();
        for (int64_t k = 0; k < kCount; ++k) {
          float rev = 0.0f;
          for (auto it = members.rbegin(); it != members.rend(); ++it) {
            rev += noisy_value(*it, k, static_cast<int>(bits));
          }
          if (rev != got[static_cast<size_t>(k)]) ++res.order_sensitive;
        }
      }
    }
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      Tensor big = make(
          n * kCount, [&](int64_t k) { return noisy_value(me, k, 100 + static_cast<int>(bits)); });
      Tensor o = Tensor::empty(Shape{kCount}, DType::kFloat32, kernels::Device::cpu());
      c.reduce_scatter(big, o, op);
      append_bits(res.digest, fmt::format("{} reduce_scatter {}", tag, reduce_op_name(op)), o);
    }
    Tensor in = make(kCount, [&](int64_t k) { return noisy_value(me, k, 200); });
    Tensor out = Tensor::empty(Shape{n * kCount}, DType::kFloat32, kernels::Device::cpu());
    c.all_gather(in, out);
    append_bits(res.digest, fmt::format("{} all_gather", tag), out);
    point_to_point(c, static_cast<int>(bits), res);
    c.barrier();
  }
  return res;
}

int run_main(int argc, char** argv) {
  std::string launcher = "local", mesh_spec = "dp_shard=2,tp=2", out_path;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    if (key == "--launcher")
      launcher = argv[i + 1];
    else if (key == "--mesh")
      mesh_spec = argv[i + 1];
    else if (key == "--out")
      out_path = argv[i + 1];
    else
      MP_FAIL_INPUT("unknown argument {}", key);
  }
  MP_CHECK_INPUT(!out_path.empty(), "--out FILE is required");
  std::vector<RankResult> results;
  bool write = true;
  if (launcher == "local") {
    const DeviceMesh mesh = DeviceMesh::parse(mesh_spec);
    LocalWorldOptions opts;
    opts.timeout = std::chrono::seconds(60);
    LocalWorld world(mesh, opts);
    results.resize(static_cast<size_t>(mesh.world_size()));
    world.run(
        [&](RankComms& comms) { results[static_cast<size_t>(comms.rank())] = run_suite(comms); });
  } else if (launcher == "mpi") {
#if MESHPROOF_HAVE_MPI
    MpiSession session(&argc, &argv);
    MpiRankComms comms(DeviceMesh::parse(mesh_spec, session.size()));
    RankResult mine = run_suite(comms);
    // Gather every rank's digest and wrong count on rank 0.
    const int len = static_cast<int>(mine.digest.size());
    std::vector<int> lens(static_cast<size_t>(session.size()));
    MP_MPI_CHECK(MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, MPI_COMM_WORLD));
    std::vector<int> displs(lens.size(), 0);
    for (size_t i = 1; i < lens.size(); ++i) displs[i] = displs[i - 1] + lens[i - 1];
    std::string all(static_cast<size_t>(displs.back() + lens.back()), '\0');
    MP_MPI_CHECK(MPI_Gatherv(mine.digest.data(), len, MPI_CHAR, all.data(), lens.data(),
                             displs.data(), MPI_CHAR, 0, MPI_COMM_WORLD));
    std::vector<int64_t> wrong(lens.size()), sensitive(lens.size());
    MP_MPI_CHECK(
        MPI_Gather(&mine.wrong, 1, MPI_INT64_T, wrong.data(), 1, MPI_INT64_T, 0, MPI_COMM_WORLD));
    MP_MPI_CHECK(MPI_Gather(&mine.order_sensitive, 1, MPI_INT64_T, sensitive.data(), 1, MPI_INT64_T,
                            0, MPI_COMM_WORLD));
    write = session.rank() == 0;
    for (size_t r = 0; r < lens.size(); ++r) {
      results.push_back(
          RankResult{all.substr(static_cast<size_t>(displs[r]), static_cast<size_t>(lens[r])),
                     wrong[r], sensitive[r]});
    }
#else
    MP_FAIL_INPUT("this build has no MPI");
#endif
  } else {
    MP_FAIL_INPUT("unknown launcher '{}' (local or mpi)", launcher);
  }
  int64_t wrong = 0, sensitive = 0;
  if (write) {
    std::ofstream f(out_path);
    for (const RankResult& r : results) {
      f << r.digest;
      wrong += r.wrong;
      sensitive += r.order_sensitive;
    }
    MP_CHECK(f.good(), "cannot write {}", out_path);
    std::cout << fmt::format(
        "{} launcher, mesh {}: {} ranks, #wrong {}, order-sensitive digest sums {}\n", launcher,
        mesh_spec, results.size(), wrong, sensitive);
    // A digest whose sums do not depend on the order could not catch a reordered reduction.
    if (sensitive == 0) wrong = std::max<int64_t>(wrong, 1);
  }
  return wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace meshproof::mesh

int main(int argc, char** argv) {
  try {
    return meshproof::mesh::run_main(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "mesh_comm_suite: " << e.what() << "\n";
    return 3;
  }
}
