#include "mesh/local_comm.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "kernels/cublaslt_resources.h"
#include "kernels/cuda_check.h"
#include "kernels/error.h"
#include "kernels/tensor.h"

namespace meshproof::mesh {

using kernels::Tensor;

namespace {

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
    return kind == o.kind && dtype == o.dtype && numel == o.numel && root == o.root && op == o.op &&
           device.type == o.device.type;
  }
};

}  // namespace

// Shared state of one run: the abort flag, the first error and every group's rendezvous.
struct LocalWorld::Impl {
  class Group;

  explicit Impl(const LocalWorld& w) : world(w) {}

  void abort();

  const LocalWorld& world;
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
        present_(ranks_.size(), 0),
        slots_(ranks_.size()),
        counts_(ranks_.size()) {}

  const std::vector<int>& ranks() const { return ranks_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  const Slot& slot(int member) const { return slots_[static_cast<size_t>(member)]; }

  void publish(int member, const Slot& s) {
    std::lock_guard<std::mutex> lk(mu_);
    slots_[static_cast<size_t>(member)] = s;
  }

  // all_to_all_v: each member's send and receive counts (one per member), copied here before it
  // arrives so that every member can check every pair before any data moves.
  struct Counts {
    std::vector<int64_t> send, recv;
  };
  void publish_counts(int member, const std::vector<int64_t>& send,
                      const std::vector<int64_t>& recv) {
    std::lock_guard<std::mutex> lk(mu_);
    counts_[static_cast<size_t>(member)] = {send, recv};
  }
  const Counts& counts(int member) const { return counts_[static_cast<size_t>(member)]; }

  // A generation barrier with a deadline and an abort check. `what` names the collective, `call`
  // its number among this member's calls on the group (1-based).
  void wait_all(int member, std::string_view what, std::string_view phase, int64_t call) {
    std::unique_lock<std::mutex> lk(mu_);
    throw_if_aborted(what);
    const int64_t gen = generation_;
    present_[static_cast<size_t>(member)] = 1;
    if (++arrived_ == size()) {
      arrived_ = 0;
      std::fill(present_.begin(), present_.end(), 0);
      ++generation_;
      cv_.notify_all();
      return;
    }
    const auto timeout = impl_.world.options().timeout;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (generation_ == gen) {
      throw_if_aborted(what);
      if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && generation_ == gen) {
        std::vector<int> missing;
        for (int m = 0; m < size(); ++m) {
          if (!present_[static_cast<size_t>(m)]) missing.push_back(ranks_[static_cast<size_t>(m)]);
        }
        // The same facts as the mpi launcher's watchdog (mesh/mpi_comm.cc): collective, call,
        // group, waiting rank, missing ranks and how to change the limit.
        MP_FAIL(
            "local {} (call {} on this group, {} phase) on {} group of ranks [{}] timed out after "
            "{:.3f} s on rank {}: ranks [{}] never arrived (stalled, hung or not making this "
            "call); {} sets the limit in seconds (default {})",
            what, call, phase, label_, fmt::join(ranks_, ", "),
            std::chrono::duration<double>(timeout).count(), ranks_[static_cast<size_t>(member)],
            fmt::join(missing, ", "), kCollectiveTimeoutEnv, kDefaultCollectiveTimeout.count());
      }
    }
  }

  void wake_all() {
    std::lock_guard<std::mutex> lk(mu_);
    cv_.notify_all();
    p2p_cv_.notify_all();
  }

  // Point-to-point (defined at the end of the file): `from` posts a copy of its bytes to `to`'s
  // queue; `to` takes the oldest message from `from`.
  struct Message {
    kernels::DType dtype = kernels::DType::kUInt8;
    int64_t numel = 0;
    std::vector<std::byte> bytes;
  };
  void post(int from, int to, Message m);
  Message take(int from, int to, std::string_view what);

 private:
  void throw_if_aborted(std::string_view what) {
    if (impl_.aborted.load()) {
      MP_FAIL("local {} on {} group of ranks [{}] aborted: another rank failed", what, label_,
              fmt::join(ranks_, ", "));
    }
  }

  Impl& impl_;
  std::vector<int> ranks_;
  std::string label_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t generation_ = 0;
  int arrived_ = 0;
  std::vector<char> present_;
  std::vector<Slot> slots_;
  std::vector<Counts> counts_;
  // Point-to-point queues by (sender, receiver) member index, guarded by mu_.
  std::map<std::pair<int, int>, std::deque<Message>> p2p_;
  std::condition_variable p2p_cv_;
};

void LocalWorld::Impl::abort() {
  aborted.store(true);
  for (auto& [key, g] : groups) g->wake_all();
}

namespace {

void sync_rank_stream() { kernels::synchronize_current(); }

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(LocalWorld::Impl::Group& group, int index, std::string label)
      : Communicator(group.ranks(), index, std::move(label)), group_(group) {}

