// Virtual ranks as fibers. With more host ranks than CPUs, the `local` launcher runs its ranks as
// user-level fibers on one worker thread per CPU (rank r on worker r mod workers) instead of one
// kernel thread per rank: a rank that waits in a collective hands its worker to the next rank of
// that worker with a user-space context switch (about 0.2 us), where a thread per rank slept on a
// futex and was woken by the kernel (about 4.4 us per switch on the development VM, 20,000 per 30
// small steps at 8 ranks on 2 cores: docs/design.md section 36, "Fibers").
//
// A fiber keeps the per-rank thread state that rank code reads: the kernels::RankContext (rank,
// device, memory tracker, copy counter) and the C++ runtime's caught/uncaught exception state are
// swapped in and out with the fiber, so a rank that waits inside a catch block or while unwinding
// cannot see another rank's exceptions. Thread-local scratch buffers (GEMM packing, attention,
// the host block cache) stay per worker thread: fibers never migrate between workers and never
// switch inside a kernel, only in the waits of this file. AddressSanitizer is told of every
// switch (its fiber API), so the sanitizer build checks the fibers' stacks too. One rule for rank
// code follows: never hold a lock across a collective or a receive (a fiber that waits holding
// one blocks its whole worker once a neighbour on that worker wants the lock); the engine's locks
// (HDF5, the data-table cache, the launcher's result) are all taken and released between
// collectives.
//
// The choice is MESHPROOF_VIRTUAL_RANKS: `auto` (the default: fibers when the host ranks outnumber
// the CPUs this process may use, on Linux), `fibers` or `threads` (one thread per rank, e.g. to
// see every rank's stack in a debugger's thread list). Results do not depend on it: the same
// rank code makes the same collectives with the same rank-order reductions.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace meshproof::mesh {

enum class RankThreading { kAuto, kThreads, kFibers };

inline constexpr const char* kVirtualRanksEnv = "MESHPROOF_VIRTUAL_RANKS";

// MESHPROOF_VIRTUAL_RANKS as a RankThreading (unset or empty: kAuto); anything but auto, threads
// or fibers is an input error naming the variable.
RankThreading rank_threading_from_env();
const char* rank_threading_name(RankThreading t);
// Whether this build and platform can run ranks as fibers (Linux: ucontext and futexes).
bool fibers_supported();
// The CPUs this process may use (its affinity mask on Linux; else the hardware's), at least 1.
int usable_cpus();

namespace detail {

// Sleeps while `word` holds `expected`, at most `timeout`; may return early (a wake-up, a signal,
// a changed word): the caller re-checks. A futex on Linux; elsewhere a bounded sleep.
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout);
// Wakes every thread sleeping on `word` (Linux; elsewhere the sleepers re-check on their own).
void futex_wake_all(std::atomic<uint32_t>& word);

// A fiber worker's spin before it sleeps (all of its fibers waiting, more than one worker): at
// most kFiberSpinMax, adapted per worker by next_fiber_spin; below kFiberSpinMin the worker sleeps
// at once. See docs/design.md section 36, "Fibers".
inline constexpr std::chrono::nanoseconds kFiberSpinMax = std::chrono::microseconds(40);
inline constexpr std::chrono::nanoseconds kFiberSpinMin = std::chrono::microseconds(2);
// The budget after a wait that lasted `waited` (spun, or spun and slept) under budget `spin`:
// doubled (at least kFiberSpinMin, at most kFiberSpinMax) when a spin of kFiberSpinMax would have
// covered the wait, halved when it would not (the other worker is descheduled, or the wait is
// long).
std::chrono::nanoseconds next_fiber_spin(std::chrono::nanoseconds spin,
                                         std::chrono::nanoseconds waited);

// The fibers of one local-world run: `ranks` fibers on `workers` worker threads. Made on the
// calling thread (every fiber's stack is mapped here, so a failure happens before any rank runs);
// each worker thread then calls work(w), which runs its fibers until every one has returned.
class FiberWorld {
 public:
  // `aborted`: the run's abort flag; a waiting fiber is resumed once it is set.
  FiberWorld(int ranks, int workers, const std::atomic<bool>& aborted);
  ~FiberWorld();
  FiberWorld(const FiberWorld&) = delete;
  FiberWorld& operator=(const FiberWorld&) = delete;

  int workers() const;
  // Worker w's loop: runs body(r) for the ranks r = w, w + workers, ... as fibers, switching
  // between them at their waits, sleeping while all of them wait. body must not throw (the local
  // world catches each rank's errors itself); returns when every one of its fibers has returned.
  void work(int w, const std::function<void(int)>& body);

  // From a fiber of a running world: lets the worker run its other fibers until `word` no longer
  // holds `expected`, the run is aborted or `deadline` has passed. May return early: the caller
  // re-checks its condition.
  static void wait(std::atomic<uint32_t>& word, uint32_t expected,
                   std::chrono::steady_clock::time_point deadline);
  // Whether the calling code runs on a fiber.
  static bool on_fiber();
  // After changing a word some fiber may wait on: makes every worker look again (a sleeping
  // worker is woken; a running one re-checks its waiting fibers on its next pass).
  void notify();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace detail
}  // namespace meshproof::mesh
