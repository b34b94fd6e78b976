#include "mesh/mpi/mpi_comm.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "mesh/core/nccl_check.h"

namespace meshproof::mesh {

bool mpi_compiled() { return MESHPROOF_HAVE_MPI != 0; }

#if MESHPROOF_HAVE_MPI

using kernels::Tensor;

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialized = 0;
  MP_MPI_CHECK(MPI_Initialized(&initialized));
  if (!initialized) {
    int provided = 0;
    MP_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
    owns_ = true;
  }
  MP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  MP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
}

MpiSession::~MpiSession() {
  if (owns_) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
}

namespace {

int checked_int(int64_t bytes, std::string_view what) {
  MP_CHECK_INPUT(bytes <= INT_MAX, "mpi {}: {} bytes per member exceed MPI's int count", what,
                 bytes);
  return static_cast<int>(bytes);
}

void check_host(const Tensor& t, std::string_view what) {
  MP_CHECK_INPUT(t.device().is_cpu(),
                 "mpi {}: {} is on the device; the mpi communicator takes host tensors (use the "
                 "nccl communicator for device buffers)",
                 what, t.describe());
}

using Clock = std::chrono::steady_clock;

// Exit status of a job the watchdog aborts: harness/verbs/exit_codes.h kExitRuntimeError (mesh sits
// below the harness and cannot include it).
constexpr int kWatchdogExitCode = 3;

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::vector<int> ranks, int index, std::string label,
                  std::chrono::milliseconds timeout)
      : Communicator(std::move(ranks), index, std::move(label)), comm_(comm), timeout_(timeout) {
    // Arrival notices travel on a communicator of their own, so they can never match anything
    // the collectives send.
    MP_MPI_CHECK(MPI_Comm_dup(comm_, &watch_));
    int* tag_ub = nullptr;
    int flag = 0;
    MP_MPI_CHECK(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &flag));
    tag_ub_ = flag && tag_ub ? *tag_ub : 32767;
  }
  ~MpiCommunicator() override {
    for (Notice& n : sent_) MPI_Request_free(&n.request);
    if (watch_ != MPI_COMM_NULL) MPI_Comm_free(&watch_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  std::string_view backend() const override { return "mpi"; }

 protected:
  void do_all_gather(const Tensor& input, Tensor& output) override {
    check_host(input, "all_gather");
    const int bytes = checked_int(input.nbytes().value, "all_gather");
    char* out = static_cast<char*>(output.raw_data());
    const void* in = input.raw_data();
    if (in == out + static_cast<int64_t>(rank()) * bytes) in = MPI_IN_PLACE;
    MPI_Request req = MPI_REQUEST_NULL;
    MP_MPI_CHECK(MPI_Iallgather(in, bytes, MPI_BYTE, out, bytes, MPI_BYTE, comm_, &req));
    watched_wait(req, "all_gather");
  }

  void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    check_host(input, "reduce_scatter");
    const int64_t count = output.numel().value;
    // recv[s] = chunk rank() of member s's input; then reduce in rank order.
    std::vector<float> recv(static_cast<size_t>(count * size()));
    const int bytes = checked_int(count * 4, "reduce_scatter");
    MPI_Request req = MPI_REQUEST_NULL;
    MP_MPI_CHECK(MPI_Ialltoall(input.raw_data(), bytes, MPI_BYTE, recv.data(), bytes, MPI_BYTE,
                               comm_, &req));
    watched_wait(req, "reduce_scatter");
    reduce_from(recv, output.data<float>(), count, op);
  }

  void do_all_reduce(Tensor& buffer, ReduceOp op) override {
    check_host(buffer, "all_reduce");
    // Reduce-scatter (all-to-all of chunks, rank-order reduction of this member's chunk) then
    // all-gather: per element the same rank-order sum as the local backend, 1/n of the work.
    // The buffer is padded to n equal chunks; the padding is reduced but never copied back.
    const int64_t count = buffer.numel().value;
    const int64_t chunk = (count + size() - 1) / size();
    std::vector<float> send(static_cast<size_t>(chunk * size()), 0.0f);
    std::copy_n(buffer.data<float>(), count, send.begin());
    std::vector<float> recv(send.size());
    const int bytes = checked_int(chunk * 4, "all_reduce");
    MPI_Request req = MPI_REQUEST_NULL;
    MP_MPI_CHECK(
        MPI_Ialltoall(send.data(), bytes, MPI_BYTE, recv.data(), bytes, MPI_BYTE, comm_, &req));
    watched_wait(req, "all_reduce");
    std::vector<float> mine(static_cast<size_t>(chunk));
    reduce_from(recv, mine.data(), chunk, op);
    MP_MPI_CHECK(
        MPI_Iallgather(mine.data(), bytes, MPI_BYTE, send.data(), bytes, MPI_BYTE, comm_, &req));
    watched_wait(req, "all_reduce", /*same_call=*/true);
    std::copy_n(send.begin(), count, buffer.data<float>());
  }

  void do_broadcast(Tensor& buffer, int root) override {
    check_host(buffer, "broadcast");
    MPI_Request req = MPI_REQUEST_NULL;
    MP_MPI_CHECK(MPI_Ibcast(buffer.raw_data(), checked_int(buffer.nbytes().value, "broadcast"),
                            MPI_BYTE, root, comm_, &req));
    watched_wait(req, "broadcast");
  }

  void do_barrier() override {
    MPI_Request req = MPI_REQUEST_NULL;
    MP_MPI_CHECK(MPI_Ibarrier(comm_, &req));
    watched_wait(req, "barrier");
  }

  // MPI_Alltoallv in bytes. A mismatch of counts between members is MPI's to detect (a
  // truncation error); the caller exchanges counts first.
  void do_all_to_all_v(const Tensor& input, const std::vector<int64_t>& send_counts, Tensor& output,
                       const std::vector<int64_t>& recv_counts) override {
    check_host(input, "all_to_all_v");
    const int64_t elem = kernels::dtype_bits(input.dtype()) / 8;
    const auto n = static_cast<size_t>(size());
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    int64_t so = 0, ro = 0;
    for (size_t s = 0; s < n; ++s) {
      sc[s] = checked_int(send_counts[s] * elem, "all_to_all_v");
      rc[s] = checked_int(recv_counts[s] * elem, "all_to_all_v");
      sd[s] = checked_int(so, "all_to_all_v");
      rd[s] = checked_int(ro, "all_to_all_v");
      so += send_counts[s] * elem;
      ro += recv_counts[s] * elem;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    MP_MPI_CHECK(MPI_Ialltoallv(input.raw_data(), sc.data(), sd.data(), MPI_BYTE, output.raw_data(),
                                rc.data(), rd.data(), MPI_BYTE, comm_, &req));
    watched_wait(req, "all_to_all_v");
  }
  void do_send(const Tensor& buffer, int peer) override;  // at the end of the file
  void do_recv(Tensor& buffer, int peer) override;

 private:
  void reduce_from(const std::vector<float>& recv, float* out, int64_t count, ReduceOp op) {
    std::vector<const float*> ins(static_cast<size_t>(size()));
    for (int s = 0; s < size(); ++s) ins[static_cast<size_t>(s)] = recv.data() + s * count;
    reduce_rank_order_host(out, ins.data(), size(), count, op);
  }

  // The watchdog. Waits for `req` polling MPI_Test: a busy poll for the first 200 us (latency:
  // most collectives finish there), then sleeps that double from 20 us to 5 ms, so a rank
  // waiting on a stalled peer sleeps instead of spinning a core at 100%. After
  // min(timeout / 4, 2 s) it sends each other member an arrival notice (this member's call
  // number on the group) and listens for theirs; members waiting in the same call answer the
  // same way. At the deadline the members not heard from at this call are the missing ones: the
  // message names the collective, the group and them, and MPI_Abort ends the whole job (a
  // thrown error would leave the other processes waiting on the stalled one, and MPI_Finalize
  // would hang on it). `same_call`: the second half of a collective (all_reduce's all-gather),
  // which keeps the call number of the first.
  void watched_wait(MPI_Request& req, std::string_view what, bool same_call = false) {
    if (!same_call) ++calls_;
    const Clock::time_point start = Clock::now();
    const Clock::time_point notice_at =
        start + std::min<Clock::duration>(timeout_ / 4, std::chrono::seconds(2));
    const Clock::time_point deadline = start + timeout_;
    std::chrono::microseconds nap{0};
    bool listening = false;
    for (;;) {
      int done = 0;
      MP_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
      if (done) break;
      const Clock::time_point now = Clock::now();
      if (!listening && now >= notice_at) {
        announce();
        listening = true;
      }
      if (now >= deadline) abort_job(what, now - start);
      if (now - start < std::chrono::microseconds(200)) continue;
      nap = std::clamp(nap * 2, std::chrono::microseconds(20), std::chrono::microseconds(5000));
      std::this_thread::sleep_for(nap);
    }
    if (listening) stop_listening();
  }

  int notice_tag() const { return static_cast<int>(calls_ % tag_ub_); }

  void announce() {
    // Reap the notices of earlier calls that have left (eager 8-byte sends complete at once).
    while (!sent_.empty()) {
      int done = 0;
      MP_MPI_CHECK(MPI_Test(&sent_.front().request, &done, MPI_STATUS_IGNORE));
      if (!done) break;
      sent_.pop_front();
    }
    heard_.assign(static_cast<size_t>(size()), -1);
    listen_.assign(static_cast<size_t>(size()), MPI_REQUEST_NULL);
    for (int m = 0; m < size(); ++m) {
      if (m == rank()) continue;
      Notice& n = sent_.emplace_back();
      n.call = std::make_unique<int64_t>(calls_);
      MP_MPI_CHECK(MPI_Isend(n.call.get(), 1, MPI_INT64_T, m, notice_tag(), watch_, &n.request));
      MP_MPI_CHECK(MPI_Irecv(&heard_[static_cast<size_t>(m)], 1, MPI_INT64_T, m, notice_tag(),
                             watch_, &listen_[static_cast<size_t>(m)]));
    }
  }

  void p2p_wait(MPI_Request& req, std::string_view what, int peer);

  void stop_listening() {
    for (MPI_Request& r : listen_) {
      if (r == MPI_REQUEST_NULL) continue;
      int done = 0;
      MP_MPI_CHECK(MPI_Test(&r, &done, MPI_STATUS_IGNORE));
      if (done) continue;
      MP_MPI_CHECK(MPI_Cancel(&r));
      MP_MPI_CHECK(MPI_Wait(&r, MPI_STATUS_IGNORE));
    }
  }

  [[noreturn]] void abort_job(std::string_view what, Clock::duration waited) {
    std::vector<int> missing;
    std::vector<std::string> elsewhere;
    for (int m = 0; m < size(); ++m) {
      if (m == rank()) continue;
      int done = 0;
      MPI_Test(&listen_[static_cast<size_t>(m)], &done, MPI_STATUS_IGNORE);
      const int64_t at = done ? heard_[static_cast<size_t>(m)] : -1;
      if (at == calls_) continue;
      const int global = ranks()[static_cast<size_t>(m)];
      missing.push_back(global);
      if (at >= 0) elsewhere.push_back(fmt::format("rank {} is at call {}", global, at));
    }
    const std::string msg = fmt::format(
        "meshproof: mpi {} (call {} on this group) on {} group of ranks [{}] timed out after "
        "{:.3f} s on rank {}: ranks [{}] never arrived (stopped, hung or dead){}{}; aborting the "
        "job. {} sets the limit in seconds (default {})",
        what, calls_, label(), fmt::join(ranks(), ", "),
        std::chrono::duration<double>(waited).count(), ranks()[static_cast<size_t>(rank())],
        fmt::join(missing, ", "), elsewhere.empty() ? "" : ": ", fmt::join(elsewhere, ", "),
        kCollectiveTimeoutEnv, kDefaultCollectiveTimeout.count());
    std::fprintf(stderr, "%s\n", msg.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);
    std::_Exit(kWatchdogExitCode);  // MPI_Abort does not return; if it did, still end here
  }

  struct Notice {
    std::unique_ptr<int64_t> call;  // the send buffer, alive until the send completes
    MPI_Request request = MPI_REQUEST_NULL;
  };

  MPI_Comm comm_;
  MPI_Comm watch_ = MPI_COMM_NULL;
  std::chrono::milliseconds timeout_;
  int tag_ub_ = 32767;
  int64_t calls_ = 0;                // collectives started on this group
  std::vector<int64_t> heard_;       // per member: the call its notice named, -1 none yet
  std::vector<MPI_Request> listen_;  // per member: the receive of its notice
  std::deque<Notice> sent_;
};

}  // namespace

