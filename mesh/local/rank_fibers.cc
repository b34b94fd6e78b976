#include "mesh/local/rank_fibers.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <thread>

#if defined(__linux__)
#include <cxxabi.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <ctime>
#endif

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MESHPROOF_FIBER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define MESHPROOF_FIBER_ASAN 1
#endif
#if MESHPROOF_FIBER_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#include "kernels/core/error.h"
#include "kernels/core/runtime.h"

namespace meshproof::mesh {

RankThreading rank_threading_from_env() {
  const char* v = std::getenv(kVirtualRanksEnv);
  if (v == nullptr || *v == '\0') return RankThreading::kAuto;
  const std::string_view s(v);
  if (s == "auto") return RankThreading::kAuto;
  if (s == "threads") return RankThreading::kThreads;
  if (s == "fibers") return RankThreading::kFibers;
  MP_FAIL_INPUT("{}={}: expected auto, threads or fibers", kVirtualRanksEnv, v);
}

const char* rank_threading_name(RankThreading t) {
  switch (t) {
    case RankThreading::kAuto:
      return "auto";
    case RankThreading::kThreads:
      return "threads";
    case RankThreading::kFibers:
      return "fibers";
  }
  return "?";
}

bool fibers_supported() {
#if defined(__linux__)
  return true;
#else
  return false;
#endif
}

int usable_cpus() {
#if defined(__linux__)
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) return std::max(1, CPU_COUNT(&allowed));
  return 1;
#else
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
#endif
}

namespace detail {

std::chrono::nanoseconds next_fiber_spin(std::chrono::nanoseconds spin,
                                         std::chrono::nanoseconds waited) {
  if (waited > kFiberSpinMax) return spin / 2;
  return std::clamp(spin * 2, kFiberSpinMin, kFiberSpinMax);
}

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                std::atomic<uint32_t>::is_always_lock_free);
#if defined(__linux__)
  const int64_t ns = std::max<int64_t>(timeout.count(), 0);
  const timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr,
          0);
#else
  if (word.load(std::memory_order_acquire) == expected)
    std::this_thread::sleep_for(
        std::min<std::chrono::nanoseconds>(timeout, std::chrono::microseconds(50)));
#endif
}

void futex_wake_all(std::atomic<uint32_t>& word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
#else
  (void)word;
#endif
}

#if defined(__linux__)

namespace {

using Clock = std::chrono::steady_clock;

// The C++ runtime's per-thread exception state (__cxa_eh_globals of the Itanium ABI, the layout
// of libstdc++ and libc++abi on x86-64 and aarch64): the chain of caught exceptions and the count
// of uncaught ones. Swapped with the fiber, as the rank context is.
struct EhGlobals {
  void* caught = nullptr;
  unsigned int uncaught = 0;
};
EhGlobals* eh_globals() { return reinterpret_cast<EhGlobals*>(abi::__cxa_get_globals()); }

// A rank's stack: 8 MiB, as a thread's default, mapped without reserving memory (pages are
// touched as the rank uses them), with a guard page below it so an overflow faults instead of
// writing into another mapping.
constexpr size_t kStackBytes = size_t{8} << 20;

struct Worker;

struct Fiber {
  ucontext_t context{};
  void* mapping = nullptr;  // guard page + stack
  size_t mapping_bytes = 0;
  char* stack = nullptr;  // the usable stack (above the guard page)
  int rank = 0;
  bool done = false;
  Worker* worker = nullptr;
  // What the fiber waits for while it is switched out at a wait: null word = runnable.
  std::atomic<uint32_t>* word = nullptr;
  uint32_t expected = 0;
  Clock::time_point deadline{};
  // The per-rank thread state while the fiber is switched out.
  kernels::RankContext rank_context{};
  EhGlobals eh{};
  void* asan_fake_stack = nullptr;
};

// Spinning before a sleep: most waits of a multi-worker world are a collective's barrier whose
// last member runs on the other worker and arrives within microseconds, while a futex sleep and
// wake-up costs both workers more than that (the small 8-rank dp_shard run, 2 workers on the
// 2-core machine: 2,480 context switches and 487 ms CPU without spinning, 95 and 456 ms with a
// 30 us spin, 68 and 456 ms with 100 us). The budget adapts per worker (next_fiber_spin), so a
// machine where the other worker is descheduled soon stops paying for spins that do not pay off.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct Worker {
  // The wake-up word: bumped by every notify(); the worker sleeps on it while all its fibers wait.
  alignas(64) std::atomic<uint32_t> epoch{0};
  std::atomic<bool> sleeping{false};
  // The current spin budget (next_fiber_spin).
  std::chrono::nanoseconds spin = kFiberSpinMax;
  std::vector<Fiber*> fibers;
  ucontext_t home{};  // the worker thread's own context, resumed when a fiber waits or returns
  const void* home_stack_bottom = nullptr;
  size_t home_stack_size = 0;
  void* asan_fake_stack = nullptr;
  const std::function<void(int)>* body = nullptr;
};

