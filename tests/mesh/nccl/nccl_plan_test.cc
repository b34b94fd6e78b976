// Host logic of the NCCL communicators (mesh/nccl/nccl_comm.h), on any machine: which mesh groups
// share a communicator (dims of size 1 do not change a group's members), the splits every rank
// makes, and the per-process cache that makes each set once and reuses it until teardown.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mesh/nccl/nccl_comm.h"

namespace meshproof::mesh {
namespace {

// With pp > 1 the pipeline dim's sets get slots too (DeviceMesh::group_slots: 16), and the world
// is the set of all four dims.
TEST(NcclPlan, GroupsThatDifferOnlyBySize1DimsShareACommunicator) {
  for (const DeviceMesh& mesh : {DeviceMesh(1, 4, 2), DeviceMesh(2, 2, 2), DeviceMesh(2, 1, 1),
                                 DeviceMesh(1, 1, 1), DeviceMesh(3, 1, 2), DeviceMesh(1, 2, 1, 2),
                                 DeviceMesh(2, 1, 2, 2), DeviceMesh(1, 1, 1, 4)}) {
    SCOPED_TRACE(mesh.str());
    const std::vector<unsigned> plan = nccl_group_plan(mesh);
    ASSERT_EQ(plan.size(), mesh.group_slots());
    ASSERT_EQ(plan.size(), mesh.size(MeshDim::kPp) > 1 ? 1u << kNumGroupDims : 1u << kNumMeshDims);
    for (unsigned a = 0; a < plan.size(); ++a) {
      // The canonical set is a subset of the group's dims and spans the same ranks.
      EXPECT_EQ(plan[a] & ~a, 0u);
      EXPECT_EQ(plan[plan[a]], plan[a]);
      for (int rank = 0; rank < mesh.world_size(); ++rank)
        EXPECT_EQ(mesh.group_ranks(rank, DimSet::from_bits(a)),
                  mesh.group_ranks(rank, DimSet::from_bits(plan[a])));
      // Distinct canonical sets really are different groups somewhere.
      for (unsigned b = 0; b < plan.size(); ++b) {
        if (plan[a] == plan[b]) continue;
        bool differ = false;
        for (int rank = 0; rank < mesh.world_size(); ++rank)
          differ |= mesh.group_ranks(rank, DimSet::from_bits(a)) !=
                    mesh.group_ranks(rank, DimSet::from_bits(b));
        EXPECT_TRUE(differ) << a << " vs " << b;
      }
    }
  }
  // 8 dim sets; with dp_replicate = 1 four distinct communicators, with every dim > 1 eight.
  EXPECT_EQ(nccl_distinct_splits(nccl_group_plan(DeviceMesh(1, 4, 2))),
            (std::vector<unsigned>{0, 2, 4, 6}));
  EXPECT_EQ(nccl_distinct_splits(nccl_group_plan(DeviceMesh(2, 2, 2))).size(), 8u);
  // pp 2 x dp_shard 2: the sets {}, {dp_shard}, {pp}, {pp, dp_shard}.
  EXPECT_EQ(nccl_distinct_splits(nccl_group_plan(DeviceMesh(1, 2, 1, 2))),
            (std::vector<unsigned>{0, 2, 8, 10}));
  EXPECT_EQ(nccl_distinct_splits(nccl_group_plan(DeviceMesh(1, 1, 1))), (std::vector<unsigned>{0}));
}

struct FakeComms {
  int id = 0;
};

TEST(NcclPlan, CacheMakesEachKeyOnceAndHandsEverythingBackForTeardown) {
  CommCache<FakeComms> cache;
  int made = 0;
  auto make = [&made] { return std::make_unique<FakeComms>(FakeComms{++made}); };
  const NcclCommKey a{"dp_replicate=1,dp_shard=2,tp=1", {0, 1}, {0, 1}};
  const NcclCommKey b{"dp_replicate=1,dp_shard=1,tp=2", {0, 1}, {0, 1}};
  const NcclCommKey a_rank1{"dp_replicate=1,dp_shard=2,tp=1", {1}, {}};
  bool created = false;
  FakeComms& first = cache.get_or_create(a, make, &created);
  EXPECT_TRUE(created);
  // A scenario's later runs on the same mesh reuse the set (no second creation).
  for (int run = 0; run < 3; ++run) {
    EXPECT_EQ(&cache.get_or_create(a, make, &created), &first);
    EXPECT_FALSE(created);
  }
  EXPECT_EQ(made, 1);
  EXPECT_EQ(cache.get_or_create(b, make).id, 2);
  EXPECT_EQ(cache.get_or_create(a_rank1, make).id, 3);  // another rank set: another key
  EXPECT_EQ(cache.size(), 3u);
  EXPECT_EQ(cache.creations(), 3);
  // A failed run drops its set; the next run makes a fresh one.
  std::unique_ptr<FakeComms> dropped = cache.take(b);
  ASSERT_NE(dropped, nullptr);
  EXPECT_EQ(dropped->id, 2);
  EXPECT_EQ(cache.take(b), nullptr);
  EXPECT_EQ(cache.get_or_create(b, make).id, 4);
  // Teardown gets every set, oldest first, and leaves the cache empty.
  const std::vector<std::unique_ptr<FakeComms>> all = cache.take_all();
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0]->id, 1);
  EXPECT_EQ(all[1]->id, 3);
  EXPECT_EQ(all[2]->id, 4);
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(cache.creations(), 4);
}

