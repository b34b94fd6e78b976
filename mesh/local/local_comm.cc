// The `local` launcher (local_comm.h): its communicators and the world's lifecycle. A
// LocalCommunicator moves each collective's data through its group's rendezvous
// (local_comm_internal.h, local_group.cc): it publishes its call (a staged copy of a small host
// input, or its buffer in place), checks that every member made the same call, then computes its
// own output from the others' buffers (host memcpy or device copies, rank-order reductions), and
// sends or receives point-to-point messages. LocalWorld::run builds every group, starts one thread
// per rank (or the fiber workers, pinned where ranks share CPUs), runs each rank's function in its
// own RankContext and rethrows the first rank's error.
#include "mesh/local/local_comm.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <atomic>
#include <climits>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#endif

#include "kernels/core/cuda_check.h"
#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "kernels/gemm/cublaslt_resources.h"
#include "mesh/local/local_comm_internal.h"
#include "mesh/local/rank_fibers.h"

namespace meshproof::mesh {

using kernels::Tensor;

namespace {

using Slot = LocalWorld::Impl::Slot;

// The CPUs each rank thread is pinned to: with more ranks than the CPUs this process may use
// (virtual ranks sharing cores), rank r runs on allowed CPU (r + offset) mod count, the offset
// taken from the process id so that concurrent runs (ctest -j) do not all start on the same CPU;
// otherwise none (an empty list). Unpinned, the scheduler places every rank woken by a barrier
// next to the rank that completed it, and 8 ranks on 2 cores ran on 0.5 CPUs on average (perf
// stat: 0.48 CPUs utilised, 20,000 context switches either way); pinned they spread over both
// (1.17 CPUs) at the same CPU time (docs/design.md section 36). Device ranks are not pinned: they
// mostly wait for their GPU.
std::vector<int> rank_cpus(int ranks, bool host) {
  std::vector<int> cpus;
#if defined(__linux__)
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (!host || sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return {};
  std::vector<int> usable;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) usable.push_back(c);
  if (usable.empty() || ranks <= static_cast<int>(usable.size())) return {};
  const auto offset = static_cast<size_t>(getpid());
  for (int r = 0; r < ranks; ++r)
    cpus.push_back(usable[(static_cast<size_t>(r) + offset) % usable.size()]);
#else
  (void)ranks;
  (void)host;
#endif
  return cpus;
}

// Pins the calling thread to `cpu`. A scheduling hint: if the kernel refuses, the rank runs
// unpinned, which changes its speed, not its results.
void pin_to_cpu(int cpu) {
#if defined(__linux__)
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  (void)pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
#else
  (void)cpu;
#endif
}

void sync_rank_stream() { kernels::synchronize_current(); }

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(LocalWorld::Impl::Group& group, int index, std::string label)
      : Communicator(group.ranks(), index, std::move(label)), group_(group) {}

  std::string_view backend() const override { return "local"; }

 protected:
  void do_all_gather(const Tensor& input, Tensor& output) override {
    const int64_t call = ++calls_;
    const kernels::Bytes chunk = input.nbytes();
    const bool staged = stage(input, output.nbytes());
    const void* mine = staged ? stage_copy(call, input) : input.raw_data();
    arrive(Slot{CollectiveKind::kAllGather, input.dtype(), input.numel().value, 0, ReduceOp::kSum,
                mine, input.device()},
           call);
    char* out = static_cast<char*>(output.raw_data());
    for (int s = 0; s < size(); ++s) {
      void* dst = out + s * chunk.value;
      // This member's own slice comes from its input (equal to its staged copy).
      const void* src = s == rank() ? input.raw_data() : group_.slot(call, s).ptr;
      if (dst == src) continue;  // in place: the member's own slice of its output
      kernels::copy_bytes(dst, output.device(), src, group_.slot(call, s).device, chunk);
    }
    if (!staged) depart("all_gather");
  }

