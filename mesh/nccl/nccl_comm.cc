// NCCL communicators (mesh/nccl/nccl_comm.h): the group plan (host logic, every build), the
// communicator over one mesh group, and their lifetime (bootstrap, splits, per-process cache,
// parallel teardown) for both launchers.
// Over 600 lines on purpose: the communicator, the two launchers and the teardown share the
// per-rank State defined here (its raw handles, stream and reserve); the plan and teardown order
// are separate host functions tested on the CPU (tests/mesh/nccl/nccl_plan_test.cc).
#include "mesh/nccl/nccl_comm.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>

#include "kernels/core/cuda_check.h"
#include "kernels/core/device.h"
#include "kernels/core/device_reserve.h"
#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "kernels/gemm/cublaslt_resources.h"
#include "mesh/core/nccl_check.h"

namespace meshproof::mesh {

// ---- host logic (every build) -----------------------------------------------------------------

std::vector<unsigned> nccl_group_plan(const DeviceMesh& mesh) {
  unsigned trivial = 0;  // dims of size 1 (pp's bit only exists with pp > 1: group_slots)
  for (int d = 0; d < kNumGroupDims; ++d)
    if (mesh.size(static_cast<MeshDim>(d)) == 1) trivial |= 1u << d;
  std::vector<unsigned> plan(mesh.group_slots());
  for (unsigned bits = 0; bits < plan.size(); ++bits) plan[bits] = bits & ~trivial;
  return plan;
}

std::vector<unsigned> nccl_distinct_splits(const std::vector<unsigned>& plan) {
  std::vector<unsigned> out = plan;
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<std::string> destroy_in_parallel(size_t members,
                                             const std::function<void(size_t)>& destroy) {
  std::vector<std::string> failure(members);  // one slot per member: no lock needed
  std::vector<std::thread> threads;
  threads.reserve(members);
  for (size_t m = 0; m < members; ++m) {
    threads.emplace_back([&destroy, &failure, m] {
      try {
        destroy(m);
      } catch (const std::exception& e) {
        failure[m] = fmt::format("member {}: {}", m, e.what());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<std::string> out;
  for (std::string& f : failure)
    if (!f.empty()) out.push_back(std::move(f));
  return out;
}

#if MESHPROOF_HAVE_CUDA

using kernels::Tensor;

namespace {

// The "nccl" device reserve: bytes taken by creating each device's cached communicators.
std::mutex g_reserve_mu;
std::map<int, int64_t> g_reserve;  // CUDA ordinal -> bytes

void add_nccl_reserve(int device, int64_t delta) {
  std::lock_guard<std::mutex> lock(g_reserve_mu);
  const int64_t now = std::max<int64_t>(0, g_reserve[device] + delta);
  g_reserve[device] = now;
  kernels::set_device_reserve(kernels::Device::cuda(device), "nccl", kernels::Bytes(now));
}

// Free device memory of `device` (cudaMemGetInfo), to measure what communicator creation takes.
int64_t free_bytes(int device) {
  MP_CUDA_CHECK(cudaSetDevice(device));
  size_t free = 0, total = 0;
  MP_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<int64_t>(free);
}

}  // namespace

struct NcclRankComms::State {
  ncclComm_t world = nullptr;
  std::vector<ncclComm_t> owned;                     // the distinct splits, in split order
  std::vector<ncclComm_t> raw;                       // per DimSet bits (aliases of owned/world)
  std::vector<std::unique_ptr<Communicator>> comms;  // per DimSet bits
  cudaStream_t stream = nullptr;
  int device = 0;
  int64_t reserve = 0;                            // bytes of this rank's "nccl" reserve
  const std::atomic<bool>* abort_flag = nullptr;  // single-process runs only
  bool aborted = false;
  bool destroyed = false;

  // Local (waits for no peer), so one thread may abort every rank of a set. The result is
  // ignored: there is nothing left to do with a communicator whose abort failed.
  void abort_all() {
    if (aborted || destroyed) return;
    aborted = true;
    for (ncclComm_t c : owned)
      if (c != nullptr) (void)ncclCommAbort(c);
    if (world != nullptr) (void)ncclCommAbort(world);
    owned.clear();
    raw.assign(raw.size(), nullptr);
    world = nullptr;
  }

  // Returns the first failure ("" when none); never throws (destructors call it).
  std::string destroy() {
    if (destroyed) return "";
    destroyed = true;
    std::string error;
    auto note = [&error](std::string_view what, const char* msg) {
      if (error.empty()) error = fmt::format("{}: {}", what, msg);
    };
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
      note("cudaSetDevice", cudaGetErrorString(e));
    // Communicators first: their scratch buffers are freed on `stream`, which must still exist.
    comms.clear();
    if (stream != nullptr) {
      if (const cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess)
        note("cudaStreamSynchronize", cudaGetErrorString(e));
    }
    if (!aborted) {
      // The splits share the world's resources (splitShare): each child is finalized and
      // destroyed before the world. Finalize waits for the communicator's other ranks, which
      // run the same sequence on their own threads or processes.
      auto result = [](ncclResult_t r) {
        return r == ncclSuccess ? std::string() : std::string(ncclGetErrorString(r));
      };
      const std::string e = finalize_and_destroy(
          owned, world, [&](ncclComm_t c) { return result(ncclCommFinalize(c)); },
          [&](ncclComm_t c) { return result(ncclCommDestroy(c)); });
      if (!e.empty()) note("nccl", e.c_str());
    }
    owned.clear();
    raw.assign(raw.size(), nullptr);
    world = nullptr;
    if (stream != nullptr) {
      kernels::release_stream_resources(stream);  // its cuBLASLt handle and workspace
      if (const cudaError_t e = cudaStreamDestroy(stream); e != cudaSuccess)
        note("cudaStreamDestroy", cudaGetErrorString(e));
      stream = nullptr;
    }
    if (reserve != 0) {
      add_nccl_reserve(device, -reserve);
      reserve = 0;
    }
    return error;
  }

  ~State() { destroy(); }
};

namespace {

ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  MP_FAIL("invalid ReduceOp");
}

void check_device(const Tensor& t, std::string_view what) {
  MP_CHECK_INPUT(t.device().is_cuda(),
                 "nccl {}: {} is a host tensor; the nccl communicator takes device buffers", what,
                 t.describe());
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(NcclRankComms::State& state, ncclComm_t comm, std::vector<int> ranks, int index,
                   std::string label)
      : Communicator(std::move(ranks), index, std::move(label)), state_(state), comm_(comm) {}

  std::string_view backend() const override { return "nccl"; }

 protected:
  void do_all_gather(const Tensor& input, Tensor& output) override {
    check_device(input, "all_gather");
    // Raw bytes: any byte-sized dtype gathers bit for bit.
    MP_NCCL_CHECK(ncclAllGather(input.raw_data(), output.raw_data(),
                                static_cast<size_t>(input.nbytes().value), ncclUint8, comm_,
                                stream()));
    wait("all_gather");
  }

  void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    check_device(input, "reduce_scatter");
    MP_NCCL_CHECK(ncclReduceScatter(input.raw_data(), output.raw_data(),
                                    static_cast<size_t>(output.numel().value), ncclFloat32,
                                    to_nccl(op), comm_, stream()));
    wait("reduce_scatter");
  }

  void do_all_reduce(Tensor& buffer, ReduceOp op) override {
    check_device(buffer, "all_reduce");
    MP_NCCL_CHECK(ncclAllReduce(buffer.raw_data(), buffer.raw_data(),
                                static_cast<size_t>(buffer.numel().value), ncclFloat32, to_nccl(op),
                                comm_, stream()));
    wait("all_reduce");
  }

  void do_broadcast(Tensor& buffer, int root) override {
    check_device(buffer, "broadcast");
    MP_NCCL_CHECK(ncclBroadcast(buffer.raw_data(), buffer.raw_data(),
                                static_cast<size_t>(buffer.nbytes().value), ncclUint8, root, comm_,
                                stream()));
    wait("broadcast");
  }

  void do_barrier() override {
    // NCCL has no barrier: a one-element all-reduce on a scratch buffer orders every member.
    if (!scratch_.defined()) {
      // The communicator outlives the run (and its memory tracker): allocate untracked.
      kernels::RankContext ctx = kernels::current_context();
      ctx.memory = nullptr;
      const kernels::ScopedRankContext untracked(ctx);
      scratch_ = Tensor::zeros(kernels::Shape{1}, kernels::DType::kFloat32, ctx.device);
    }
    MP_NCCL_CHECK(ncclAllReduce(scratch_.raw_data(), scratch_.raw_data(), 1, ncclFloat32, ncclSum,
                                comm_, stream()));
    wait("barrier");
  }

  // One ncclSend / ncclRecv per member with a nonzero count (raw bytes), fused in a group so
  // that the pairs cannot deadlock; the group index is the NCCL rank of this communicator.
  void do_all_to_all_v(const Tensor& input, const std::vector<int64_t>& send_counts, Tensor& output,
                       const std::vector<int64_t>& recv_counts) override {
    check_device(input, "all_to_all_v");
    const auto elem = static_cast<size_t>(kernels::dtype_bits(input.dtype()) / 8);
    const char* in = static_cast<const char*>(input.raw_data());
    char* out = static_cast<char*>(output.raw_data());
    size_t so = 0, ro = 0;
    MP_NCCL_CHECK(ncclGroupStart());
    for (int s = 0; s < size(); ++s) {
      const size_t sb = static_cast<size_t>(send_counts[static_cast<size_t>(s)]) * elem;
      const size_t rb = static_cast<size_t>(recv_counts[static_cast<size_t>(s)]) * elem;
      if (sb > 0) MP_NCCL_CHECK(ncclSend(in + so, sb, ncclUint8, s, comm_, stream()));
      if (rb > 0) MP_NCCL_CHECK(ncclRecv(out + ro, rb, ncclUint8, s, comm_, stream()));
      so += sb;
      ro += rb;
    }
    MP_NCCL_CHECK(ncclGroupEnd());
    wait("all_to_all_v");
  }

  void do_send(const Tensor& buffer, int peer) override;  // at the end of the file
  void do_recv(Tensor& buffer, int peer) override;

 private:
  cudaStream_t stream() const {
    return static_cast<cudaStream_t>(kernels::current_context().stream);
  }

  // Polls instead of cudaStreamSynchronize so that an async NCCL error or an abort of the
  // single-process world ends the wait.
  void wait(std::string_view what) {
    while (true) {
      const cudaError_t q = cudaStreamQuery(stream());
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) MP_CUDA_CHECK(q);
      ncclResult_t async = ncclSuccess;
      MP_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess && async != ncclInProgress) {
        state_.abort_all();
        MP_FAIL("nccl {} on {}: asynchronous NCCL error {}: {}", what, describe(),
                static_cast<int>(async), ncclGetErrorString(async));
      }
      if (state_.abort_flag != nullptr && state_.abort_flag->load()) {
        state_.abort_all();
        MP_FAIL("nccl {} on {} aborted: another rank failed", what, describe());
      }
      std::this_thread::yield();
    }
  }

  NcclRankComms::State& state_;
  ncclComm_t comm_;
  Tensor scratch_;
};

// The split of `world` for the canonical dim set `bits` (every rank, in the same order; inside
// ncclGroupStart/End when one thread drives several ranks, so it returns the status instead of
// throwing out of an open group). `config` must outlive the group.
ncclResult_t split_one(NcclRankComms::State& st, const DeviceMesh& mesh, int rank, unsigned bits,
                       ncclConfig_t* config) {
  const DimSet dims = DimSet::from_bits(bits);
  st.owned.push_back(nullptr);
  return ncclCommSplit(st.world, mesh.group_color(rank, dims), mesh.group_index(rank, dims),
                       &st.owned.back(), config);
}

// The dim sets the world itself serves (every non-trivial dim): no split needed.
unsigned world_bits(const DeviceMesh& mesh) {
  return nccl_group_plan(mesh)[mesh.group_slots() - 1];
}

// The splits to make, in order (the world's own bits excluded).
std::vector<unsigned> splits_of(const DeviceMesh& mesh) {
  std::vector<unsigned> s = nccl_distinct_splits(nccl_group_plan(mesh));
  s.erase(std::remove(s.begin(), s.end(), world_bits(mesh)), s.end());
  return s;
}

ncclConfig_t shared_split_config() {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  c.splitShare = 1;  // the children use the world's channels and buffers
  return c;
}

void make_communicators(NcclRankComms::State& st, const DeviceMesh& mesh, int rank) {
  const std::vector<unsigned> plan = nccl_group_plan(mesh), splits = splits_of(mesh);
  MP_CHECK(st.owned.size() == splits.size(), "rank {}: {} NCCL splits made, {} planned", rank,
           st.owned.size(), splits.size());
  st.raw.assign(plan.size(), nullptr);
  for (unsigned bits = 0; bits < plan.size(); ++bits) {
    if (plan[bits] == world_bits(mesh)) {
      st.raw[bits] = st.world;
    } else {
      const auto at = std::find(splits.begin(), splits.end(), plan[bits]) - splits.begin();
      st.raw[bits] = st.owned.at(static_cast<size_t>(at));
    }
  }
  for (unsigned bits = 0; bits < plan.size(); ++bits) {
    const DimSet dims = DimSet::from_bits(bits);
    int index = -1;
    MP_NCCL_CHECK(ncclCommUserRank(st.raw[bits], &index));
    MP_CHECK(index == mesh.group_index(rank, dims), "ncclCommSplit gave rank {} index {}, mesh {}",
             rank, index, mesh.group_index(rank, dims));
    st.comms.push_back(std::make_unique<NcclCommunicator>(
        st, st.raw[bits], mesh.group_ranks(rank, dims), index, dims.str()));
  }
}

// One process's single-process world: every rank's communicators and the shared abort flag.
struct NcclWorld {
  std::vector<NcclRankComms> ranks;
  std::atomic<bool> abort_flag{false};
};

CommCache<NcclWorld>& single_cache() {
  static CommCache<NcclWorld> c;
  return c;
}

CommCache<NcclRankComms>& mpi_cache() {
  static CommCache<NcclRankComms> c;
  return c;
}

void teardown_at_exit() {
  try {
    nccl_teardown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshproof: NCCL teardown at exit: %s\n", e.what());
  }
}

// Registered after the first communicators exist, so it runs before the CUDA runtime's and MPI's
// own exit handlers (registered or constructed earlier: exit runs them in reverse order).
void register_teardown_at_exit() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(teardown_at_exit); });
}

}  // namespace