// One rank's teardown (State::destroy): every split finalized then destroyed in split order, then
// the world; a failed split's null handle is skipped; a failure is reported and the rest still
// runs (nothing leaks).
TEST(NcclPlan, RankTeardownFinalizesAndDestroysChildrenBeforeTheWorld) {
  std::vector<std::string> log;
  auto op = [&log](const char* what, int fail_on) {
    return [&log, what, fail_on](int c) {
      log.push_back(fmt::format("{} {}", what, c));
      return c == fail_on ? std::string("boom") : std::string();
    };
  };
  EXPECT_EQ(finalize_and_destroy<int>({11, 0, 12}, 10, op("finalize", -1), op("destroy", -1)), "");
  EXPECT_EQ(log, (std::vector<std::string>{"finalize 11", "destroy 11", "finalize 12", "destroy 12",
                                           "finalize 10", "destroy 10"}));
  log.clear();
  EXPECT_EQ(finalize_and_destroy<int>({11, 12}, 10, op("finalize", 11), op("destroy", 10)),
            "finalize split 0: boom");
  EXPECT_EQ(log.size(), 6u) << "a failure must not stop the teardown";
  log.clear();
  EXPECT_EQ(finalize_and_destroy<int>({}, 0, op("finalize", -1), op("destroy", -1)), "");
  EXPECT_TRUE(log.empty());  // nothing made (the world's init failed): nothing to do
}

// The ranks of one set are destroyed at the same time, one thread each: every fake rank waits at a
// rendezvous of all of them, as NCCL's finalize waits for its peers. Destroying them one after
// another from one thread would never get past the first (here: its wait times out and fails).
TEST(NcclPlan, TeardownRunsEveryRankOfASetInParallel) {
  for (size_t members : {size_t{1}, size_t{3}, size_t{8}}) {
    SCOPED_TRACE(members);
    std::mutex mu;
    std::condition_variable cv;
    size_t arrived = 0;
    std::set<std::thread::id> threads;
    const std::vector<std::string> errors = destroy_in_parallel(members, [&](size_t m) {
      std::unique_lock<std::mutex> lock(mu);
      threads.insert(std::this_thread::get_id());
      ++arrived;
      cv.notify_all();
      // A hang guard only (the peers arrive within microseconds when run in parallel).
      if (!cv.wait_for(lock, std::chrono::seconds(30), [&] { return arrived == members; }))
        throw std::runtime_error(fmt::format("rank {} waited alone", m));
    });
    EXPECT_TRUE(errors.empty()) << fmt::format("{}", fmt::join(errors, "; "));
    EXPECT_EQ(arrived, members);
    EXPECT_EQ(threads.size(), members) << "one thread per rank";
  }
  // Failures are collected per member, in member order, after every member ran.
  std::atomic<int> ran{0};
  const std::vector<std::string> errors = destroy_in_parallel(4, [&ran](size_t m) {
    ++ran;
    if (m % 2 == 1) throw std::runtime_error(fmt::format("rank {} failed", m));
  });
  EXPECT_EQ(ran.load(), 4);
  EXPECT_EQ(errors,
            (std::vector<std::string>{"member 1: rank 1 failed", "member 3: rank 3 failed"}));
}

// With nothing cached (no GPU here, or no NCCL run in this process) teardown has nothing to do.
TEST(NcclPlan, TeardownWithNothingCachedIsANoOp) {
  EXPECT_EQ(nccl_comm_sets_cached(), 0u);
  EXPECT_EQ(nccl_teardown(), 0);
  EXPECT_EQ(nccl_teardown(), 0);
}

}  // namespace
}  // namespace meshproof::mesh