  void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    const int64_t call = ++calls_;
    const bool staged = stage(input, input.nbytes());
    const void* mine = staged ? stage_copy(call, input) : input.raw_data();
    arrive(Slot{CollectiveKind::kReduceScatter, input.dtype(), input.numel().value, 0, op, mine,
                input.device()},
           call);
    const int64_t count = output.numel().value;
    std::vector<const float*> ins(static_cast<size_t>(size()));
    for (int s = 0; s < size(); ++s) {
      ins[static_cast<size_t>(s)] =
          static_cast<const float*>(group_.slot(call, s).ptr) + rank() * count;
    }
    reduce(output, ins, count, op);
    if (!staged) depart("reduce_scatter");
  }

  void do_all_reduce(Tensor& buffer, ReduceOp op) override {
    const int64_t call = ++calls_;
    const int64_t count = buffer.numel().value;
    // Staged: every member reduces the whole buffer from the staged copies (size() x the
    // reduction work, cheaper than two more barriers while the buffer is small), so the call has
    // one barrier. Each element is reduced in rank order either way: the same bits.
    const bool staged = stage(buffer, kernels::Bytes(buffer.nbytes().value * size()));
    const void* mine = staged ? stage_copy(call, buffer) : buffer.raw_data();
    arrive(Slot{CollectiveKind::kAllReduce, buffer.dtype(), count, 0, op, mine, buffer.device()},
           call);
    std::vector<const float*> ins(static_cast<size_t>(size()));
    if (staged) {
      for (int s = 0; s < size(); ++s)
        ins[static_cast<size_t>(s)] = static_cast<const float*>(group_.slot(call, s).ptr);
      reduce(buffer, ins, count, op);
      return;
    }
    // Reduce-scatter then all-gather in place, without staging copies: member m reduces chunk m
    // of everyone's buffer (rank order) into its own chunk m, which no other member reads in that
    // phase; after a barrier every member copies the finished chunks s != m from member s.
    const int64_t chunk = (count + size() - 1) / size();
    auto begin = [&](int m) { return std::min<int64_t>(m * chunk, count); };
    auto end = [&](int m) { return std::min<int64_t>((m + 1) * chunk, count); };
    const int64_t lo = begin(rank()), hi = end(rank());
    for (int s = 0; s < size(); ++s) {
      ins[static_cast<size_t>(s)] = static_cast<const float*>(group_.slot(call, s).ptr) + lo;
    }
    Tensor own = buffer.view(kernels::Shape{count}).slice_rows(lo, hi);
    reduce(own, ins, hi - lo, op);
    sync_rank_stream();
    group_.wait_all(rank(), "all_reduce", "reduction", call);
    float* out = buffer.data<float>();
    for (int s = 0; s < size(); ++s) {
      if (s == rank() || end(s) == begin(s)) continue;
      const Slot& src = group_.slot(call, s);
      kernels::copy_bytes(out + begin(s), buffer.device(),
                          static_cast<const float*>(src.ptr) + begin(s), src.device,
                          kernels::Bytes((end(s) - begin(s)) * 4));
    }
    depart("all_reduce");
  }

  void do_broadcast(Tensor& buffer, int root) override {
    const int64_t call = ++calls_;
    const bool staged = stage(buffer, buffer.nbytes());
    const void* mine = staged && rank() == root ? stage_copy(call, buffer) : buffer.raw_data();
    arrive(Slot{CollectiveKind::kBroadcast, buffer.dtype(), buffer.numel().value, root,
                ReduceOp::kSum, mine, buffer.device()},
           call);
    if (rank() != root) {
      const Slot& src = group_.slot(call, root);
      kernels::copy_bytes(buffer.raw_data(), buffer.device(), src.ptr, src.device, buffer.nbytes());
    }
    if (!staged) depart("broadcast");
  }

  // One barrier: there is nothing to read, and the slots of consecutive calls are apart.
  void do_barrier() override {
    const int64_t call = ++calls_;
    arrive(Slot{CollectiveKind::kBarrier, kernels::DType::kUInt8, 0, 0, ReduceOp::kSum, nullptr,
                kernels::current_context().device},
           call);
  }

