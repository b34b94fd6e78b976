// The in-process (`local`) communicator: collectives on 1..8 virtual ranks with inputs whose
// sums are exact in fp32 (so every expected value is exact: 0 ULP), mesh groups, raw-byte dtypes,
// accounting, and failure handling (a missing rank times out with a clear error; an exception on
// one rank aborts the others instead of deadlocking them).
#include "mesh/local/local_comm.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "kernels/ops/cast.h"
#include "tests/scoped_env.h"

namespace meshproof::mesh {
namespace {

using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

// Small integers and halves: every partial sum below 2^24 is exact in fp32, in any order.
float value(int rank, int64_t k) {
  return static_cast<float>(rank * 100 + k % 97) + 0.5f * (k % 2);
}

Tensor rank_tensor(int rank, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) v[static_cast<size_t>(k)] = value(rank, k);
  return Tensor::from_vector(Shape{n}, v);
}

// A failed ASSERT returns from one rank's function and leaves the others waiting: a short
// timeout turns that into an error instead of a 300 s wait.
LocalWorldOptions short_timeout() {
  LocalWorldOptions o;
  o.timeout = std::chrono::seconds(20);
  return o;
}

// How the ranks run (mesh/local/rank_fibers.h): a thread each, or fibers on one worker (every wait
// must hand the worker to another rank) or on two (waits across workers). Explicit, so that every
// machine tests all three whatever its CPU count would pick by default.
struct Mode {
  const char* name;
  RankThreading threading;
  int workers;
};
constexpr Mode kThreads{"threads", RankThreading::kThreads, 0};
constexpr Mode kModes[] = {kThreads,
                           {"fibers on 1 worker", RankThreading::kFibers, 1},
                           {"fibers on 2 workers", RankThreading::kFibers, 2}};

LocalWorldOptions options_for(const Mode& m,
                              std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  LocalWorldOptions o;
  o.timeout = timeout;
  o.threading = m.threading;
  o.fiber_workers = m.workers;
  return o;
}

// A thread starter that starts `allowed` threads, then throws as std::thread does on a machine
// out of threads.
std::function<std::thread(std::function<void()>)> refuse_thread_start(int allowed) {
  auto started = std::make_shared<int>(0);
  return [started, allowed](std::function<void()> body) {
    if (*started == allowed) {
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                              "thread start refused by the test");
    }
    ++*started;
    return std::thread(std::move(body));
  };
}

// (ranks, index into kModes)
class LocalCollectivesTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(LocalCollectivesTest, AllCollectivesExact) {
  const int n = std::get<0>(GetParam());
  const Mode& mode = kModes[std::get<1>(GetParam())];
  SCOPED_TRACE(mode.name);
  const int64_t count = 37;  // odd on purpose: nothing lines up with a vector width
  LocalWorld world(DeviceMesh(1, n, 1), options_for(mode));
  world.run([&](RankComms& comms) {
    Communicator& c = comms.group({MeshDim::kDpShard});
    const int r = c.rank();
    ASSERT_EQ(c.size(), n);
    ASSERT_EQ(comms.rank(), r);

    // all_gather
    const Tensor in = rank_tensor(r, count);
    Tensor gathered = Tensor::empty(Shape{n * count}, DType::kFloat32, kernels::Device::cpu());
    c.all_gather(in, gathered);
    const std::vector<float> g = gathered.to_vector<float>();
    for (int s = 0; s < n; ++s) {
      for (int64_t k = 0; k < count; ++k) {
        ASSERT_EQ(g[static_cast<size_t>(s * count + k)], value(s, k)) << "all_gather s=" << s;
      }
    }

    // reduce_scatter sum and avg: member r gets chunk r of the elementwise sum.
    const Tensor big = rank_tensor(r, n * count);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      Tensor out = Tensor::empty(Shape{count}, DType::kFloat32, kernels::Device::cpu());
      c.reduce_scatter(big, out, op);
      const std::vector<float> o = out.to_vector<float>();
      for (int64_t k = 0; k < count; ++k) {
        double sum = 0;
        for (int s = 0; s < n; ++s) sum += value(s, r * count + k);
        // The sum is exact in fp32; avg is defined as that sum / float(n).
        const float want = op == ReduceOp::kSum ? static_cast<float>(sum)
                                                : static_cast<float>(sum) / static_cast<float>(n);
        ASSERT_EQ(o[static_cast<size_t>(k)], want) << reduce_op_name(op);
      }
    }

    // all_reduce sum, avg, max
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      Tensor buf = rank_tensor(r, count);
      c.all_reduce(buf, op);
      const std::vector<float> o = buf.to_vector<float>();
      for (int64_t k = 0; k < count; ++k) {
        double sum = 0, mx = -1e30;
        for (int s = 0; s < n; ++s) {
          sum += value(s, k);
          mx = std::max<double>(mx, value(s, k));
        }
        const float want = op == ReduceOp::kSum   ? static_cast<float>(sum)
                           : op == ReduceOp::kAvg ? static_cast<float>(sum) / static_cast<float>(n)
                                                  : static_cast<float>(mx);
        ASSERT_EQ(o[static_cast<size_t>(k)], want) << reduce_op_name(op);
      }
    }

    // broadcast from the last member, of raw bytes in several dtypes
    const int root = n - 1;
    for (DType dt : {DType::kUInt8, DType::kBFloat16, DType::kInt32, DType::kFloat32}) {
      Tensor b = Tensor::empty(Shape{count}, dt, kernels::Device::cpu());
      auto* p = static_cast<uint8_t*>(b.raw_data());
      for (int64_t i = 0; i < b.nbytes().value; ++i) p[i] = static_cast<uint8_t>(r * 31 + i);
      c.broadcast(b, root);
      for (int64_t i = 0; i < b.nbytes().value; ++i) {
        ASSERT_EQ(p[i], static_cast<uint8_t>(root * 31 + i)) << kernels::dtype_name(dt);
      }
    }