MpiRankComms::MpiRankComms(DeviceMesh mesh, std::chrono::milliseconds timeout) : mesh_(mesh) {
  MP_CHECK_INPUT(timeout.count() > 0, "mpi communicators: the collective timeout must be positive");
  int initialized = 0;
  MP_MPI_CHECK(MPI_Initialized(&initialized));
  MP_CHECK(initialized, "MpiRankComms needs MPI to be initialised (create an MpiSession first)");
  int world = 0;
  MP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  MP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  mesh_.check_world_size(world);
  // Every group of every dim set, split in the same order on every process.
  for (unsigned bits = 0; bits < (1u << kNumGroupDims); ++bits) {
    const DimSet dims = DimSet::from_bits(bits);
    MPI_Comm comm = MPI_COMM_NULL;
    MP_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, mesh_.group_color(rank_, dims),
                                mesh_.group_index(rank_, dims), &comm));
    int index = -1;
    MP_MPI_CHECK(MPI_Comm_rank(comm, &index));
    MP_CHECK(index == mesh_.group_index(rank_, dims),
             "MPI_Comm_split gave rank {} index {}, mesh {}", rank_, index,
             mesh_.group_index(rank_, dims));
    comms_.push_back(std::make_unique<MpiCommunicator>(comm, mesh_.group_ranks(rank_, dims), index,
                                                       dims.str(), timeout));
  }
}