  std::string_view backend() const override { return "local"; }

 protected:
  void do_all_gather(const Tensor& input, Tensor& output) override {
    const Slot me{CollectiveKind::kAllGather, input.dtype(), input.numel().value, 0, ReduceOp::kSum,
                  input.raw_data(),           input.device()};
    arrive(me);
    const kernels::Bytes chunk = input.nbytes();
    char* out = static_cast<char*>(output.raw_data());
    for (int s = 0; s < size(); ++s) {
      void* dst = out + s * chunk.value;
      const Slot& src = group_.slot(s);
      if (dst == src.ptr) continue;  // in place: the member's own slice of its output
      kernels::copy_bytes(dst, output.device(), src.ptr, src.device, chunk);
    }
    depart("all_gather");
  }

  void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    const Slot me{CollectiveKind::kReduceScatter,
                  input.dtype(),
                  input.numel().value,
                  0,
                  op,
                  input.raw_data(),
                  input.device()};
    arrive(me);
    const int64_t count = output.numel().value;
    std::vector<const float*> ins(static_cast<size_t>(size()));
    for (int s = 0; s < size(); ++s) {
      ins[static_cast<size_t>(s)] = static_cast<const float*>(group_.slot(s).ptr) + rank() * count;
    }
    reduce(output, ins, count, op);
    depart("reduce_scatter");
  }

  void do_all_reduce(Tensor& buffer, ReduceOp op) override {
    // Reduce-scatter then all-gather in place, without staging copies: member m reduces chunk m
    // of everyone's buffer (rank order) into its own chunk m, which no other member reads in that
    // phase; after a barrier every member copies the finished chunks s != m from member s.
    const Slot me{CollectiveKind::kAllReduce, buffer.dtype(), buffer.numel().value, 0, op,
                  buffer.raw_data(),          buffer.device()};
    arrive(me);
    const int64_t count = buffer.numel().value;
    const int64_t chunk = (count + size() - 1) / size();
    auto begin = [&](int m) { return std::min<int64_t>(m * chunk, count); };
    auto end = [&](int m) { return std::min<int64_t>((m + 1) * chunk, count); };
    const int64_t lo = begin(rank()), hi = end(rank());
    std::vector<const float*> ins(static_cast<size_t>(size()));
    for (int s = 0; s < size(); ++s) {
      ins[static_cast<size_t>(s)] = static_cast<const float*>(group_.slot(s).ptr) + lo;
    }
    Tensor mine = buffer.view(kernels::Shape{count}).slice_rows(lo, hi);
    reduce(mine, ins, hi - lo, op);
    sync_rank_stream();
    group_.wait_all(rank(), "all_reduce", "reduction", calls_);
    float* out = buffer.data<float>();
    for (int s = 0; s < size(); ++s) {
      if (s == rank() || end(s) == begin(s)) continue;
      const Slot& src = group_.slot(s);
      kernels::copy_bytes(out + begin(s), buffer.device(),
                          static_cast<const float*>(src.ptr) + begin(s), src.device,
                          kernels::Bytes((end(s) - begin(s)) * 4));
    }
    depart("all_reduce");
  }

  void do_broadcast(Tensor& buffer, int root) override {
    const Slot me{
        CollectiveKind::kBroadcast, buffer.dtype(), buffer.numel().value, root, ReduceOp::kSum,
        buffer.raw_data(),          buffer.device()};
    arrive(me);
    if (rank() != root) {
      const Slot& src = group_.slot(root);
      kernels::copy_bytes(buffer.raw_data(), buffer.device(), src.ptr, src.device, buffer.nbytes());
    }
    depart("broadcast");
  }

  void do_barrier() override {
    arrive(Slot{CollectiveKind::kBarrier, kernels::DType::kUInt8, 0, 0, ReduceOp::kSum, nullptr,
                kernels::current_context().device});
    depart("barrier");
  }

  // Every member reads its part of each member's input: member s's elements for this rank start
  // after s's counts for the members before this rank.
  void do_all_to_all_v(const Tensor& input, const std::vector<int64_t>& send_counts, Tensor& output,
                       const std::vector<int64_t>& recv_counts) override {
    const Slot me{CollectiveKind::kAllToAll, input.dtype(), 0, 0, ReduceOp::kSum,
                  input.raw_data(),          input.device()};
    group_.publish_counts(rank(), send_counts, recv_counts);
    arrive(me);
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
      const Slot& src = group_.slot(s);
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
  // Publishes this member's call (its input must be complete: the stream is synchronised),
  // waits for everyone and checks that all members made the same call.
  void arrive(const Slot& me) {
    sync_rank_stream();
    group_.publish(rank(), me);
    ++calls_;
    const std::string_view what = collective_name(me.kind);
    group_.wait_all(rank(), what, "arrival", calls_);
    for (int s = 0; s < size(); ++s) {
      const Slot& o = group_.slot(s);
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
      MP_CHECK(group_.slot(s).device == out.device(),
               "local device reduction on {}: rank {} holds its buffer on {} but this rank on {} "
               "(virtual ranks of one reduction must share a GPU)",
               describe(), ranks()[static_cast<size_t>(s)], group_.slot(s).device.str(),
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

  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    std::function<void()> body = [this, &impl, &fn, &streams, r] {
      try {
        kernels::ScopedRankContext ctx(kernels::RankContext{
            r, options_.device, streams[static_cast<size_t>(r)],
            memory_[static_cast<size_t>(r)].get(), copies_[static_cast<size_t>(r)].get()});
        LocalRankComms comms(impl, r);
        fn(comms);
        kernels::synchronize_current();
      } catch (const kernels::Error& e) {
        std::exception_ptr err =
            std::make_exception_ptr(kernels::Error(e.kind(), e.file(), e.line(), e.expression(),
                                                   fmt::format("rank {}: {}", r, e.message())));
        {
          std::lock_guard<std::mutex> lk(impl.error_mu);
          if (!impl.first_error) impl.first_error = err;
        }
        impl.abort();
      } catch (const std::exception& e) {
        std::exception_ptr err =
            std::make_exception_ptr(kernels::Error(kernels::ErrorKind::kRuntime, __FILE__, __LINE__,
                                                   "", fmt::format("rank {}: {}", r, e.what())));
        {
          std::lock_guard<std::mutex> lk(impl.error_mu);
          if (!impl.first_error) impl.first_error = err;
        }
        impl.abort();
      }
    };
    try {
      threads.push_back(options_.start_thread ? options_.start_thread(std::move(body))
                                              : std::thread(std::move(body)));
    } catch (const std::exception& e) {
      // The ranks already running may wait in a collective for this one: abort them, join
      // them, then report the start failure (the cause) rather than their aborts.
      impl.abort();
      for (auto& t : threads) t.join();
      MP_FAIL("local world {}: could not start the thread of rank {} of {} ({} running): {}",
              mesh_.str(), r, n, threads.size(), e.what());
    }
  }
  for (auto& t : threads) t.join();
  if (impl.first_error) std::rethrow_exception(impl.first_error);
}

// ---- point-to-point ----------------------------------------------------------------------------

void LocalWorld::Impl::Group::post(int from, int to, Message m) {
  std::lock_guard<std::mutex> lk(mu_);
  p2p_[{from, to}].push_back(std::move(m));
  p2p_cv_.notify_all();
}

LocalWorld::Impl::Group::Message LocalWorld::Impl::Group::take(int from, int to,
                                                               std::string_view what) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto timeout = impl_.world.options().timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::deque<Message>& q = p2p_[{from, to}];
  while (q.empty()) {
    throw_if_aborted(what);
    if (p2p_cv_.wait_until(lk, deadline) == std::cv_status::timeout && q.empty()) {
      MP_FAIL(
          "local {} on {} group of ranks [{}] timed out after {:.3f} s on rank {}: rank {} never "
          "sent (stalled, hung or not making this call); {} sets the limit in seconds (default "
          "{})",
          what, label_, fmt::join(ranks_, ", "), std::chrono::duration<double>(timeout).count(),
          ranks_[static_cast<size_t>(to)], ranks_[static_cast<size_t>(from)], kCollectiveTimeoutEnv,
          kDefaultCollectiveTimeout.count());
    }
  }
  Message m = std::move(q.front());
  q.pop_front();
  return m;
}

namespace {

// The bytes are copied out before send returns (the buffer may be reused at once), so a send
// never waits for its receive: a pipeline stage may send its activation and go on.
void LocalCommunicator::do_send(const Tensor& buffer, int peer) {
  sync_rank_stream();
  LocalWorld::Impl::Group::Message m;
  m.dtype = buffer.dtype();
  m.numel = buffer.numel().value;
  m.bytes.resize(static_cast<size_t>(buffer.nbytes().value));
  kernels::copy_bytes(m.bytes.data(), kernels::Device::cpu(), buffer.raw_data(), buffer.device(),
                      buffer.nbytes());
  group_.post(rank(), peer, std::move(m));
}

void LocalCommunicator::do_recv(Tensor& buffer, int peer) {
  const LocalWorld::Impl::Group::Message m = group_.take(peer, rank(), "recv");
  MP_CHECK(m.dtype == buffer.dtype() && m.numel == buffer.numel().value,
           "local recv on {}: rank {} sent {} elements of {} but rank {} receives into {}",
           describe(), ranks()[static_cast<size_t>(peer)], m.numel, kernels::dtype_name(m.dtype),
           ranks()[static_cast<size_t>(rank())], buffer.describe());
  kernels::copy_bytes(buffer.raw_data(), buffer.device(), m.bytes.data(), kernels::Device::cpu(),
                      buffer.nbytes());
  sync_rank_stream();
}

}  // namespace

}  // namespace meshproof::mesh