    // all_gather of bf16 bit patterns, in place (the input is this member's slice of the output)
    Tensor bf = Tensor::empty(Shape{n * 5}, DType::kBFloat16, kernels::Device::cpu());
    auto* bp = static_cast<uint16_t*>(bf.raw_data());
    for (int i = 0; i < 5; ++i) bp[r * 5 + i] = static_cast<uint16_t>(0x3F80 + r * 16 + i);
    c.all_gather(bf.slice_rows(r * 5, r * 5 + 5), bf);
    for (int s = 0; s < n; ++s) {
      for (int i = 0; i < 5; ++i) ASSERT_EQ(bp[s * 5 + i], 0x3F80 + s * 16 + i);
    }
    c.barrier();

    // Accounting: nccl-tests sizes.
    EXPECT_EQ(c.stats(CollectiveKind::kAllGather).count, 2);
    EXPECT_EQ(c.stats(CollectiveKind::kAllGather).bytes.value, n * count * 4 + n * 5 * 2);
    EXPECT_EQ(c.stats(CollectiveKind::kReduceScatter).bytes.value, 2 * n * count * 4);
    EXPECT_EQ(c.stats(CollectiveKind::kAllReduce).count, 3);
    EXPECT_EQ(c.stats(CollectiveKind::kBroadcast).bytes.value, count * (1 + 2 + 4 + 4));
    EXPECT_EQ(c.stats(CollectiveKind::kBarrier).count, 1);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks1To8, LocalCollectivesTest,
                         ::testing::Combine(::testing::Range(1, 9), ::testing::Range(0, 3)));

TEST(LocalCommTest, MeshGroupsReduceOverTheirMembersOnly) {
  const DeviceMesh mesh(2, 2, 2);
  LocalWorld world(mesh, short_timeout());
  world.run([&](RankComms& comms) {
    const int me = comms.rank();
    for (unsigned bits = 1; bits < 8; ++bits) {
      const DimSet dims = DimSet::from_bits(bits);
      Communicator& c = comms.group(dims);
      const std::vector<int> members = mesh.group_ranks(me, dims);
      EXPECT_EQ(c.ranks(), members);
      EXPECT_EQ(c.label(), dims.str());
      Tensor t = Tensor::from_vector(Shape{2}, std::vector<float>{float(me), float(me * me)});
      c.all_reduce(t, ReduceOp::kSum);
      float s1 = 0, s2 = 0;
      for (int r : members) {
        s1 += float(r);
        s2 += float(r * r);
      }
      EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{s1, s2})) << dims.str();
    }
  });
}

TEST(LocalCommTest, RankOrderSumIsDeterministicAndNotReassociated) {
  // 1 + 2^-24 + 2^-24 ... : summing in rank order loses every tiny term (1 + 2^-24 rounds to 1),
  // any other order that adds the tiny terms first keeps them. Rank order is the contract.
  const int n = 4;
  LocalWorld world(DeviceMesh(1, n, 1), short_timeout());
  world.run([&](RankComms& comms) {
    Communicator& c = comms.group({MeshDim::kDpShard});
    const float x = c.rank() == 0 ? 1.0f : std::ldexp(1.0f, -24);
    Tensor t = Tensor::from_vector(Shape{1}, std::vector<float>{x});
    c.all_reduce(t, ReduceOp::kSum);
    EXPECT_EQ(t.to_vector<float>()[0], 1.0f);
  });
}

// The element-wise rank-order reduction that reduce_rank_order_host computed before it worked in
// blocks along the elements (the oracle: same per-element sequence of fp32 operations).
void reduce_elementwise(float* out, const float* const* inputs, int n, int64_t count, ReduceOp op) {
  for (int64_t k = 0; k < count; ++k) {
    float acc = inputs[0][k];
    for (int s = 1; s < n; ++s) {
      const float x = inputs[s][k];
      if (op == ReduceOp::kMax) {
        acc = (x > acc || x != x) ? x : acc;
      } else {
        acc += x;
      }
    }
    if (op == ReduceOp::kAvg) acc = acc / static_cast<float>(n);
    out[k] = acc;
  }
}

// Bits equal, except that which NaN an add of two NaNs returns depends on the operand order the
// compiler encodes (docs/design.md section 21): NaN exactly where the oracle has NaN.
void expect_same_bits_or_both_nan(const std::vector<float>& got, const std::vector<float>& want,
                                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    if (std::isnan(want[k])) {
      ASSERT_TRUE(std::isnan(got[k])) << what << " element " << k;
    } else {
      uint32_t a = 0, b = 0;
      std::memcpy(&a, &got[k], 4);
      std::memcpy(&b, &want[k], 4);
      ASSERT_EQ(a, b) << what << " element " << k << ": " << got[k] << " vs " << want[k];
    }
  }
}

