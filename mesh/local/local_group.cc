// The rendezvous of a group of the `local` launcher (local_comm_internal.h): the generation
// barrier that every collective call waits in, with its watchdog (a member that waits longer than
// the timeout fails, naming the collective, the group, the waiting rank and the ranks that never
// arrived), the world's abort (every waiting member wakes and throws), and the point-to-point
// queues of send and recv, with the same timeout for a message that never comes.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <mutex>
#include <vector>

#include "kernels/core/error.h"
#include "mesh/local/local_comm_internal.h"

namespace meshproof::mesh {

void LocalWorld::Impl::abort() {
  aborted.store(true);
  for (auto& [key, g] : groups) g->wake_all();
}

void LocalWorld::Impl::Group::wait_all(int member, std::string_view what, std::string_view phase,
                                       int64_t call) {
  throw_if_aborted(what);
  const uint32_t gen = generation_.load(std::memory_order_acquire);
  present_[static_cast<size_t>(member)].store(1, std::memory_order_relaxed);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size()) {
    // The last member: nobody else can touch the count or the presence flags until the
    // generation moves on.
    arrived_.store(0, std::memory_order_relaxed);
    for (auto& p : present_) p.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    impl_.notify_word(generation_);
    return;
  }
  const auto timeout = impl_.world.options().timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    throw_if_aborted(what);
    if (generation_.load(std::memory_order_acquire) != gen) {
      // An abort also moves the generation (after setting the flag): not a completed barrier.
      throw_if_aborted(what);
      return;
    }
    if (std::chrono::steady_clock::now() >= deadline) break;
    impl_.wait_word(generation_, gen, deadline);
  }
  std::vector<int> missing;
  for (int m = 0; m < size(); ++m) {
    if (!present_[static_cast<size_t>(m)].load(std::memory_order_relaxed))
      missing.push_back(ranks_[static_cast<size_t>(m)]);
  }
  // The same facts as the mpi launcher's watchdog (mesh/mpi/mpi_comm.cc): collective, call,
  // group, waiting rank, missing ranks and how to change the limit.
  MP_FAIL(
      "local {} (call {} on this group, {} phase) on {} group of ranks [{}] timed out after "
      "{:.3f} s on rank {}: ranks [{}] never arrived (stalled, hung or not making this "
      "call); {} sets the limit in seconds (default {})",
      what, call, phase, label_, fmt::join(ranks_, ", "),
      std::chrono::duration<double>(timeout).count(), ranks_[static_cast<size_t>(member)],
      fmt::join(missing, ", "), kCollectiveTimeoutEnv, kDefaultCollectiveTimeout.count());
}

void LocalWorld::Impl::Group::wake_all() {
  generation_.fetch_add(1, std::memory_order_acq_rel);
  impl_.notify_word(generation_);
  p2p_posted_.fetch_add(1, std::memory_order_acq_rel);
  impl_.notify_word(p2p_posted_);
}

// ---- point-to-point ----------------------------------------------------------------------------

void LocalWorld::Impl::Group::post(int from, int to, Message m) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    p2p_[{from, to}].push_back(std::move(m));
    // Moved under the lock: a receiver that read the word under the lock and found its queue
    // empty sees it change (and is woken) once this message is in.
    p2p_posted_.fetch_add(1, std::memory_order_acq_rel);
  }
  impl_.notify_word(p2p_posted_);
}

LocalWorld::Impl::Group::Message LocalWorld::Impl::Group::take(int from, int to,
                                                               std::string_view what) {
  const auto timeout = impl_.world.options().timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Message m;
  while (true) {
    uint32_t seen = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      std::deque<Message>& q = p2p_[{from, to}];
      if (!q.empty()) {
        m = std::move(q.front());
        q.pop_front();
        break;
      }
      seen = p2p_posted_.load(std::memory_order_acquire);
    }
    throw_if_aborted(what);
    if (std::chrono::steady_clock::now() >= deadline) {
      MP_FAIL(
          "local {} on {} group of ranks [{}] timed out after {:.3f} s on rank {}: rank {} never "
          "sent (stalled, hung or not making this call); {} sets the limit in seconds (default "
          "{})",
          what, label_, fmt::join(ranks_, ", "), std::chrono::duration<double>(timeout).count(),
          ranks_[static_cast<size_t>(to)], ranks_[static_cast<size_t>(from)], kCollectiveTimeoutEnv,
          kDefaultCollectiveTimeout.count());
    }
    impl_.wait_word(p2p_posted_, seen, deadline);
  }
  return m;
}

}  // namespace meshproof::mesh
