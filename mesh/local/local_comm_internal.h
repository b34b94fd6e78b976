// Internal to the local launcher (local_comm.cc, local_group.cc): the shared state of one run
// (LocalWorld::Impl: the abort flag, the first error and every group's rendezvous) and the
// rendezvous of one group (LocalWorld::Impl::Group: the calls the members publish, their staging
// buffers, the generation barrier with its watchdog and the point-to-point queues). The barrier,
// the watchdog and the queues are defined in local_group.cc; the communicators that move the
// collectives' data through a group, and the world's rank threads, in local_comm.cc.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "mesh/local/local_comm.h"
#include "mesh/local/rank_fibers.h"

namespace meshproof::mesh {

// Shared state of one run: the abort flag, the first error and every group's rendezvous.
struct LocalWorld::Impl {
  class Group;

  // What one member published for the current collective; every member checks that all agree.
  struct Slot {
    CollectiveKind kind = CollectiveKind::kBarrier;
    kernels::DType dtype = kernels::DType::kFloat32;
    int64_t numel = 0;
    int root = 0;
    ReduceOp op = ReduceOp::kSum;
    const void* ptr = nullptr;
    kernels::Device device;

    std::string str() const {
      return fmt::format("{}(dtype={}, numel={}, root={}, op={}, device={})", collective_name(kind),
                         kernels::dtype_name(dtype), numel, root, reduce_op_name(op), device.str());
    }
    bool same_call(const Slot& o) const {
      return kind == o.kind && dtype == o.dtype && numel == o.numel && root == o.root &&
             op == o.op && device.type == o.device.type;
    }
  };

  explicit Impl(const LocalWorld& w) : world(w) {}

  void abort();
  // Records a rank's error (the first one is rethrown by run()) and aborts the world.
  void fail(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(error_mu);
      if (!first_error) first_error = std::move(e);
    }
    abort();
  }

  // The one wait of rank code (barriers, point-to-point queues): until `word` no longer holds
  // `expected`, at most until `deadline`; may return early, the caller re-checks. With fibers the
  // worker runs the rank's neighbours meanwhile; with a thread per rank the thread sleeps on the
  // word (a futex: one system call to sleep, one to wake all sleepers, no mutex to take again).
  void wait_word(std::atomic<uint32_t>& word, uint32_t expected,
                 std::chrono::steady_clock::time_point deadline) {
    if (fibers != nullptr) {
      detail::FiberWorld::wait(word, expected, deadline);
    } else {
      detail::futex_wait(word, expected, deadline - std::chrono::steady_clock::now());
    }
  }
  // After changing a word that ranks may wait on.
  void notify_word(std::atomic<uint32_t>& word) {
    if (fibers != nullptr) {
      fibers->notify();
    } else {
      detail::futex_wake_all(word);
    }
  }

  const LocalWorld& world;
  detail::FiberWorld* fibers = nullptr;  // the ranks' fibers, when they run as fibers
  std::atomic<bool> aborted{false};
  std::mutex error_mu;
  std::exception_ptr first_error;
  // (DimSet bits, color) -> group
  std::map<std::pair<unsigned, int>, std::unique_ptr<Group>> groups;
};

class LocalWorld::Impl::Group {
 public:
  Group(Impl& impl, std::vector<int> ranks, std::string label)
      : impl_(impl),
        ranks_(std::move(ranks)),
        label_(std::move(label)),
        present_(ranks_.size()),
        counts_(ranks_.size()) {
    for (auto& s : slots_) s.resize(ranks_.size());
    for (auto& s : staging_) s.resize(ranks_.size());
  }

  const std::vector<int>& ranks() const { return ranks_; }
  int size() const { return static_cast<int>(ranks_.size()); }

  // Slots, staging buffers and barriers are per call parity (`call` counts a member's calls on
  // the group, the same on every member). A member that leaves call n without a completion
  // barrier (a staged call) may publish call n+1 while a slower member still reads call n's
  // slots and staging; it cannot reach call n+2, whose arrival needs every member to have left
  // call n (they must have arrived at n+1). Two copies are therefore enough.
  const Slot& slot(int64_t call, int member) const {
    return slots_[static_cast<size_t>(call & 1)][static_cast<size_t>(member)];
  }
  void publish(int64_t call, int member, const Slot& s) {
    slots_[static_cast<size_t>(call & 1)][static_cast<size_t>(member)] = s;
  }