TEST(LocalCommTest, BlockedRankOrderReductionEqualsTheElementwiseLoop) {
  // Random bit patterns (every exponent: subnormals, infinities, NaNs with payloads and signs,
  // signed zeros) mixed with values of one magnitude whose sums round; counts around the block.
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (int n : {1, 2, 3, 8, 9}) {
    for (int64_t count :
         {int64_t{1}, int64_t{7}, int64_t{511}, int64_t{512}, int64_t{513}, int64_t{1500}}) {
      std::vector<std::vector<float>> in(static_cast<size_t>(n),
                                         std::vector<float>(static_cast<size_t>(count)));
      for (auto& v : in) {
        for (float& x : v) {
          const uint64_t r = next();
          if (r % 4 == 0) {
            const auto bits = static_cast<uint32_t>(r >> 32);
            std::memcpy(&x, &bits, 4);
          } else {
            x = static_cast<float>(static_cast<int64_t>(r >> 40) - (int64_t{1} << 23)) * 1.37e-3f;
          }
        }
      }
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        std::vector<const float*> ptrs;
        for (const auto& v : in) ptrs.push_back(v.data());
        std::vector<float> want(static_cast<size_t>(count)), got(static_cast<size_t>(count));
        reduce_elementwise(want.data(), ptrs.data(), n, count, op);
        reduce_rank_order_host(got.data(), ptrs.data(), n, count, op);
        const std::string what = fmt::format("n={} count={} op={}", n, count, reduce_op_name(op));
        expect_same_bits_or_both_nan(got, want, what);
        // `out` aliasing the first and the last input (all_reduce in place).
        for (size_t alias : {size_t{0}, static_cast<size_t>(n - 1)}) {
          std::vector<std::vector<float>> copy = in;
          std::vector<const float*> cp;
          for (const auto& v : copy) cp.push_back(v.data());
          reduce_rank_order_host(copy[alias].data(), cp.data(), n, count, op);
          expect_same_bits_or_both_nan(copy[alias], want,
                                       what + " aliased input " + std::to_string(alias));
        }
      }
    }
  }
}

// Small collectives are staged (mesh/local/local_comm.cc): a member leaves without waiting for the
// others to read its input and may reuse that input at once, while slower members still read the
// call before. Every member overwrites its input right after each call, one member per round is
// late, and sizes alternate below and above the staging limit: every result stays exact.
TEST(LocalCommTest, StagedCollectivesTolerateInputReuseAndLateMembers) {
  for (const Mode& mode : kModes)
    for (int n : {3, 8}) {
      SCOPED_TRACE(mode.name);
      LocalWorld world(DeviceMesh(1, n, 1), options_for(mode));
      world.run([&](RankComms& comms) {
        Communicator& c = comms.group({MeshDim::kDpShard});
        const int r = c.rank();
        // Element counts per member: staged (4 and 37 floats) and read in place (80000 floats:
        // every kind touches more than the 256 KiB limit).
        const std::vector<int64_t> counts{4, 80000, 37, 37, 80000, 4};
        for (int round = 0; round < 60; ++round) {
          const int64_t count = counts[static_cast<size_t>(round) % counts.size()];
          if (round % n == r) std::this_thread::sleep_for(std::chrono::microseconds(300));
          const auto v = [&](int member, int64_t k) {
            return static_cast<float>(member * 1000 + (k + round) % 251);
          };
          switch (round % 5) {
            case 0: {
              Tensor in = Tensor::empty(Shape{count}, DType::kFloat32, kernels::Device::cpu());
              float* p = in.data<float>();
              for (int64_t k = 0; k < count; ++k) p[k] = v(r, k);
              Tensor out = Tensor::empty(Shape{n * count}, DType::kFloat32, kernels::Device::cpu());
              c.all_gather(in, out);
              std::fill(p, p + count, -1.0f);  // reused at once
              const float* o = out.data<float>();
              for (int s = 0; s < n; ++s)
                for (int64_t k = 0; k < count; ++k)
                  ASSERT_EQ(o[s * count + k], v(s, k)) << "all_gather round " << round;
              break;
            }
            case 1:
            case 3: {
              Tensor in = Tensor::empty(Shape{n * count}, DType::kFloat32, kernels::Device::cpu());
              float* p = in.data<float>();
              for (int64_t k = 0; k < n * count; ++k) p[k] = v(r, k);
              Tensor out = Tensor::empty(Shape{count}, DType::kFloat32, kernels::Device::cpu());
              c.reduce_scatter(in, out, ReduceOp::kSum);
              std::fill(p, p + n * count, -1.0f);
              const float* o = out.data<float>();
              for (int64_t k = 0; k < count; ++k) {
                float want = 0;
                for (int s = 0; s < n; ++s) want += v(s, r * count + k);  // exact integers
                ASSERT_EQ(o[k], want) << "reduce_scatter round " << round;
              }
              break;
            }
            case 2: {
              Tensor buf = Tensor::empty(Shape{count}, DType::kFloat32, kernels::Device::cpu());
              float* p = buf.data<float>();
              for (int64_t k = 0; k < count; ++k) p[k] = v(r, k);
              c.all_reduce(buf, round % 2 ? ReduceOp::kMax : ReduceOp::kSum);
              for (int64_t k = 0; k < count; ++k) {
                float want = round % 2 ? v(n - 1, k) : 0.0f;
                if (round % 2 == 0)
                  for (int s = 0; s < n; ++s) want += v(s, k);
                ASSERT_EQ(p[k], want) << "all_reduce round " << round;
              }
              std::fill(p, p + count, -1.0f);
              break;
            }
            case 4: {
              const int root = round % n;
              Tensor buf = Tensor::empty(Shape{count}, DType::kFloat32, kernels::Device::cpu());
              float* p = buf.data<float>();
              for (int64_t k = 0; k < count; ++k) p[k] = v(r, k);
              c.broadcast(buf, root);
              for (int64_t k = 0; k < count; ++k)
                ASSERT_EQ(p[k], v(root, k)) << "broadcast round " << round;
              std::fill(p, p + count, -1.0f);
              c.barrier();
              break;
            }
          }
        }
      });
    }
}