  // Every member reads its part of each member's input: member s's elements for this rank start
  // after s's counts for the members before this rank.
  void do_all_to_all_v(const Tensor& input, const std::vector<int64_t>& send_counts, Tensor& output,
                       const std::vector<int64_t>& recv_counts) override {
    const int64_t call = ++calls_;
    group_.publish_counts(rank(), send_counts, recv_counts);
    arrive(Slot{CollectiveKind::kAllToAll, input.dtype(), 0, 0, ReduceOp::kSum, input.raw_data(),
                input.device()},
           call);
    // Every member checks every pair (the same verdict everywhere, before any copy).
    for (int s = 0; s < size(); ++s)
      for (int t = 0; t < size(); ++t) {
        const int64_t sent = group_.counts(s).send[static_cast<size_t>(t)];
        const int64_t expected = group_.counts(t).recv[static_cast<size_t>(s)];
        MP_CHECK_INPUT(sent == expected,
                       "local all_to_all_v on {}: rank {} sends {} elements to rank {}, which "
                       "expects {}",
                       describe(), ranks()[static_cast<size_t>(s)], sent,
                       ranks()[static_cast<size_t>(t)], expected);
      }
    // Member s's elements for this rank start after its counts for the members before it.
    const int64_t elem = kernels::dtype_bits(input.dtype()) / 8;
    char* out = static_cast<char*>(output.raw_data());
    int64_t at = 0;
    for (int s = 0; s < size(); ++s) {
      const Slot& src = group_.slot(call, s);
      const std::vector<int64_t>& theirs = group_.counts(s).send;
      const int64_t n = theirs[static_cast<size_t>(rank())];
      int64_t from = 0;
      for (int q = 0; q < rank(); ++q) from += theirs[static_cast<size_t>(q)];
      if (n > 0)
        kernels::copy_bytes(out + at * elem, output.device(),
                            static_cast<const char*>(src.ptr) + from * elem, src.device,
                            kernels::Bytes(n * elem));
      at += n;
    }
    depart("all_to_all");
  }
  void do_send(const Tensor& buffer, int peer) override;  // at the end of the file
  void do_recv(Tensor& buffer, int peer) override;

 private:
  // Small host collectives are staged: each member copies its input into its staging buffer
  // for the call before it arrives and the others read that copy, so no member waits for the
  // others to finish reading (no completion barrier; a staged all_reduce reduces the whole buffer
  // on every member). One barrier per call instead of two (three for all_reduce): with 8 virtual
  // ranks on 2 cores each barrier costs every member a sleep and a wake-up. `touched` is what a
  // member reads in the staged call (all_gather: the output; reduce_scatter: the input; all_reduce:
  // size() buffers; broadcast: the buffer); above the limit the extra copy (and all_reduce's
  // redundant reduction) cost more than the barriers saved (bench comm, 2 and 8 ranks on the
  // 2-core machine: the crossover lies between 64 and 1024 KiB) and the members read each other's
  // buffers in place. Every member takes the same decision: it depends only on what arrive()
  // checks to be the same call.
  static constexpr int64_t kStageLimitBytes = int64_t{256} << 10;
  bool stage(const Tensor& t, kernels::Bytes touched) const {
    return size() > 1 && t.device().is_cpu() && touched.value <= kStageLimitBytes;
  }
  const void* stage_copy(int64_t call, const Tensor& t) {
    const int64_t bytes = t.nbytes().value;
    std::byte* st = group_.staging(call, rank(), bytes);
    if (bytes > 0) std::memcpy(st, t.raw_data(), static_cast<size_t>(bytes));
    return st;
  }

  // Publishes this member's call (its input must be complete: the stream is synchronised),
  // waits for everyone and checks that all members made the same call.
  void arrive(const Slot& me, int64_t call) {
    sync_rank_stream();
    group_.publish(call, rank(), me);
    const std::string_view what = collective_name(me.kind);
    group_.wait_all(rank(), what, "arrival", call);
    for (int s = 0; s < size(); ++s) {
      const Slot& o = group_.slot(call, s);
      MP_CHECK(o.same_call(me),
               "local {}: mismatched collective calls on {}: rank {} called {} but rank {} "
               "called {}",
               what, describe(), ranks()[static_cast<size_t>(rank())], me.str(),
               ranks()[static_cast<size_t>(s)], o.str());
    }
  }

