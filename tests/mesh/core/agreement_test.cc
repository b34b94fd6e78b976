// Outcome agreement (mesh/core/agreement.h) on the local communicator: with no failure every member
// returns (and learns the largest value); with failures every member throws, the failing ones
// their own error and the others the gravest kind with the lowest such member's message and
// global rank, whatever the group, the mix of kinds and the way the ranks are scheduled.
#include "mesh/core/agreement.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/core/error.h"
#include "mesh/local/local_comm.h"

namespace meshproof::mesh {
namespace {

using kernels::ErrorKind;

// What one rank's agree_on_outcome did: returned a value, or threw.
struct Outcome {
  std::optional<int64_t> value;
  bool threw = false;
  bool kernels_error = false;
  ErrorKind kind = ErrorKind::kRuntime;
  std::string message;  // kernels::Error::message() or what()
  std::string file;     // kernels::Error::file(): tells a rethrown error from a new one
};

// Threads, and fibers on one worker (every wait hands the worker to another rank).
std::vector<LocalWorldOptions> schedules() {
  LocalWorldOptions threads;
  threads.timeout = std::chrono::seconds(20);
  threads.threading = RankThreading::kThreads;
  LocalWorldOptions fibers = threads;
  fibers.threading = RankThreading::kFibers;
  fibers.fiber_workers = 1;
  return {threads, fibers};
}

// Runs `body(group, global rank)` on every rank of `mesh` over the group `dims`, catching what
// each rank's agreement throws (an uncaught throw would abort the world instead).
template <typename Body>
std::vector<Outcome> run(const DeviceMesh& mesh, DimSet dims, const LocalWorldOptions& options,
                         Body body) {
  std::vector<Outcome> out(static_cast<size_t>(mesh.world_size()));
  LocalWorld world(mesh, options);
  world.run([&](RankComms& comms) {
    Outcome& o = out[static_cast<size_t>(comms.rank())];
    try {
      o.value = body(comms.group(dims), comms.rank());
    } catch (const kernels::Error& e) {
      o.threw = o.kernels_error = true;
      o.kind = e.kind();
      o.message = e.message();
      o.file = e.file();
    } catch (const std::exception& e) {
      o.threw = true;
      o.message = e.what();
    } catch (...) {  // a member's own non-exception, rethrown
      o.threw = true;
    }
  });
  return out;
}

// A kernels::Error of `kind` as MP_CHECK* throws it, from this file.
std::exception_ptr error_of(ErrorKind kind, const std::string& message) {
  return std::make_exception_ptr(kernels::Error(kind, "agreement_test.cc", 1, "", message));
}

TEST(Agreement, WithoutFailuresEveryMemberReturnsTheLargestValue) {
  for (const LocalWorldOptions& options : schedules()) {
    for (int n = 1; n <= 8; ++n) {
      const auto out = run(
          DeviceMesh(1, n, 1), DimSet{MeshDim::kDpShard}, options, [](Communicator& g, int rank) {
            agree_on_outcome(g, nullptr, "step");  // no value carried
            // Member r offers 3r + 1, except the middle one offers the most.
            const int64_t mine = rank == g.size() / 2 ? (int64_t{1} << 24) - 1 : 3 * rank + 1;
            return agree_on_outcome(g, nullptr, mine, "step");
          });
      for (size_t r = 0; r < out.size(); ++r) {
        ASSERT_FALSE(out[r].threw) << n << " members, rank " << r << ": " << out[r].message;
        EXPECT_EQ(*out[r].value, (int64_t{1} << 24) - 1) << n << " members, rank " << r;
      }
    }
  }
}

TEST(Agreement, OneFailureReachesEveryMemberWithItsKindAndRank) {
  const ErrorKind kinds[] = {ErrorKind::kInput, ErrorKind::kIntegrity, ErrorKind::kRuntime};
  for (const LocalWorldOptions& options : schedules()) {
    for (const ErrorKind kind : kinds) {
      for (int failing = 0; failing < 4; ++failing) {
        const auto out =
            run(DeviceMesh(1, 4, 1), DimSet{MeshDim::kDpShard}, options,
                [&](Communicator& g, int rank) -> int64_t {
                  agree_on_outcome(g, rank == failing ? error_of(kind, "disk full") : nullptr,
                                   "checkpoint save (commit)");
                  return 0;
                });
        for (int r = 0; r < 4; ++r) {
          const Outcome& o = out[static_cast<size_t>(r)];
          const std::string ctx =
              fmt::format("kind {}, failing {}, rank {}", static_cast<int>(kind), failing, r);
          ASSERT_TRUE(o.threw && o.kernels_error) << ctx;
          EXPECT_EQ(o.kind, kind) << ctx;
          if (r == failing) {  // its own error, rethrown as it was
            EXPECT_EQ(o.message, "disk full") << ctx;
            EXPECT_EQ(o.file, "agreement_test.cc") << ctx;
          } else {
            EXPECT_EQ(o.message,
                      fmt::format("checkpoint save (commit) failed on rank {}: disk full", failing))
                << ctx;
            EXPECT_NE(o.file, "agreement_test.cc") << ctx;
          }
        }
      }
    }
  }
}

// Runtime outranks integrity outranks input; among equals the lowest member speaks. Exceptions
// that are not kernels::Error are runtime errors; a throw of a non-exception is "unknown error".
TEST(Agreement, TheGravestKindAndLowestMemberSpeakForAllFailures) {
  struct Case {
    std::vector<std::exception_ptr> errors;  // per member (8)
    ErrorKind kind;
    int speaker;
    std::string message;
  };
  const auto none = std::exception_ptr{};
  const auto input = [](int r) { return error_of(ErrorKind::kInput, fmt::format("input {}", r)); };
  const auto integrity = [](int r) {
    return error_of(ErrorKind::kIntegrity, fmt::format("integrity {}", r));
  };
  const auto runtime = [](int r) {
    return std::make_exception_ptr(std::runtime_error("std " + std::to_string(r)));
  };
  const std::vector<Case> cases = {
      {{none, input(1), none, integrity(3), none, input(5), integrity(6), none},
       ErrorKind::kIntegrity,
       3,
       "integrity 3"},
      {{input(0), input(1), none, none, none, none, none, input(7)},
       ErrorKind::kInput,
       0,
       "input 0"},
      {{none, integrity(1), none, none, runtime(4), none, runtime(6), none},
       ErrorKind::kRuntime,
       4,
       "std 4"},
      {{none, none, none, none, none, none, none, std::make_exception_ptr(42)},
       ErrorKind::kRuntime,
       7,
       "unknown error"},
  };
  for (const LocalWorldOptions& options : schedules()) {
    for (size_t c = 0; c < cases.size(); ++c) {
      const Case& k = cases[c];
      const auto out =
          run(DeviceMesh(1, 8, 1), DimSet{MeshDim::kDpShard}, options,
              [&](Communicator& g, int rank) -> int64_t {
                return agree_on_outcome(g, k.errors[static_cast<size_t>(rank)], 5, "load");
              });
      for (int r = 0; r < 8; ++r) {
        const Outcome& o = out[static_cast<size_t>(r)];
        const std::string ctx = fmt::format("case {}, rank {}", c, r);
        ASSERT_TRUE(o.threw) << ctx;
        if (k.errors[static_cast<size_t>(r)]) continue;  // its own error (previous test)
        ASSERT_TRUE(o.kernels_error) << ctx;
        EXPECT_EQ(o.kind, k.kind) << ctx;
        EXPECT_EQ(o.message, fmt::format("load failed on rank {}: {}", k.speaker, k.message))
            << ctx;
      }
    }
  }
}

// On a group that is not the world, the message names the failing member's global rank.
TEST(Agreement, MessagesNameTheGlobalRankOnASubGroup) {
  for (const LocalWorldOptions& options : schedules()) {
    // dp_shard 2 x tp 2: the tp groups are global ranks {0, 1} and {2, 3}.
    const auto out =
        run(DeviceMesh(1, 2, 2), DimSet{MeshDim::kTp}, options,
            [](Communicator& g, int rank) -> int64_t {
              return agree_on_outcome(g, rank == 3 ? error_of(ErrorKind::kInput, "bad") : nullptr,
                                      int64_t{rank}, "step");
            });
    EXPECT_EQ(*out[0].value, 1);  // the other group agreed on its own, without a failure
    EXPECT_EQ(*out[1].value, 1);
    EXPECT_EQ(out[2].message, "step failed on rank 3: bad");
    EXPECT_EQ(out[3].message, "bad");
  }
}

// A message longer than the broadcast buffer arrives cut to its first 2047 bytes; a value outside
// [0, 2^24) is its member's runtime error, agreed on like any other.
TEST(Agreement, LongMessagesAreCutAndBadValuesAreAgreedOn) {
  const std::string long_message(5000, 'x');
  for (const LocalWorldOptions& options : schedules()) {
    auto out =
        run(DeviceMesh(1, 2, 1), DimSet{MeshDim::kDpShard}, options,
            [&](Communicator& g, int rank) -> int64_t {
              agree_on_outcome(g, rank == 1 ? error_of(ErrorKind::kRuntime, long_message) : nullptr,
                               "save");
              return 0;
            });
    EXPECT_EQ(out[0].message, "save failed on rank 1: " + long_message.substr(0, 2047));
    EXPECT_EQ(out[1].message, long_message);

    for (const int64_t bad : {int64_t{-1}, int64_t{1} << 24}) {
      out = run(DeviceMesh(1, 2, 1), DimSet{MeshDim::kDpShard}, options,
                [&](Communicator& g, int rank) -> int64_t {
                  return agree_on_outcome(g, nullptr, rank == 0 ? bad : 0, "suffix");
                });
      const std::string want =
          fmt::format("suffix: value {} outside [0, 2^24) cannot be agreed on", bad);
      EXPECT_EQ(out[0].message, want);
      EXPECT_EQ(out[0].kind, ErrorKind::kRuntime);
      EXPECT_EQ(out[1].message, "suffix failed on rank 0: " + want);
      EXPECT_EQ(out[1].kind, ErrorKind::kRuntime);
    }
  }
}

}  // namespace
}  // namespace meshproof::mesh