#if defined(__linux__)
// The CPUs the calling thread may run on.
std::vector<int> thread_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(pthread_getaffinity_np(pthread_self(), sizeof(set), &set), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

// With more ranks than the process's CPUs each rank thread runs on one allowed CPU and the ranks
// spread evenly over all of them (how many per CPU differs by at most one); with no more ranks
// than CPUs every rank keeps the process's whole set. Results are unaffected either way (the
// other tests run on both sides of the line).
TEST(LocalCommTest, RanksOutnumberingTheCpusArePinnedEvenly) {
  const std::vector<int> allowed = thread_cpus();
  ASSERT_FALSE(allowed.empty());
  const int cpus = static_cast<int>(allowed.size());
  for (int n : {cpus, cpus + 1, 2 * cpus + 3}) {
    if (n > 64) continue;  // a machine with many CPUs: the line is beyond what a test starts
    std::vector<std::vector<int>> seen(static_cast<size_t>(n));
    LocalWorld world(DeviceMesh(1, n, 1), short_timeout());
    world.run([&](RankComms& comms) {
      seen[static_cast<size_t>(comms.rank())] = thread_cpus();
      comms.group({MeshDim::kDpShard}).barrier();
    });
    std::map<int, int> per_cpu;
    for (const auto& s : seen) {
      if (n <= cpus) {
        EXPECT_EQ(s, allowed) << n << " ranks";
        continue;
      }
      ASSERT_EQ(s.size(), 1u) << n << " ranks";
      EXPECT_NE(std::find(allowed.begin(), allowed.end(), s[0]), allowed.end());
      ++per_cpu[s[0]];
    }
    if (n <= cpus) continue;
    EXPECT_EQ(static_cast<int>(per_cpu.size()), cpus) << n << " ranks";
    for (const auto& kv : per_cpu) {
      EXPECT_GE(kv.second, n / cpus) << "cpu " << kv.first;
      EXPECT_LE(kv.second, n / cpus + 1) << "cpu " << kv.first;
    }
  }
}
#endif

TEST(LocalCommTest, MissingRankTimesOutWithClearError) {
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode.name);
    LocalWorld world(DeviceMesh(1, 4, 1), options_for(mode, std::chrono::milliseconds(300)));
    const auto t0 = std::chrono::steady_clock::now();
    try {
      world.run([&](RankComms& comms) {
        if (comms.rank() == 3) return;  // never arrives
        Tensor t = Tensor::from_vector(Shape{1}, std::vector<float>{1.0f});
        comms.group({MeshDim::kDpShard}).all_reduce(t, ReduceOp::kSum);
      });
      FAIL() << "expected a timeout";
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kRuntime);
      const std::string msg = e.message();
      EXPECT_NE(msg.find("all_reduce"), std::string::npos) << msg;
      EXPECT_NE(msg.find("dp_shard group of ranks [0, 1, 2, 3]"), std::string::npos) << msg;
      EXPECT_NE(msg.find("ranks [3] never arrived"), std::string::npos) << msg;
      // As specific as the mpi watchdog: which call, which phase, who waited, how to change it.
      EXPECT_NE(msg.find("local all_reduce (call 1 on this group, arrival phase)"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("timed out after 0.300 s on rank "), std::string::npos) << msg;
      EXPECT_NE(msg.find("MESHPROOF_COLLECTIVE_TIMEOUT sets the limit"), std::string::npos) << msg;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 30.0);  // not a hang: 0.3 s timeout, generous bound for a loaded 2-core machine
  }
}

// The watchdog's limit comes from MESHPROOF_COLLECTIVE_TIMEOUT (seconds) for both launchers;
// anything but a positive number is an input error naming the variable.
TEST(LocalCommTest, CollectiveTimeoutFromEnvironment) {
  test_env::ScopedEnv env("MESHPROOF_COLLECTIVE_TIMEOUT", nullptr);
  EXPECT_EQ(collective_timeout(), std::chrono::milliseconds(300000));
  env.set("0.25");
  EXPECT_EQ(collective_timeout(), std::chrono::milliseconds(250));
  EXPECT_EQ(LocalWorldOptions{}.timeout, std::chrono::milliseconds(250));
  for (const char* bad : {"0", "-1", "5s", "abc", "nan"}) {
    env.set(bad);
    try {
      (void)collective_timeout();
      ADD_FAILURE() << "accepted MESHPROOF_COLLECTIVE_TIMEOUT=" << bad;
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
      EXPECT_NE(e.message().find(std::string("MESHPROOF_COLLECTIVE_TIMEOUT=") + bad),
                std::string::npos)
          << e.message();
    }
  }
}

TEST(LocalCommTest, ExceptionOnOneRankAbortsTheOthers) {
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode.name);
    // Default 300 s timeout: the others must be woken by the abort, not by their timeout.
    LocalWorld world(DeviceMesh(1, 4, 1), options_for(mode, std::chrono::seconds(300)));
    const auto t0 = std::chrono::steady_clock::now();
    try {
      world.run([&](RankComms& comms) {
        if (comms.rank() == 2) MP_FAIL_INPUT("rank two rejects its input");
        Tensor t = Tensor::from_vector(Shape{1}, std::vector<float>{1.0f});
        comms.group({MeshDim::kDpShard}).all_reduce(t, ReduceOp::kSum);
      });
      FAIL() << "expected the rank-2 error";
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
      EXPECT_EQ(e.message(), "rank 2: rank two rejects its input");
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 30.0);
  }
}

TEST(LocalCommTest, ThreadStartFailureIsAnErrorNotTerminate) {
  // A machine out of threads makes std::thread's constructor throw. Before the fix the vector
  // of joinable threads was destroyed during unwinding: std::terminate. Now the started ranks
  // (waiting in a collective for the missing ones) are aborted and joined, and run() throws.
  // Default 300 s timeout: the abort must wake them, not their timeout.
  LocalWorldOptions o = options_for(kThreads, std::chrono::seconds(300));
  o.start_thread = refuse_thread_start(2);
  LocalWorld world(DeviceMesh(1, 4, 1), o);
  std::atomic<int> ran{0};
  const auto t0 = std::chrono::steady_clock::now();
  try {
    world.run([&](RankComms& comms) {
      ++ran;
      Tensor t = Tensor::from_vector(Shape{1}, std::vector<float>{1.0f});
      comms.group({MeshDim::kDpShard}).all_reduce(t, ReduceOp::kSum);
    });
    FAIL() << "expected the thread-start error";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kRuntime);
    EXPECT_NE(e.message().find("could not start the thread of rank 2 of 4 (2 running)"),
              std::string::npos)
        << e.message();
    EXPECT_NE(e.message().find("thread start refused by the test"), std::string::npos)
        << e.message();
  }
  EXPECT_EQ(ran.load(), 2);  // ranks 0 and 1 ran and were joined
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 30.0);  // not the 300 s timeout; generous for a loaded 2-core machine
  // The world stays usable after the failure.
  o.start_thread = nullptr;
  LocalWorld again(DeviceMesh(1, 2, 1), o);
  EXPECT_NO_THROW(again.run([](RankComms&) {}));
}