  // Waits until every member has finished reading the others' buffers.
  void depart(std::string_view what) {
    sync_rank_stream();
    group_.wait_all(rank(), what, "completion", calls_);
  }

  void reduce(Tensor& out, const std::vector<const float*>& ins, int64_t count, ReduceOp op) {
    if (out.device().is_cpu()) {
      reduce_rank_order_host(out.data<float>(), ins.data(), size(), count, op);
      return;
    }
#if MESHPROOF_HAVE_CUDA
    for (int s = 0; s < size(); ++s) {
      MP_CHECK(group_.slot(calls_, s).device == out.device(),
               "local device reduction on {}: rank {} holds its buffer on {} but this rank on {} "
               "(virtual ranks of one reduction must share a GPU)",
               describe(), ranks()[static_cast<size_t>(s)], group_.slot(calls_, s).device.str(),
               out.device().str());
    }
    reduce_rank_order_device(out.data<float>(), ins.data(), size(), count, op,
                             kernels::current_context().stream);
#else
    MP_FAIL("device reduction requested in a build without CUDA");
#endif
  }

  LocalWorld::Impl::Group& group_;
  int64_t calls_ = 0;  // collectives this member started on the group
};

class LocalRankComms final : public RankComms {
 public:
  LocalRankComms(LocalWorld::Impl& impl, int rank) : impl_(impl), rank_(rank) {}

  int rank() const override { return rank_; }
  const DeviceMesh& mesh() const override { return impl_.world.mesh(); }

  Communicator& group(DimSet dims) override {
    auto& slot = comms_[dims.bits()];
    if (!slot) {
      const DeviceMesh& m = mesh();
      auto& g = impl_.groups.at({dims.bits(), m.group_color(rank_, dims)});
      slot = std::make_unique<LocalCommunicator>(*g, m.group_index(rank_, dims), dims.str());
    }
    return *slot;
  }

 private:
  LocalWorld::Impl& impl_;
  int rank_;
  std::array<std::unique_ptr<LocalCommunicator>, 1u << kNumGroupDims> comms_;
};

}  // namespace

LocalWorld::LocalWorld(DeviceMesh mesh, LocalWorldOptions options)
    : mesh_(mesh), options_(options) {
  MP_CHECK_INPUT(options_.timeout.count() > 0, "local world: timeout must be positive");
  for (int r = 0; r < mesh_.world_size(); ++r) {
    memory_.push_back(std::make_unique<kernels::MemoryTracker>());
    copies_.push_back(std::make_unique<kernels::CopyCounter>());
  }
}

LocalWorld::~LocalWorld() = default;

const kernels::MemoryTracker& LocalWorld::memory(int rank) const {
  MP_CHECK_INPUT(0 <= rank && rank < mesh_.world_size(), "rank {} outside mesh {}", rank,
                 mesh_.str());
  return *memory_[static_cast<size_t>(rank)];
}

const kernels::CopyCounter& LocalWorld::copies(int rank) const {
  MP_CHECK_INPUT(0 <= rank && rank < mesh_.world_size(), "rank {} outside mesh {}", rank,
                 mesh_.str());
  return *copies_[static_cast<size_t>(rank)];
}