NcclRankComms::NcclRankComms(DeviceMesh mesh, int rank)
    : mesh_(mesh), rank_(rank), state_(std::make_unique<State>()) {}

NcclRankComms::NcclRankComms(NcclRankComms&&) noexcept = default;
NcclRankComms::~NcclRankComms() = default;

Communicator& NcclRankComms::group(DimSet dims) {
  return *state_->comms.at(mesh_.group_slot(dims));
}

void NcclRankComms::reset_stats() {
  for (auto& c : state_->comms) c->reset_stats();
}

void NcclRankComms::destroy() {
  if (!state_) return;
  const std::string error = state_->destroy();
  MP_CHECK(error.empty(), "rank {}: destroying its NCCL communicators: {}", rank_, error);
}

#if MESHPROOF_HAVE_MPI
NcclRankComms NcclRankComms::bootstrap_mpi(const DeviceMesh& mesh) {
  int initialized = 0;
  MP_MPI_CHECK(MPI_Initialized(&initialized));
  MP_CHECK(initialized, "NcclRankComms::bootstrap_mpi needs MPI to be initialised");
  int rank = 0, world = 0;
  MP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  MP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  mesh.check_world_size(world);
  const kernels::CudaStatus& cuda = kernels::cuda_status();
  MP_CHECK_INPUT(cuda.usable, "the nccl communicator needs a GPU: {}", cuda.reason);
  // Node-local rank picks the GPU.
  MPI_Comm node = MPI_COMM_NULL;
  MP_MPI_CHECK(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  int local_rank = 0, local_size = 0;
  MP_MPI_CHECK(MPI_Comm_rank(node, &local_rank));
  MP_MPI_CHECK(MPI_Comm_size(node, &local_size));
  MPI_Comm_free(&node);
  // NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") only inside
  // ncclCommInitRank; every rank of the node sees the same counts, so all of them stop here with
  // the reason instead.
  MP_CHECK_INPUT(local_size <= static_cast<int>(cuda.gpus.size()),
                 "launcher mpi: {} ranks on this node but {} GPU(s) visible; NCCL needs one GPU "
                 "per rank (use the local launcher for virtual ranks on one GPU)",
                 local_size, cuda.gpus.size());
  const int device = local_rank;

  NcclRankComms self(mesh, rank);
  self.state_->device = device;
  try {
    const int64_t free_before = free_bytes(device);
    MP_CUDA_CHECK(cudaStreamCreateWithFlags(&self.state_->stream, cudaStreamNonBlocking));
    self.context_ =
        kernels::RankContext{rank, kernels::Device::cuda(device), self.state_->stream, nullptr};
    ncclUniqueId id{};
    if (rank == 0) MP_NCCL_CHECK(ncclGetUniqueId(&id));
    MP_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD));
    MP_NCCL_CHECK(ncclCommInitRank(&self.state_->world, world, id, rank));
    ncclConfig_t config = shared_split_config();
    const std::vector<unsigned> splits = splits_of(mesh);
    self.state_->owned.reserve(splits.size());
    for (unsigned bits : splits) MP_NCCL_CHECK(split_one(*self.state_, mesh, rank, bits, &config));
    make_communicators(*self.state_, mesh, rank);
    // Other processes sharing this GPU can blur the figure; it is clamped at zero.
    self.state_->reserve = std::max<int64_t>(0, free_before - free_bytes(device));
    add_nccl_reserve(device, self.state_->reserve);
  } catch (...) {
    // Half-made communicators: abort, never finalize (finalize waits for peers that may have
    // failed too, or never got this far).
    self.state_->abort_all();
    throw;
  }
  return self;
}