TEST(LocalCommTest, MismatchedCallsAndBadBuffersAreErrors) {
  LocalWorld world(DeviceMesh(1, 2, 1), short_timeout());
  try {
    world.run([&](RankComms& comms) {
      Tensor t = Tensor::zeros(Shape{comms.rank() + 1}, DType::kFloat32, kernels::Device::cpu());
      comms.group({MeshDim::kDpShard}).all_reduce(t, ReduceOp::kSum);
    });
    FAIL() << "expected a mismatch error";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kRuntime);
    EXPECT_NE(std::string(e.message()).find("mismatched collective calls"), std::string::npos)
        << e.message();
  }
  try {
    world.run([&](RankComms& comms) {
      Tensor t = Tensor::zeros(Shape{4}, DType::kInt32, kernels::Device::cpu());
      comms.group({MeshDim::kDpShard}).all_reduce(t, ReduceOp::kSum);
    });
    FAIL() << "expected an input error";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.message()).find("must be float32"), std::string::npos) << e.message();
  }
  try {
    world.run([&](RankComms& comms) {
      Tensor in = Tensor::zeros(Shape{4}, DType::kFloat32, kernels::Device::cpu());
      Tensor out = Tensor::zeros(Shape{7}, DType::kFloat32, kernels::Device::cpu());
      comms.group({MeshDim::kDpShard}).all_gather(in, out);
    });
    FAIL() << "expected an input error";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.message()).find("must hold 2 x input"), std::string::npos)
        << e.message();
  }
}

TEST(LocalCommTest, BusBandwidthFactorsFollowNcclTests) {
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(CollectiveKind::kAllReduce, 8), 2.0 * 7 / 8);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(CollectiveKind::kAllGather, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(CollectiveKind::kReduceScatter, 2), 0.5);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(CollectiveKind::kBroadcast, 8), 1.0);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(CollectiveKind::kAllToAll, 4), 0.75);
}

// all_to_all_v: member a sends (a + 2b) % 3 elements to member b (zeros included), element j of
// that segment value(a, 10 b + j); counts exchanged first as int64 (every count 1), as the MoE
// dispatch does; member order on receipt.
TEST(LocalCommTest, AllToAllVUnevenCountsAndCountExchange) {
  for (int n : {1, 2, 3, 4}) {
    LocalWorld world(DeviceMesh(1, n, 1), short_timeout());
    world.run([&](RankComms& comms) {
      Communicator& c = comms.group({MeshDim::kDpShard});
      const int me = c.rank();
      auto cnt = [](int a, int b) -> int64_t { return (a + 2 * b) % 3; };
      std::vector<int64_t> sc(static_cast<size_t>(n));
      std::vector<float> send;
      for (int b = 0; b < n; ++b) {
        sc[static_cast<size_t>(b)] = cnt(me, b);
        for (int64_t j = 0; j < cnt(me, b); ++j) send.push_back(value(me, 10 * b + j));
      }
      // Counts first: an int64 all-to-all with every count 1.
      const std::vector<int64_t> ones(static_cast<size_t>(n), 1);
      Tensor sc_t = Tensor::from_vector<int64_t>(Shape{n}, sc);
      Tensor rc_t = Tensor::zeros(Shape{n}, DType::kInt64, kernels::Device::cpu());
      c.all_to_all_v(sc_t, ones, rc_t, ones);
      const std::vector<int64_t> rc = rc_t.to_vector<int64_t>();
      std::vector<float> want;
      for (int a = 0; a < n; ++a) {
        ASSERT_EQ(rc[static_cast<size_t>(a)], cnt(a, me));
        for (int64_t j = 0; j < cnt(a, me); ++j) want.push_back(value(a, 10 * me + j));
      }
      Tensor in = Tensor::from_vector<float>(Shape{static_cast<int64_t>(send.size())}, send);
      Tensor out = Tensor::zeros(Shape{static_cast<int64_t>(want.size())}, DType::kFloat32,
                                 kernels::Device::cpu());
      c.all_to_all_v(in, sc, out, rc);
      EXPECT_EQ(out.to_vector<float>(), want) << "rank " << me << " of " << n;
      EXPECT_EQ(c.stats(CollectiveKind::kAllToAll).count, 2);
      EXPECT_EQ(c.stats(CollectiveKind::kAllToAll).bytes.value,
                n * 8 + static_cast<int64_t>(send.size()) * 4);
    });
  }
}

// A receive count that disagrees with the sender's, and counts that do not sum to the buffers,
// are input errors naming the collective.
TEST(LocalCommTest, AllToAllVCountMismatchesAreErrors) {
  LocalWorld world(DeviceMesh(1, 2, 1), short_timeout());
  try {
    world.run([&](RankComms& comms) {
      Communicator& c = comms.group({MeshDim::kDpShard});
      Tensor in = Tensor::zeros(Shape{2}, DType::kFloat32, kernels::Device::cpu());
      // Rank 1 expects 2 elements from rank 0, which sends 1.
      const std::vector<int64_t> rc =
          c.rank() == 1 ? std::vector<int64_t>{2, 1} : std::vector<int64_t>{1, 1};
      Tensor out = Tensor::zeros(Shape{rc[0] + rc[1]}, DType::kFloat32, kernels::Device::cpu());
      c.all_to_all_v(in, {1, 1}, out, rc);
    });
    FAIL() << "expected a count mismatch";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.message()).find("sends 1 elements to rank 1, which expects 2"),
              std::string::npos)
        << e.message();
  }
  try {
    world.run([&](RankComms& comms) {
      Tensor in = Tensor::zeros(Shape{3}, DType::kFloat32, kernels::Device::cpu());
      Tensor out = Tensor::zeros(Shape{2}, DType::kFloat32, kernels::Device::cpu());
      comms.group({MeshDim::kDpShard}).all_to_all_v(in, {1, 1}, out, {1, 1});
    });
    FAIL() << "expected an input error";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.message()).find("send counts sum to 2"), std::string::npos)
        << e.message();
  }
}

}  // namespace
}  // namespace meshproof::mesh