void LocalWorld::run(const std::function<void(RankComms&)>& fn) {
  Impl impl(*this);
  // Every group of every dim set, built before any thread starts (the map is read-only after).
  for (unsigned bits = 0; bits < (1u << kNumGroupDims); ++bits) {
    const DimSet dims = DimSet::from_bits(bits);
    const auto groups = mesh_.groups(dims);
    for (size_t color = 0; color < groups.size(); ++color) {
      impl.groups.emplace(std::make_pair(bits, static_cast<int>(color)),
                          std::make_unique<Impl::Group>(impl, groups[color], dims.str()));
    }
  }

  const int n = mesh_.world_size();
  // The ranks' CUDA streams, destroyed on every way out (a failed stream creation or thread
  // start included).
  struct Streams {
    std::vector<void*> s;
    ~Streams() {
#if MESHPROOF_HAVE_CUDA
      for (void* st : s) {
        if (st != nullptr) {
          kernels::release_stream_resources(st);  // its cuBLASLt handle and workspace
          cudaStreamDestroy(static_cast<cudaStream_t>(st));
        }
      }
#endif
    }
  } owned;
  owned.s.assign(static_cast<size_t>(n), nullptr);
  std::vector<void*>& streams = owned.s;
  // Destroyed before `owned`: unreceived messages go while their senders' streams still exist.
  struct DropMessages {
    Impl& impl;
    ~DropMessages() {
      for (auto& [key, g] : impl.groups) g->drop_messages();
    }
  } drop_messages{impl};
#if MESHPROOF_HAVE_CUDA
  if (options_.device.is_cuda()) {
    MP_CUDA_CHECK(cudaSetDevice(options_.device.index));
    for (auto& s : streams) {
      cudaStream_t st = nullptr;
      MP_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      s = st;
    }
  }
#else
  MP_CHECK_INPUT(options_.device.is_cpu(), "local world on {}: this build has no CUDA",
                 options_.device.str());
#endif

  // One rank's life: its context, its communicators, its errors (recorded, then the world is
  // aborted so that the others stop waiting for it). Never throws: it may run on a fiber.
  // A failure that is not a kernels::Error, as a runtime error of the run.
  const auto fail_runtime = [&impl](std::string message) {
    impl.fail(std::make_exception_ptr(
        kernels::Error(kernels::ErrorKind::kRuntime, __FILE__, __LINE__, "", std::move(message))));
  };
  auto run_rank = [this, &impl, &fn, &streams, &fail_runtime](int r) {
    try {
      kernels::ScopedRankContext ctx(kernels::RankContext{
          r, options_.device, streams[static_cast<size_t>(r)],
          memory_[static_cast<size_t>(r)].get(), copies_[static_cast<size_t>(r)].get()});
      LocalRankComms comms(impl, r);
      fn(comms);
      kernels::synchronize_current();
    } catch (const kernels::Error& e) {
      impl.fail(
          std::make_exception_ptr(kernels::Error(e.kind(), e.file(), e.line(), e.expression(),
                                                 fmt::format("rank {}: {}", r, e.message()))));
    } catch (const std::exception& e) {
      fail_runtime(fmt::format("rank {}: {}", r, e.what()));
    } catch (...) {
      fail_runtime(fmt::format("rank {}: unknown exception", r));
    }
  };

  // With fibers: worker w runs ranks w, w + workers, ... and is pinned like rank w would be.
  const int workers = local_fiber_workers(n, options_);
  std::optional<detail::FiberWorld> fibers;
  if (workers > 0) {
    fibers.emplace(n, workers, impl.aborted);
    impl.fibers = &*fibers;
  }
  const int threads_to_start = workers > 0 ? workers : n;
  const std::vector<int> cpus = rank_cpus(n, options_.device.is_cpu());
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(threads_to_start));
  for (int t = 0; t < threads_to_start; ++t) {
    std::function<void()> body = [&, t] {
      if (!cpus.empty()) pin_to_cpu(cpus[static_cast<size_t>(t)]);
      if (fibers) {
        // work() throws only before its first fiber runs (a failed getcontext): abort the world
        // so the other workers' ranks stop waiting for this worker's.
        try {
          fibers->work(t, run_rank);
        } catch (const std::exception& e) {
          fail_runtime(fmt::format("fiber worker {}: {}", t, e.what()));
        }
      } else {
        run_rank(t);
      }
    };
    try {
      threads.push_back(options_.start_thread ? options_.start_thread(std::move(body))
                                              : std::thread(std::move(body)));
    } catch (const std::exception& e) {
      // The ranks already running may wait in a collective for this one: abort them, join
      // them, then report the start failure (the cause) rather than their aborts.
      impl.abort();
      for (auto& th : threads) th.join();
      if (fibers) {
        MP_FAIL(
            "local world {}: could not start fiber worker thread {} of {} (ranks {}, {}, ...; {} "
            "running): {}",
            mesh_.str(), t, workers, t, t + workers, threads.size(), e.what());
      }
      MP_FAIL("local world {}: could not start the thread of rank {} of {} ({} running): {}",
              mesh_.str(), t, n, threads.size(), e.what());
    }
  }
  for (auto& th : threads) th.join();
  if (impl.first_error) std::rethrow_exception(impl.first_error);
}