MpiRankComms::~MpiRankComms() = default;

Communicator& MpiRankComms::group(DimSet dims) { return *comms_.at(dims.bits()); }

#else  // !MESHPROOF_HAVE_MPI

MpiSession::MpiSession(int*, char***) {
  MP_FAIL_INPUT("the mpi launcher is not available: meshproof was built without MPI");
}
MpiSession::~MpiSession() = default;

MpiRankComms::MpiRankComms(DeviceMesh mesh, std::chrono::milliseconds) : mesh_(mesh) {
  MP_FAIL_INPUT("the mpi launcher is not available: meshproof was built without MPI");
}
MpiRankComms::~MpiRankComms() = default;
Communicator& MpiRankComms::group(DimSet) {
  MP_FAIL_INPUT("the mpi launcher is not available: meshproof was built without MPI");
}

#endif

#if MESHPROOF_HAVE_MPI
// ---- point-to-point ----------------------------------------------------------------------------
namespace {

// Tags on the group's own communicator (point-to-point never matches a collective): a header
// (dtype, element count) then the bytes, so a receive into a buffer of another dtype or size
// fails naming both ends instead of truncating.
constexpr int kP2pHeaderTag = 1;
constexpr int kP2pDataTag = 2;

// A point-to-point wait: the same polling as watched_wait, without the arrival notices (only two
// members take part, and the others' call counts do not move); at the deadline the job aborts
// naming the peer.
void MpiCommunicator::p2p_wait(MPI_Request& req, std::string_view what, int peer) {
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + timeout_;
  std::chrono::microseconds nap{0};
  for (;;) {
    int done = 0;
    MP_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (done) return;
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      const std::string msg = fmt::format(
          "meshproof: mpi {} between ranks {} and {} on {} group of ranks [{}] timed out after "
          "{:.3f} s: the peer never made the matching call (stopped, hung or dead); aborting the "
          "job. {} sets the limit in seconds (default {})",
          what, ranks()[static_cast<size_t>(rank())], ranks()[static_cast<size_t>(peer)], label(),
          fmt::join(ranks(), ", "), std::chrono::duration<double>(now - start).count(),
          kCollectiveTimeoutEnv, kDefaultCollectiveTimeout.count());
      std::fprintf(stderr, "%s\n", msg.c_str());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);
      std::_Exit(kWatchdogExitCode);
    }
    if (now - start < std::chrono::microseconds(200)) continue;
    nap = std::clamp(nap * 2, std::chrono::microseconds(20), std::chrono::microseconds(5000));
    std::this_thread::sleep_for(nap);
  }
}