// ---- point-to-point (pipeline stages) ----------------------------------------------------------

namespace meshproof::mesh {
namespace {

// Send/recv over the pp group of a pp = 4 x dp_shard = 2 mesh: every stage passes a buffer to
// the next and gets one back, bit for bit (fp32 with NaN payloads and denormals, bf16, uint8),
// in send order (two messages per hop), and the stats count each call and its bytes.
TEST(LocalP2pTest, SendRecvIsBitwiseOrderedAndCounted) {
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode.name);
    const DeviceMesh mesh(1, 2, 1, 4);
    LocalWorld world(mesh, options_for(mode));
    world.run([&](RankComms& comms) {
      Communicator& pp = comms.group({MeshDim::kPp});
      ASSERT_EQ(pp.size(), 4);
      EXPECT_EQ(pp.ranks(), mesh.group_ranks(comms.rank(), {MeshDim::kPp}));
      const int s = pp.rank();
      const auto bits_of = [](int from, int which) {
        std::vector<uint32_t> v = {0x7fc00001u + static_cast<uint32_t>(from),  // NaN payload
                                   0x00000001u,                                // denormal
                                   0x80000000u,                                // -0
                                   static_cast<uint32_t>(from * 1000 + which)};
        Tensor t = Tensor::empty(Shape{4}, DType::kFloat32, kernels::Device::cpu());
        std::memcpy(t.raw_data(), v.data(), 16);
        return t;
      };
      if (s + 1 < pp.size()) {
        pp.send(bits_of(s, 0), s + 1);
        pp.send(bits_of(s, 1), s + 1);
        Tensor bytes = Tensor::from_vector(Shape{3}, std::vector<uint8_t>{1, 2, uint8_t(s)});
        pp.send(bytes, s + 1);
      }
      if (s > 0) {
        for (int which = 0; which < 2; ++which) {
          Tensor got = Tensor::empty(Shape{4}, DType::kFloat32, kernels::Device::cpu());
          pp.recv(got, s - 1);
          EXPECT_EQ(std::memcmp(got.raw_data(), bits_of(s - 1, which).raw_data(), 16), 0)
              << "stage " << s << " message " << which;
        }
        Tensor bytes = Tensor::empty(Shape{3}, DType::kUInt8, kernels::Device::cpu());
        pp.recv(bytes, s - 1);
        EXPECT_EQ(bytes.to_vector<uint8_t>(), (std::vector<uint8_t>{1, 2, uint8_t(s - 1)}));
      }
      // The way back (gradients), bf16.
      if (s > 0) {
        Tensor g = Tensor::from_vector(Shape{2}, std::vector<float>{float(s), -float(s)});
        pp.send(kernels::cast_to(g, DType::kBFloat16), s - 1);
      }
      if (s + 1 < pp.size()) {
        Tensor got = Tensor::empty(Shape{2}, DType::kBFloat16, kernels::Device::cpu());
        pp.recv(got, s + 1);
        EXPECT_EQ(kernels::cast_to(got, DType::kFloat32).to_vector<float>(),
                  (std::vector<float>{float(s + 1), -float(s + 1)}));
      }
      const int64_t sends = (s + 1 < pp.size() ? 3 : 0) + (s > 0 ? 1 : 0);
      const int64_t recvs = (s > 0 ? 3 : 0) + (s + 1 < pp.size() ? 1 : 0);
      EXPECT_EQ(pp.stats(CollectiveKind::kSend).count, sends);
      EXPECT_EQ(pp.stats(CollectiveKind::kRecv).count, recvs);
      if (s == 0) {
        EXPECT_EQ(pp.stats(CollectiveKind::kSend).bytes.value, 16 + 16 + 3);
      }
    });
  }
}

// A receive into a buffer of another dtype or size fails naming both ends; a peer outside the
// group or this member itself is an input error; a receive nobody sends to times out with the
// silent peer named.
TEST(LocalP2pTest, MismatchesBadPeersAndMissingSendersAreErrors) {
  LocalWorld world(DeviceMesh(1, 1, 1, 2), short_timeout());
  try {
    world.run([&](RankComms& comms) {
      Communicator& pp = comms.group({MeshDim::kPp});
      if (pp.rank() == 0) {
        pp.send(Tensor::from_vector(Shape{3}, std::vector<float>{1, 2, 3}), 1);
      } else {
        Tensor wrong = Tensor::empty(Shape{4}, DType::kFloat32, kernels::Device::cpu());
        pp.recv(wrong, 0);
      }
    });
    FAIL() << "expected a size mismatch";
  } catch (const kernels::Error& e) {
    EXPECT_NE(e.message().find("rank 0 sent 3 elements of float32 but rank 1 receives into"),
              std::string::npos)
        << e.message();
  }
  LocalWorld one(DeviceMesh(1, 1, 1, 2), short_timeout());
  one.run([&](RankComms& comms) {
    Communicator& pp = comms.group({MeshDim::kPp});
    Tensor t = Tensor::zeros(Shape{1}, DType::kFloat32, kernels::Device::cpu());
    for (int bad : {pp.rank(), 2, -1}) {
      try {
        pp.send(t, bad);
        ADD_FAILURE() << "send to " << bad << " accepted";
      } catch (const kernels::Error& e) {
        EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
        EXPECT_NE(e.message().find("is not another member of the group"), std::string::npos);
      }
    }
  });
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode.name);
    LocalWorld silent(DeviceMesh(1, 1, 1, 2), options_for(mode, std::chrono::milliseconds(300)));
    try {
      silent.run([&](RankComms& comms) {
        Communicator& pp = comms.group({MeshDim::kPp});
        if (pp.rank() == 1) {
          Tensor t = Tensor::empty(Shape{1}, DType::kFloat32, kernels::Device::cpu());
          pp.recv(t, 0);
        }
      });
      FAIL() << "expected a timeout";
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kRuntime);
      EXPECT_NE(e.message().find("local recv on pp group of ranks [0, 1] timed out"),
                std::string::npos)
          << e.message();
      EXPECT_NE(e.message().find("rank 0 never sent"), std::string::npos) << e.message();
    }
  }
}