thread_local Fiber* t_fiber = nullptr;  // the fiber running on this thread, if any

// AddressSanitizer's fiber protocol: announce the stack being switched to, then, on arrival,
// restore the arriving context's fake stack (and learn the stack switched from).
void asan_start(void** fake_save, const void* bottom, size_t size) {
#if MESHPROOF_FIBER_ASAN
  __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
  (void)fake_save;
  (void)bottom;
  (void)size;
#endif
}
void asan_finish(void* fake, const void** bottom_old, size_t* size_old) {
#if MESHPROOF_FIBER_ASAN
  __sanitizer_finish_switch_fiber(fake, bottom_old, size_old);
#else
  (void)fake;
  (void)bottom_old;
  (void)size_old;
#endif
}

// Switches from fiber `f` back to its worker; returns when the worker resumes `f`.
void switch_to_worker(Fiber& f, bool last) {
  Worker& w = *f.worker;
  // A returning fiber's fake stack is released (null save slot).
  asan_start(last ? nullptr : &f.asan_fake_stack, w.home_stack_bottom, w.home_stack_size);
  swapcontext(&f.context, &w.home);
  asan_finish(f.asan_fake_stack, nullptr, nullptr);
}

// makecontext passes ints only: the fiber is handed over in t_fiber.
void fiber_entry() {
  Fiber& f = *t_fiber;
  Worker& w = *f.worker;
  asan_finish(nullptr, &w.home_stack_bottom, &w.home_stack_size);
  (*w.body)(f.rank);
  f.done = true;
  switch_to_worker(f, true);
  std::abort();  // a returned fiber is never resumed
}

// Runs `f` until it waits or returns, with its rank context and exception state installed.
void resume(Worker& w, Fiber& f) {
  kernels::RankContext& ctx = kernels::current_context();
  EhGlobals* eh = eh_globals();
  const kernels::RankContext home_context = ctx;
  const EhGlobals home_eh = *eh;
  ctx = f.rank_context;
  *eh = f.eh;
  t_fiber = &f;
  asan_start(&w.asan_fake_stack, f.stack, kStackBytes);
  swapcontext(&w.home, &f.context);
  asan_finish(w.asan_fake_stack, nullptr, nullptr);
  t_fiber = nullptr;
  f.rank_context = ctx;
  f.eh = *eh;
  ctx = home_context;
  *eh = home_eh;
}

// Spins until `w`'s epoch moves from `epoch` (a notify()) or `budget` has passed; true if it moved.
bool spin_until_moved(const Worker& w, uint32_t epoch, Clock::duration budget) {
  if (budget < kFiberSpinMin) return false;
  const Clock::time_point until = Clock::now() + budget;
  do {
    for (int i = 0; i < 64; ++i) {
      if (w.epoch.load(std::memory_order_acquire) != epoch) return true;
      cpu_relax();
    }
  } while (Clock::now() < until);
  return w.epoch.load(std::memory_order_acquire) != epoch;
}

}  // namespace

struct FiberWorld::Impl {
  Impl(int ranks, int workers, const std::atomic<bool>& aborted)
      : aborted(aborted),
        fibers(static_cast<size_t>(ranks)),
        workers(static_cast<size_t>(workers)) {}
  ~Impl() {
    for (Fiber& f : fibers)
      if (f.mapping != nullptr) munmap(f.mapping, f.mapping_bytes);
  }
  const std::atomic<bool>& aborted;
  std::vector<Fiber> fibers;
  std::vector<Worker> workers;
};