int local_fiber_workers(int ranks, kernels::Device device, RankThreading threading,
                        int fiber_workers) {
  if (!device.is_cpu() || ranks <= 1 || threading == RankThreading::kThreads) return 0;
  const int cpus = usable_cpus();
  if (threading == RankThreading::kAuto && (!fibers_supported() || ranks <= cpus)) return 0;
  MP_CHECK_INPUT(fibers_supported(), "{}=fibers: virtual ranks as fibers need Linux (use threads)",
                 kVirtualRanksEnv);
  MP_CHECK_INPUT(fiber_workers >= 0, "local world: fiber_workers must be >= 0, got {}",
                 fiber_workers);
  const int workers = fiber_workers > 0 ? fiber_workers : cpus;
  return std::min(workers, ranks);
}

int local_fiber_workers(int ranks, const LocalWorldOptions& options) {
  return local_fiber_workers(ranks, options.device, options.threading, options.fiber_workers);
}

namespace {

// The bytes are copied out before send returns (the buffer may be reused at once), so a send
// never waits for its receive: a pipeline stage may send its activation and go on. A device
// buffer is copied device to device into a byte tensor on its own device, on the sender's stream
// (after the kernels that wrote it), and the stream is synchronised before the message is posted,
// so the copy is complete when the receiver (another stream) reads it; nothing crosses to the
// host (docs/design.md "Host-device traffic per step").
void LocalCommunicator::do_send(const Tensor& buffer, int peer) {
  LocalWorld::Impl::Group::Message m;
  m.dtype = buffer.dtype();
  m.numel = buffer.numel().value;
  if (buffer.device().is_cpu()) {
    sync_rank_stream();
    m.bytes.resize(static_cast<size_t>(buffer.nbytes().value));
    kernels::copy_bytes(m.bytes.data(), kernels::Device::cpu(), buffer.raw_data(), buffer.device(),
                        buffer.nbytes());
  } else {
    Tensor copy = Tensor::empty({buffer.nbytes().value}, kernels::DType::kUInt8, buffer.device());
    kernels::copy_bytes(copy.raw_data(), copy.device(), buffer.raw_data(), buffer.device(),
                        buffer.nbytes());
    sync_rank_stream();
    m.copy = std::move(copy);
  }
  group_.post(rank(), peer, std::move(m));
}

// A device message is copied on the receiver's stream and the stream synchronised before the
// message is dropped: its storage is freed on the sender's stream, which does not wait for this
// one.
void LocalCommunicator::do_recv(Tensor& buffer, int peer) {
  const LocalWorld::Impl::Group::Message m = group_.take(peer, rank(), "recv");
  MP_CHECK(m.dtype == buffer.dtype() && m.numel == buffer.numel().value,
           "local recv on {}: rank {} sent {} elements of {} but rank {} receives into {}",
           describe(), ranks()[static_cast<size_t>(peer)], m.numel, kernels::dtype_name(m.dtype),
           ranks()[static_cast<size_t>(rank())], buffer.describe());
  if (m.copy.has_value()) {
    kernels::copy_bytes(buffer.raw_data(), buffer.device(), m.copy->raw_data(), m.copy->device(),
                        buffer.nbytes());
  } else {
    kernels::copy_bytes(buffer.raw_data(), buffer.device(), m.bytes.data(), kernels::Device::cpu(),
                        buffer.nbytes());
  }
  sync_rank_stream();
}

}  // namespace

}  // namespace meshproof::mesh