void MpiCommunicator::do_send(const Tensor& buffer, int peer) {
  check_host(buffer, "send");
  const int bytes = checked_int(buffer.nbytes().value, "send");
  const int64_t header[2] = {static_cast<int64_t>(buffer.dtype()), buffer.numel().value};
  MPI_Request req = MPI_REQUEST_NULL;
  MP_MPI_CHECK(MPI_Isend(header, 2, MPI_INT64_T, peer, kP2pHeaderTag, comm_, &req));
  p2p_wait(req, "send", peer);
  MP_MPI_CHECK(MPI_Isend(buffer.raw_data(), bytes, MPI_BYTE, peer, kP2pDataTag, comm_, &req));
  p2p_wait(req, "send", peer);
}

void MpiCommunicator::do_recv(Tensor& buffer, int peer) {
  check_host(buffer, "recv");
  const int bytes = checked_int(buffer.nbytes().value, "recv");
  int64_t header[2] = {0, 0};
  MPI_Request req = MPI_REQUEST_NULL;
  MP_MPI_CHECK(MPI_Irecv(header, 2, MPI_INT64_T, peer, kP2pHeaderTag, comm_, &req));
  p2p_wait(req, "recv", peer);
  const auto dtype = static_cast<kernels::DType>(header[0]);
  MP_CHECK(dtype == buffer.dtype() && header[1] == buffer.numel().value,
           "mpi recv on {}: rank {} sends {} elements of {} but rank {} receives into {}",
           describe(), ranks()[static_cast<size_t>(peer)], header[1], kernels::dtype_name(dtype),
           ranks()[static_cast<size_t>(rank())], buffer.describe());
  MP_MPI_CHECK(MPI_Irecv(buffer.raw_data(), bytes, MPI_BYTE, peer, kP2pDataTag, comm_, &req));
  p2p_wait(req, "recv", peer);
}

}  // namespace
#endif

}  // namespace meshproof::mesh

#if MESHPROOF_HAVE_MPI && MESHPROOF_SANITIZE_BUILD
// Sanitizer builds only (docs/design.md section 17): Open MPI 4.1 dlopens its MCA plugins and
// dlcloses them in MPI_Finalize, before LeakSanitizer reports at exit, so the process-lifetime
// allocations made inside a plugin show as "<unknown module>" frames that no suppression can
// name. This definition, in the object every MPI-using binary links, interposes libc's dlclose
// for the whole process and keeps every plugin mapped: the stacks then name the plugin's file
// and tests/sanitize/lsan.supp matches it (a leak in meshproof code still has no such frame).
// Open MPI 5 has mca_base_component_disable_dlclose for this; 4.1 has no such parameter.
extern "C" int dlclose(void*) { return 0; }
#endif