NcclRankComms& nccl_comms_for_mpi(const DeviceMesh& mesh) {
  int rank = 0;
  MP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  bool created = false;
  NcclRankComms& comms = mpi_cache().get_or_create(
      NcclCommKey{mesh.str(), {rank}, {}},
      [&] { return std::make_unique<NcclRankComms>(NcclRankComms::bootstrap_mpi(mesh)); },
      &created);
  if (created) register_teardown_at_exit();
  comms.reset_stats();
  return comms;
}
#else
NcclRankComms NcclRankComms::bootstrap_mpi(const DeviceMesh&) {
  MP_FAIL_INPUT("the nccl communicator over MPI needs a build with MPI");
}

NcclRankComms& nccl_comms_for_mpi(const DeviceMesh&) {
  MP_FAIL_INPUT("the nccl communicator over MPI needs a build with MPI");
}
#endif

void discard_nccl_comms_for_mpi(const DeviceMesh& mesh) {
#if MESHPROOF_HAVE_MPI
  int rank = 0;
  if (MPI_Comm_rank(MPI_COMM_WORLD, &rank) != MPI_SUCCESS) return;
  if (std::unique_ptr<NcclRankComms> c = mpi_cache().take(NcclCommKey{mesh.str(), {rank}, {}}))
    c->abort();
#else
  (void)mesh;
#endif
}

