#include "mesh/nccl_comm.h"

#include <fmt/format.h>

#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>

#include "kernels/cuda_check.h"
#include "kernels/device.h"
#include "kernels/error.h"
#include "kernels/tensor.h"
#include "mesh/nccl_check.h"

namespace meshproof::mesh {

#if MESHPROOF_HAVE_CUDA

using kernels::Tensor;

struct NcclRankComms::State {
  ncclComm_t world = nullptr;
  std::vector<ncclComm_t> raw;                       // per DimSet bits
  std::vector<std::unique_ptr<Communicator>> comms;  // per DimSet bits
  cudaStream_t stream = nullptr;
  const std::atomic<bool>* abort_flag = nullptr;  // single-process runs only
  bool aborted = false;

  void abort_all() {
    if (aborted) return;
    aborted = true;
    for (ncclComm_t c : raw) {
      if (c != nullptr) ncclCommAbort(c);
    }
    if (world != nullptr) ncclCommAbort(world);
    raw.assign(raw.size(), nullptr);
    world = nullptr;
  }

  ~State() {
    // Communicators first: their scratch buffers are freed on `stream`, which must still exist.
    comms.clear();
    if (stream != nullptr) cudaStreamSynchronize(stream);
    if (!aborted) {
      for (ncclComm_t c : raw) {
        if (c != nullptr) ncclCommDestroy(c);
      }
      if (world != nullptr) ncclCommDestroy(world);
    }
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
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
      scratch_ = Tensor::zeros(kernels::Shape{1}, kernels::DType::kFloat32,
                               kernels::current_context().device);
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

// Splits `world` into one communicator per slot (DeviceMesh::group_slots: the dim sets, pp's only
// with pp > 1); must be called by every rank (inside ncclGroupStart/End when one thread drives
// several ranks).
void split_groups(NcclRankComms::State& st, const DeviceMesh& mesh, int rank, unsigned bits) {
  const DimSet dims = DimSet::from_bits(bits);
  MP_NCCL_CHECK(ncclCommSplit(st.world, mesh.group_color(rank, dims), mesh.group_index(rank, dims),
                              &st.raw[bits], nullptr));
}

void make_communicators(NcclRankComms::State& st, const DeviceMesh& mesh, int rank) {
  for (unsigned bits = 0; bits < mesh.group_slots(); ++bits) {
    const DimSet dims = DimSet::from_bits(bits);
    int index = -1;
    MP_NCCL_CHECK(ncclCommUserRank(st.raw[bits], &index));
    MP_CHECK(index == mesh.group_index(rank, dims), "ncclCommSplit gave rank {} index {}, mesh {}",
             rank, index, mesh.group_index(rank, dims));
    st.comms.push_back(std::make_unique<NcclCommunicator>(
        st, st.raw[bits], mesh.group_ranks(rank, dims), index, dims.str()));
  }
}

}  // namespace

NcclRankComms::NcclRankComms(DeviceMesh mesh, int rank)
    : mesh_(mesh), rank_(rank), state_(std::make_unique<State>()) {
  state_->raw.assign(mesh_.group_slots(), nullptr);
}

NcclRankComms::NcclRankComms(NcclRankComms&&) noexcept = default;
NcclRankComms::~NcclRankComms() = default;

Communicator& NcclRankComms::group(DimSet dims) {
  return *state_->comms.at(mesh_.group_slot(dims));
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
  int local_rank = 0;
  MP_MPI_CHECK(MPI_Comm_rank(node, &local_rank));
  MPI_Comm_free(&node);
  const int device = local_rank % static_cast<int>(cuda.gpus.size());

  NcclRankComms self(mesh, rank);
  MP_CUDA_CHECK(cudaSetDevice(device));
  MP_CUDA_CHECK(cudaStreamCreateWithFlags(&self.state_->stream, cudaStreamNonBlocking));
  self.context_ =
      kernels::RankContext{rank, kernels::Device::cuda(device), self.state_->stream, nullptr};
  ncclUniqueId id;
  if (rank == 0) MP_NCCL_CHECK(ncclGetUniqueId(&id));
  MP_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD));
  MP_NCCL_CHECK(ncclCommInitRank(&self.state_->world, world, id, rank));
  for (unsigned bits = 0; bits < mesh.group_slots(); ++bits) {
    split_groups(*self.state_, mesh, rank, bits);
  }
  make_communicators(*self.state_, mesh, rank);
  return self;
}
#else
NcclRankComms NcclRankComms::bootstrap_mpi(const DeviceMesh&) {
  MP_FAIL_INPUT("the nccl communicator over MPI needs a build with MPI");
}
#endif