FiberWorld::FiberWorld(int ranks, int workers, const std::atomic<bool>& aborted) {
  MP_CHECK(ranks > 0 && workers > 0 && workers <= ranks,
           "fiber world: {} workers for {} ranks (need 1 <= workers <= ranks)", workers, ranks);
  impl_ = std::make_unique<Impl>(ranks, workers, aborted);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (int r = 0; r < ranks; ++r) {
    Fiber& f = impl_->fibers[static_cast<size_t>(r)];
    f.rank = r;
    f.worker = &impl_->workers[static_cast<size_t>(r % workers)];
    f.worker->fibers.push_back(&f);
    f.mapping_bytes = kStackBytes + page;
    void* m = mmap(nullptr, f.mapping_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    MP_CHECK(m != MAP_FAILED, "fiber world: cannot map the {} MiB stack of rank {}: {}",
             kStackBytes >> 20, r, std::strerror(errno));
    f.mapping = m;
    MP_CHECK(mprotect(m, page, PROT_NONE) == 0,
             "fiber world: cannot protect the guard page of rank {}'s stack: {}", r,
             std::strerror(errno));
    f.stack = static_cast<char*>(m) + page;
  }
}

FiberWorld::~FiberWorld() = default;

int FiberWorld::workers() const { return static_cast<int>(impl_->workers.size()); }

void FiberWorld::work(int index, const std::function<void(int)>& body) {
  Worker& w = impl_->workers[static_cast<size_t>(index)];
  w.body = &body;
  for (Fiber* f : w.fibers) {
    MP_CHECK(getcontext(&f->context) == 0, "fiber world: getcontext failed for rank {}: {}",
             f->rank, std::strerror(errno));
    f->context.uc_stack.ss_sp = f->stack;
    f->context.uc_stack.ss_size = kStackBytes;
    f->context.uc_link = nullptr;
    makecontext(&f->context, fiber_entry, 0);
    // A fresh rank starts from the worker's context (the local world installs the rank's own).
    f->rank_context = kernels::current_context();
  }
  // Only another worker can move a word while all of this worker's fibers wait (or the deadline
  // or an abort, which the sleep covers): with one worker, spinning cannot pay.
  const bool spins = impl_->workers.size() > 1;
  size_t live = w.fibers.size();
  while (live > 0) {
    // Read before the pass: a notify() after this read makes the sleep below return at once.
    const uint32_t epoch = w.epoch.load(std::memory_order_seq_cst);
    const Clock::time_point now = Clock::now();
    const bool aborted = impl_->aborted.load();
    Clock::time_point earliest = Clock::time_point::max();
    bool ran = false;
    for (Fiber* f : w.fibers) {
      if (f->done) continue;
      if (f->word != nullptr && !aborted && now < f->deadline &&
          f->word->load(std::memory_order_acquire) == f->expected) {
        earliest = std::min(earliest, f->deadline);
        continue;
      }
      resume(w, *f);
      ran = true;
      if (f->done) --live;
    }
    if (ran || live == 0) continue;
    // Every fiber waits: sleep until a notify() or the earliest deadline (a Dekker pair with
    // notify(): either this load sees its epoch bump, or it sees `sleeping` and wakes us).
    // (Every live fiber waits with a deadline here, so `earliest` is finite; the guard keeps the
    // subtraction defined regardless.)
    const Clock::duration sleep = earliest == Clock::time_point::max()
                                      ? Clock::duration(std::chrono::seconds(1))
                                      : earliest - Clock::now();
    const Clock::time_point idle = Clock::now();
    if (spins && spin_until_moved(w, epoch, std::min<Clock::duration>(w.spin, earliest - idle))) {
      w.spin = next_fiber_spin(w.spin, Clock::now() - idle);
      continue;
    }
    w.sleeping.store(true, std::memory_order_seq_cst);
    if (w.epoch.load(std::memory_order_seq_cst) == epoch) futex_wait(w.epoch, epoch, sleep);
    w.sleeping.store(false, std::memory_order_seq_cst);
    if (spins) w.spin = next_fiber_spin(w.spin, Clock::now() - idle);
  }
}

void FiberWorld::wait(std::atomic<uint32_t>& word, uint32_t expected,
                      std::chrono::steady_clock::time_point deadline) {
  Fiber* f = t_fiber;
  MP_CHECK(f != nullptr, "fiber wait outside a fiber");
  f->word = &word;
  f->expected = expected;
  f->deadline = deadline;
  switch_to_worker(*f, false);
  f->word = nullptr;
}

bool FiberWorld::on_fiber() { return t_fiber != nullptr; }

void FiberWorld::notify() {
  for (Worker& w : impl_->workers) {
    w.epoch.fetch_add(1, std::memory_order_seq_cst);
    if (w.sleeping.load(std::memory_order_seq_cst)) futex_wake_all(w.epoch);
  }
}

#else  // !__linux__: never constructed (fibers_supported() is false)

struct FiberWorld::Impl {};
FiberWorld::FiberWorld(int, int, const std::atomic<bool>&) {
  MP_FAIL("virtual ranks as fibers need Linux ({}=threads)", kVirtualRanksEnv);
}
FiberWorld::~FiberWorld() = default;
int FiberWorld::workers() const { return 0; }
void FiberWorld::work(int, const std::function<void(int)>&) {}
void FiberWorld::wait(std::atomic<uint32_t>&, uint32_t, std::chrono::steady_clock::time_point) {}
bool FiberWorld::on_fiber() { return false; }
void FiberWorld::notify() {}

#endif

}  // namespace detail
}  // namespace meshproof::mesh