void NcclRankComms::abort() {
  if (state_) state_->abort_all();
}

void run_nccl_single_process(const DeviceMesh& mesh,
                             const std::function<void(NcclRankComms&)>& fn) {
  const kernels::CudaStatus& cuda = kernels::cuda_status();
  MP_CHECK_INPUT(cuda.usable, "the nccl communicator needs a GPU: {}", cuda.reason);
  const int n = mesh.world_size();
  MP_CHECK_INPUT(n <= static_cast<int>(cuda.gpus.size()),
                 "mesh {} needs {} GPUs for NCCL (one rank per GPU) but {} are visible; use the "
                 "local launcher for virtual ranks on one GPU",
                 mesh.str(), n, cuda.gpus.size());
  NcclCommKey key{mesh.str(), {}, {}};
  for (int r = 0; r < n; ++r) {
    key.ranks.push_back(r);
    key.devices.push_back(r);
  }
  // Created once per process and mesh: the world (ncclCommInitAll over GPUs 0..n-1), then the
  // splits as group calls over every rank (one thread drives them all here).
  auto make = [&]() -> std::unique_ptr<NcclWorld> {
    auto w = std::make_unique<NcclWorld>();
    std::vector<int64_t> free_before(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) free_before[static_cast<size_t>(r)] = free_bytes(r);
    std::vector<ncclComm_t> worlds(static_cast<size_t>(n), nullptr);
    MP_NCCL_CHECK(ncclCommInitAll(worlds.data(), n, key.devices.data()));
    for (int r = 0; r < n; ++r) {
      NcclRankComms rc(mesh, r);
      rc.state_->world = worlds[static_cast<size_t>(r)];
      rc.state_->device = r;
      rc.state_->abort_flag = &w->abort_flag;
      w->ranks.push_back(std::move(rc));
    }
    try {
      for (int r = 0; r < n; ++r) {
        NcclRankComms& rc = w->ranks[static_cast<size_t>(r)];
        MP_CUDA_CHECK(cudaSetDevice(r));
        MP_CUDA_CHECK(cudaStreamCreateWithFlags(&rc.state_->stream, cudaStreamNonBlocking));
        rc.context_ = kernels::RankContext{r, kernels::Device::cuda(r), rc.state_->stream, nullptr};
      }
      std::vector<ncclConfig_t> configs(static_cast<size_t>(n), shared_split_config());
      const std::vector<unsigned> splits = splits_of(mesh);
      // split_one hands NCCL &owned.back(), written at ncclGroupEnd: no reallocation meanwhile.
      for (NcclRankComms& rc : w->ranks) rc.state_->owned.reserve(splits.size());
      for (unsigned bits : splits) {
        ncclResult_t status = ncclSuccess;
        MP_NCCL_CHECK(ncclGroupStart());
        for (int r = 0; r < n; ++r) {
          if (cudaSetDevice(r) != cudaSuccess) status = ncclUnhandledCudaError;
          const ncclResult_t s = split_one(*w->ranks[static_cast<size_t>(r)].state_, mesh, r, bits,
                                           &configs[static_cast<size_t>(r)]);
          if (status == ncclSuccess) status = s;
        }
        const ncclResult_t end = ncclGroupEnd();
        MP_NCCL_CHECK(status);
        MP_NCCL_CHECK(end);
      }
      for (int r = 0; r < n; ++r)
        make_communicators(*w->ranks[static_cast<size_t>(r)].state_, mesh, r);
      for (int r = 0; r < n; ++r) {
        NcclRankComms::State& st = *w->ranks[static_cast<size_t>(r)].state_;
        st.reserve = std::max<int64_t>(0, free_before[static_cast<size_t>(r)] - free_bytes(r));
        add_nccl_reserve(r, st.reserve);
      }
    } catch (...) {
      // Half-made communicators of several ranks: abort (a finalize from this one thread would
      // wait for the other ranks forever).
      for (NcclRankComms& rc : w->ranks) rc.abort();
      throw;
    }
    return w;
  };
  bool created = false;
  NcclWorld& world = single_cache().get_or_create(key, make, &created);
  if (created) register_teardown_at_exit();
  world.abort_flag.store(false);
  for (NcclRankComms& rc : world.ranks) rc.reset_stats();

  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      NcclRankComms& rc = world.ranks[static_cast<size_t>(r)];
      try {
        kernels::ScopedRankContext ctx(rc.context());
        MP_CUDA_CHECK(cudaSetDevice(r));
        fn(rc);
        kernels::synchronize_current();
      } catch (const kernels::Error& e) {
        std::lock_guard<std::mutex> lk(mu);
        if (!first) {
          first =
              std::make_exception_ptr(kernels::Error(e.kind(), e.file(), e.line(), e.expression(),
                                                     fmt::format("rank {}: {}", r, e.message())));
        }
        world.abort_flag.store(true);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(mu);
        if (!first) {
          first = std::make_exception_ptr(kernels::Error(kernels::ErrorKind::kRuntime, __FILE__,
                                                         __LINE__, "",
                                                         fmt::format("rank {}: {}", r, e.what())));
        }
        world.abort_flag.store(true);
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) {
    // The failed rank may have left its peers' operations unmatched: abort, never finalize, and
    // drop the set so the next run makes fresh communicators.
    for (NcclRankComms& rc : world.ranks) rc.abort();
    single_cache().take(key);
    std::rethrow_exception(first);
  }
}