  // The member's staging buffer for `call`, at least `bytes` long: kept across calls (grown,
  // never zeroed; the caller overwrites what it publishes), released with the run.
  std::byte* staging(int64_t call, int member, int64_t bytes) {
    Staging& st = staging_[static_cast<size_t>(call & 1)][static_cast<size_t>(member)];
    if (st.capacity < bytes) {
      st.data = std::make_unique_for_overwrite<std::byte[]>(static_cast<size_t>(bytes));
      st.capacity = bytes;
    }
    return st.data.get();
  }

  // all_to_all_v: each member's send and receive counts (one per member), copied here before it
  // arrives so that every member can check every pair before any data moves. all_to_all_v
  // keeps its completion barrier, so no member rewrites its counts while another reads them.
  struct Counts {
    std::vector<int64_t> send, recv;
  };
  void publish_counts(int member, const std::vector<int64_t>& send,
                      const std::vector<int64_t>& recv) {
    counts_[static_cast<size_t>(member)] = {send, recv};
  }
  const Counts& counts(int member) const { return counts_[static_cast<size_t>(member)]; }

  // A generation barrier with a deadline and an abort check. `what` names the collective, `call`
  // its number among this member's calls on the group (1-based). Everything a member wrote before
  // it arrives (its slot, its staging buffer, its output chunk) is visible to every member after
  // the barrier (release by each arrival, acquire by each exit).
  void wait_all(int member, std::string_view what, std::string_view phase, int64_t call);

  // After the world's abort flag is set: every sleeping member wakes (the generation word moves,
  // so a member about to sleep does not), sees the flag and throws.
  void wake_all();

  // Point-to-point (defined in local_group.cc): `from` posts a copy of its bytes to `to`'s
  // queue; `to` takes the oldest message from `from`. A host buffer's copy is host bytes; a device
  // buffer's copy is a device tensor of bytes on the sender's device (no host staging).
  struct Message {
    kernels::DType dtype = kernels::DType::kUInt8;
    int64_t numel = 0;
    std::vector<std::byte> bytes;         // the copy of a host buffer
    std::optional<kernels::Tensor> copy;  // [nbytes] uint8: the copy of a device buffer
  };
  void post(int from, int to, Message m);
  Message take(int from, int to, std::string_view what);
  // Drops the messages nobody received (a failed run): a device message's storage is freed on
  // its sender's stream, so this runs before the ranks' streams are destroyed.
  void drop_messages() {
    std::lock_guard<std::mutex> lk(mu_);
    p2p_.clear();
  }

 private:
  void throw_if_aborted(std::string_view what) {
    if (impl_.aborted.load()) {
      MP_FAIL("local {} on {} group of ranks [{}] aborted: another rank failed", what, label_,
              fmt::join(ranks_, ", "));
    }
  }

  struct Staging {
    std::unique_ptr<std::byte[]> data;
    int64_t capacity = 0;
  };

  Impl& impl_;
  std::vector<int> ranks_;
  std::string label_;
  // The barrier: the futex word (bumped once per completed barrier and on abort), the arrivals
  // of the current generation and who arrived (for the timeout's message).
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> arrived_{0};
  std::vector<std::atomic<char>> present_;
  std::array<std::vector<Slot>, 2> slots_;
  std::array<std::vector<Staging>, 2> staging_;
  std::vector<Counts> counts_;
  // Point-to-point queues by (sender, receiver) member index, guarded by mu_; p2p_posted_ moves
  // with every message posted (and on abort): a receiver finding its queue empty waits on it.
  std::mutex mu_;
  std::map<std::pair<int, int>, std::deque<Message>> p2p_;
  alignas(64) std::atomic<uint32_t> p2p_posted_{0};
};

}  // namespace meshproof::mesh