// An error on one stage wakes a stage waiting in recv (abort), instead of leaving it to time out.
TEST(LocalP2pTest, ExceptionOnOneStageAbortsAWaitingRecv) {
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode.name);
    LocalWorld world(DeviceMesh(1, 1, 1, 2), options_for(mode));
    const auto t0 = std::chrono::steady_clock::now();
    try {
      world.run([&](RankComms& comms) {
        Communicator& pp = comms.group({MeshDim::kPp});
        if (pp.rank() == 0) MP_FAIL("stage 0 failed");
        Tensor t = Tensor::empty(Shape{1}, DType::kFloat32, kernels::Device::cpu());
        pp.recv(t, 0);
      });
      FAIL() << "expected the stage's error";
    } catch (const kernels::Error& e) {
      EXPECT_NE(e.message().find("stage 0 failed"), std::string::npos) << e.message();
    }
    // Hang guard only: far below the 20 s timeout means the abort woke the receiver.
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 15.0);
  }
}

// ---- virtual ranks as fibers (mesh/local/rank_fibers.h)
// ---------------------------------------------

// Raises a barrier while the stack unwinds: the rank waits with an exception in flight.
struct BarrierWhileUnwinding {
  Communicator& c;
  int& uncaught_seen;
  ~BarrierWhileUnwinding() {
    c.barrier();
    uncaught_seen = std::uncaught_exceptions();
  }
};

// Each rank sees its own rank context (rank, memory tracker) and its own exception state across
// the waits in which its worker runs the other ranks: every rank waits inside a catch block (then
// rethrows with `throw;`, which reads the chain of caught exceptions) and during unwinding, while
// the other ranks throw and catch their own. Without the swap of the C++ runtime's exception state
// a rank on a shared worker rethrows another rank's exception.
TEST(RankFibers, RankContextAndExceptionStateArePerRank) {
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode.name);
    const int n = 5;
    LocalWorld world(DeviceMesh(1, n, 1), options_for(mode));
    world.run([&](RankComms& comms) {
      Communicator& c = comms.group({MeshDim::kDpShard});
      const int r = comms.rank();
      // A buffer of the rank's own size, accounted to the rank's own tracker.
      const Tensor mine =
          Tensor::zeros(Shape{(r + 1) * 1000}, DType::kFloat32, kernels::Device::cpu());
      for (int round = 0; round < 3; ++round) {
        const std::string what = fmt::format("rank {} round {}", r, round);
        try {
          throw std::runtime_error(what);
        } catch (const std::runtime_error& e) {
          c.barrier();  // the others throw and catch theirs meanwhile
          EXPECT_EQ(std::string(e.what()), what);
          EXPECT_EQ(std::uncaught_exceptions(), 0);
          try {
            throw;
          } catch (const std::runtime_error& again) {
            EXPECT_EQ(std::string(again.what()), what) << "rethrew another rank's exception";
          }
        }
        EXPECT_EQ(std::current_exception(), nullptr);
        int uncaught_seen = -1;
        try {
          BarrierWhileUnwinding guard{c, uncaught_seen};
          throw std::logic_error(what);
        } catch (const std::logic_error& e) {
          EXPECT_EQ(std::string(e.what()), what);
        }
        EXPECT_EQ(uncaught_seen, 1);
        EXPECT_EQ(kernels::current_context().rank, r);
      }
      EXPECT_EQ(kernels::current_context().rank, r);
      EXPECT_EQ(kernels::current_context().memory->current(kernels::DeviceType::kCpu).value,
                mine.nbytes().value);
    });
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(world.memory(r).peak(kernels::DeviceType::kCpu).value, (r + 1) * 1000 * 4)
          << "rank " << r;
    }
  }
}

// Fibers run on as many worker threads as asked (never more than the ranks), rank r on worker
// r mod workers for its whole life; a thread per rank otherwise.
TEST(RankFibers, RanksStayOnTheirWorkers) {
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode.name);
    const int n = 6;
    std::vector<std::vector<std::thread::id>> seen(n);
    LocalWorld world(DeviceMesh(1, n, 1), options_for(mode));
    world.run([&](RankComms& comms) {
      Communicator& c = comms.group({MeshDim::kDpShard});
      auto& mine = seen[static_cast<size_t>(comms.rank())];
      for (int i = 0; i < 4; ++i) {
        mine.push_back(std::this_thread::get_id());
        Tensor t = Tensor::from_vector(Shape{1}, std::vector<float>{1.0f});
        c.all_reduce(t, ReduceOp::kSum);
      }
    });
    const int threads = mode.workers > 0 ? mode.workers : n;
    std::set<std::thread::id> distinct;
    for (int r = 0; r < n; ++r) {
      const auto& ids = seen[static_cast<size_t>(r)];
      ASSERT_EQ(ids.size(), 4u);
      for (const auto& id : ids) EXPECT_EQ(id, ids[0]) << "rank " << r << " changed threads";
      distinct.insert(ids[0]);
      if (mode.workers > 0 && r >= mode.workers) {
        EXPECT_EQ(ids[0], seen[static_cast<size_t>(r - mode.workers)][0]) << "rank " << r;
      }
    }
    EXPECT_EQ(static_cast<int>(distinct.size()), threads);
  }
}