int nccl_teardown() {
  std::vector<std::unique_ptr<NcclWorld>> worlds = single_cache().take_all();
  std::vector<std::unique_ptr<NcclRankComms>> singles = mpi_cache().take_all();
  std::vector<std::string> errors;
  // The sets one after another, the ranks of one set in parallel: each rank's finalize waits for
  // its peers' (in this process on the other threads, or in the other processes for mpi).
  for (auto& w : worlds) {
    for (std::string& e :
         destroy_in_parallel(w->ranks.size(), [&w](size_t r) { w->ranks[r].destroy(); }))
      errors.push_back(std::move(e));
  }
  for (auto& rc : singles) {
    for (std::string& e : destroy_in_parallel(1, [&rc](size_t) { rc->destroy(); }))
      errors.push_back(std::move(e));
  }
  const int sets = static_cast<int>(worlds.size() + singles.size());
  MP_CHECK(errors.empty(), "NCCL teardown: {}", fmt::join(errors, "; "));
  return sets;
}

int64_t nccl_comm_sets_created() { return single_cache().creations() + mpi_cache().creations(); }
size_t nccl_comm_sets_cached() { return single_cache().size() + mpi_cache().size(); }

// ---- point-to-point ----------------------------------------------------------------------------
namespace {

// Raw bytes (ncclUint8), so any byte-sized dtype travels bit for bit; NCCL matches sends and
// receives by order per peer and cannot check the receiver's dtype or size (the pipeline sizes
// both ends from the same shapes). Blocking like the collectives: the stream is waited on.
void NcclCommunicator::do_send(const Tensor& buffer, int peer) {
  check_device(buffer, "send");
  MP_NCCL_CHECK(ncclSend(buffer.raw_data(), static_cast<size_t>(buffer.nbytes().value), ncclUint8,
                         peer, comm_, stream()));
  wait("send");
}

void NcclCommunicator::do_recv(Tensor& buffer, int peer) {
  check_device(buffer, "recv");
  MP_NCCL_CHECK(ncclRecv(buffer.raw_data(), static_cast<size_t>(buffer.nbytes().value), ncclUint8,
                         peer, comm_, stream()));
  wait("recv");
}

}  // namespace