void run_nccl_single_process(const DeviceMesh& mesh,
                             const std::function<void(NcclRankComms&)>& fn) {
  const kernels::CudaStatus& cuda = kernels::cuda_status();
  MP_CHECK_INPUT(cuda.usable, "the nccl communicator needs a GPU: {}", cuda.reason);
  const int n = mesh.world_size();
  MP_CHECK_INPUT(n <= static_cast<int>(cuda.gpus.size()),
                 "mesh {} needs {} GPUs for NCCL (one rank per GPU) but {} are visible; use the "
                 "local launcher for virtual ranks on one GPU",
                 mesh.str(), n, cuda.gpus.size());
  std::atomic<bool> abort_flag{false};
  std::vector<NcclRankComms> ranks;
  std::vector<ncclComm_t> worlds(static_cast<size_t>(n), nullptr);
  std::vector<int> devs(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) devs[static_cast<size_t>(r)] = r;
  MP_NCCL_CHECK(ncclCommInitAll(worlds.data(), n, devs.data()));
  for (int r = 0; r < n; ++r) {
    NcclRankComms rc(mesh, r);
    rc.state_->world = worlds[static_cast<size_t>(r)];
    rc.state_->abort_flag = &abort_flag;
    MP_CUDA_CHECK(cudaSetDevice(r));
    MP_CUDA_CHECK(cudaStreamCreateWithFlags(&rc.state_->stream, cudaStreamNonBlocking));
    rc.context_ = kernels::RankContext{r, kernels::Device::cuda(r), rc.state_->stream, nullptr};
    ranks.push_back(std::move(rc));
  }
  // One thread drives every rank here, so each split is a group call over all ranks.
  for (unsigned bits = 0; bits < mesh.group_slots(); ++bits) {
    MP_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < n; ++r) {
      MP_CUDA_CHECK(cudaSetDevice(r));
      split_groups(*ranks[static_cast<size_t>(r)].state_, mesh, r, bits);
    }
    MP_NCCL_CHECK(ncclGroupEnd());
  }
  for (int r = 0; r < n; ++r) make_communicators(*ranks[static_cast<size_t>(r)].state_, mesh, r);

  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      NcclRankComms& rc = ranks[static_cast<size_t>(r)];
      try {
        kernels::ScopedRankContext ctx(rc.context());
        fn(rc);
        kernels::synchronize_current();
      } catch (const kernels::Error& e) {
        std::lock_guard<std::mutex> lk(mu);
        if (!first) {
          first =
              std::make_exception_ptr(kernels::Error(e.kind(), e.file(), e.line(), e.expression(),
                                                     fmt::format("rank {}: {}", r, e.message())));
        }
        abort_flag.store(true);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(mu);
        if (!first) {
          first = std::make_exception_ptr(kernels::Error(kernels::ErrorKind::kRuntime, __FILE__,
                                                         __LINE__, "",
                                                         fmt::format("rank {}: {}", r, e.what())));
        }
        abort_flag.store(true);
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) {
    // The failed rank may have left its peers' operations unmatched: abort, never destroy.
    for (NcclRankComms& rc : ranks) rc.state_->abort_all();
    std::rethrow_exception(first);
  }
}

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

void run_nccl_single_process(const DeviceMesh&, const std::function<void(NcclRankComms&)>&) {
  MP_FAIL_INPUT("the nccl communicator is not available: meshproof was built without CUDA");
}

#endif

}  // namespace meshproof::mesh