// Which way a world runs: a thread per rank when asked, for device ranks and for one rank; fibers
// when asked (workers: the option, else the CPUs, never more than the ranks); auto: fibers only
// when the host ranks outnumber the CPUs this process may use.
TEST(RankFibers, ThreadingDecision) {
  LocalWorldOptions o;
  o.threading = RankThreading::kThreads;
  EXPECT_EQ(local_fiber_workers(64, o), 0);
  o.threading = RankThreading::kFibers;
  EXPECT_EQ(local_fiber_workers(1, o), 0);
  o.fiber_workers = 3;
  EXPECT_EQ(local_fiber_workers(8, o), 3);
  EXPECT_EQ(local_fiber_workers(2, o), 2);
  o.device = kernels::Device::cuda(0);
  EXPECT_EQ(local_fiber_workers(8, o), 0);
  o = LocalWorldOptions{};
  o.threading = RankThreading::kAuto;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int cpus = CPU_COUNT(&set);
  EXPECT_EQ(local_fiber_workers(cpus, o), 0);
  EXPECT_EQ(local_fiber_workers(cpus + 1, o), cpus);
  EXPECT_EQ(local_fiber_workers(4 * cpus, o), cpus);
#endif
}

// The same decision through the narrow overload the run rules use (device, threading).
TEST(RankFibers, ThreadingDecisionWithoutOptions) {
  EXPECT_EQ(local_fiber_workers(64, kernels::Device::cpu(), RankThreading::kThreads), 0);
  EXPECT_EQ(local_fiber_workers(8, kernels::Device::cpu(), RankThreading::kFibers, 3), 3);
  EXPECT_EQ(local_fiber_workers(8, kernels::Device::cuda(0), RankThreading::kFibers), 0);
  EXPECT_EQ(local_fiber_workers(64, kernels::Device::cpu(), RankThreading::kFibers),
            std::min(64, mesh::usable_cpus()));
}

// The spin budget of a fiber worker: grows while the waits are short enough for a full spin to
// cover them, shrinks (towards sleeping at once) while they are not, never beyond its bounds.
TEST(RankFibers, SpinBudgetAdaptsToTheWaits) {
  using mesh::detail::kFiberSpinMax;
  using mesh::detail::kFiberSpinMin;
  using mesh::detail::next_fiber_spin;
  using std::chrono::microseconds;
  EXPECT_EQ(next_fiber_spin(microseconds(5), microseconds(3)), microseconds(10));
  EXPECT_EQ(next_fiber_spin(kFiberSpinMax, microseconds(1)), kFiberSpinMax);
  EXPECT_EQ(next_fiber_spin(kFiberSpinMax, kFiberSpinMax), kFiberSpinMax);
  // A wait a full spin would have covered, after the budget fell to nothing: spinning again.
  EXPECT_EQ(next_fiber_spin(microseconds(0), microseconds(20)), kFiberSpinMin);
  EXPECT_EQ(next_fiber_spin(kFiberSpinMax, kFiberSpinMax + microseconds(1)), kFiberSpinMax / 2);
  // Long waits in a row (the other worker descheduled): below kFiberSpinMin within 5 waits.
  std::chrono::nanoseconds spin = kFiberSpinMax;
  for (int i = 0; i < 5; ++i) spin = next_fiber_spin(spin, std::chrono::milliseconds(3));
  EXPECT_LT(spin, kFiberSpinMin);
}

// MESHPROOF_VIRTUAL_RANKS: auto (or unset), threads, fibers; anything else is an input error
// naming the variable.
TEST(RankFibers, ThreadingFromEnvironment) {
  test_env::ScopedEnv env(kVirtualRanksEnv, nullptr);
  EXPECT_EQ(rank_threading_from_env(), RankThreading::kAuto);
  for (RankThreading t : {RankThreading::kAuto, RankThreading::kThreads, RankThreading::kFibers}) {
    env.set(rank_threading_name(t));
    EXPECT_EQ(rank_threading_from_env(), t);
    EXPECT_EQ(LocalWorldOptions{}.threading, t);
  }
  for (const char* bad : {"fiber", "THREADS", "1"}) {
    env.set(bad);
    try {
      (void)rank_threading_from_env();
      ADD_FAILURE() << "accepted " << bad;
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
      EXPECT_NE(e.message().find(std::string("MESHPROOF_VIRTUAL_RANKS=") + bad +
                                 ": expected auto, threads or fibers"),
                std::string::npos)
          << e.message();
    }
  }
}

// A fiber worker thread that cannot start: the running workers' ranks are aborted and joined,
// and run() names the worker and its ranks (not the aborts it caused).
TEST(RankFibers, WorkerStartFailureIsAnError) {
  LocalWorldOptions o = options_for(kModes[2], std::chrono::seconds(300));
  o.start_thread = refuse_thread_start(1);
  LocalWorld world(DeviceMesh(1, 4, 1), o);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    world.run([&](RankComms& comms) {
      Tensor t = Tensor::from_vector(Shape{1}, std::vector<float>{1.0f});
      comms.group({MeshDim::kDpShard}).all_reduce(t, ReduceOp::kSum);
    });
    FAIL() << "expected the worker-start error";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kRuntime);
    EXPECT_NE(e.message().find("could not start fiber worker thread 1 of 2 (ranks 1, 3, ...; 1 "
                               "running): thread start refused by the test"),
              std::string::npos)
        << e.message();
  }
  // Not the 300 s timeout; generous for a loaded 2-core machine.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
}

}  // namespace
}  // namespace meshproof::mesh