#else  // !MESHPROOF_HAVE_CUDA

struct NcclRankComms::State {};

NcclRankComms::NcclRankComms(DeviceMesh mesh, int rank) : mesh_(mesh), rank_(rank) {}
NcclRankComms::NcclRankComms(NcclRankComms&&) noexcept = default;
NcclRankComms::~NcclRankComms() = default;

NcclRankComms NcclRankComms::bootstrap_mpi(const DeviceMesh&) {
  MP_FAIL_INPUT("the nccl communicator is not available: meshproof was built without CUDA");
}

Communicator& NcclRankComms::group(DimSet) {
  MP_FAIL_INPUT("the nccl communicator is not available: meshproof was built without CUDA");
}

void NcclRankComms::reset_stats() {}
void NcclRankComms::destroy() {}
void NcclRankComms::abort() {}

void run_nccl_single_process(const DeviceMesh&, const std::function<void(NcclRankComms&)>&) {
  MP_FAIL_INPUT("the nccl communicator is not available: meshproof was built without CUDA");
}

NcclRankComms& nccl_comms_for_mpi(const DeviceMesh&) {
  MP_FAIL_INPUT("the nccl communicator is not available: meshproof was built without CUDA");
}

void discard_nccl_comms_for_mpi(const DeviceMesh&) {}
int nccl_teardown() { return 0; }
int64_t nccl_comm_sets_created() { return 0; }
size_t nccl_comm_sets_cached() { return 0; }

#endif

}  // namespace meshproof::mesh
