#include "mesh/mpi_comm.h"

#include <algorithm>
#include <climits>
#include <vector>

#include "kernels/error.h"
#include "kernels/tensor.h"
#include "mesh/nccl_check.h"

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

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::vector<int> ranks, int index, std::string label)
      : Communicator(std::move(ranks), index, std::move(label)), comm_(comm) {}
  ~MpiCommunicator() override {
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
    MP_MPI_CHECK(MPI_Allgather(in, bytes, MPI_BYTE, out, bytes, MPI_BYTE, comm_));
  }

  void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    check_host(input, "reduce_scatter");
    const int64_t count = output.numel().value;
    // recv[s] = chunk rank() of member s's input; then reduce in rank order.
    std::vector<float> recv(static_cast<size_t>(count * size()));
    const int bytes = checked_int(count * 4, "reduce_scatter");
    MP_MPI_CHECK(
        MPI_Alltoall(input.raw_data(), bytes, MPI_BYTE, recv.data(), bytes, MPI_BYTE, comm_));
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
    MP_MPI_CHECK(MPI_Alltoall(send.data(), bytes, MPI_BYTE, recv.data(), bytes, MPI_BYTE, comm_));
    std::vector<float> mine(static_cast<size_t>(chunk));
    reduce_from(recv, mine.data(), chunk, op);
    MP_MPI_CHECK(MPI_Allgather(mine.data(), bytes, MPI_BYTE, send.data(), bytes, MPI_BYTE, comm_));
    std::copy_n(send.begin(), count, buffer.data<float>());
  }

  void do_broadcast(Tensor& buffer, int root) override {
    check_host(buffer, "broadcast");
    MP_MPI_CHECK(MPI_Bcast(buffer.raw_data(), checked_int(buffer.nbytes().value, "broadcast"),
                           MPI_BYTE, root, comm_));
  }

  void do_barrier() override { MP_MPI_CHECK(MPI_Barrier(comm_)); }

 private:
  void reduce_from(const std::vector<float>& recv, float* out, int64_t count, ReduceOp op) {
    std::vector<const float*> ins(static_cast<size_t>(size()));
    for (int s = 0; s < size(); ++s) ins[static_cast<size_t>(s)] = recv.data() + s * count;
    reduce_rank_order_host(out, ins.data(), size(), count, op);
  }

  MPI_Comm comm_;
};

}  // namespace

MpiRankComms::MpiRankComms(DeviceMesh mesh) : mesh_(mesh) {
  int initialized = 0;
  MP_MPI_CHECK(MPI_Initialized(&initialized));
  MP_CHECK(initialized, "MpiRankComms needs MPI to be initialised (create an MpiSession first)");
  int world = 0;
  MP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  MP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  mesh_.check_world_size(world);
  // Every group of every dim set, split in the same order on every process.
  for (unsigned bits = 0; bits < (1u << kNumMeshDims); ++bits) {
    const DimSet dims = DimSet::from_bits(bits);
    MPI_Comm comm = MPI_COMM_NULL;
    MP_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, mesh_.group_color(rank_, dims),
                                mesh_.group_index(rank_, dims), &comm));
    int index = -1;
    MP_MPI_CHECK(MPI_Comm_rank(comm, &index));
    MP_CHECK(index == mesh_.group_index(rank_, dims),
             "MPI_Comm_split gave rank {} index {}, mesh {}", rank_, index,
             mesh_.group_index(rank_, dims));
    comms_.push_back(
        std::make_unique<MpiCommunicator>(comm, mesh_.group_ranks(rank_, dims), index, dims.str()));
  }
}

MpiRankComms::~MpiRankComms() = default;

Communicator& MpiRankComms::group(DimSet dims) { return *comms_.at(dims.bits()); }

#else  // !MESHPROOF_HAVE_MPI

MpiSession::MpiSession(int*, char***) {
  MP_FAIL_INPUT("the mpi launcher is not available: meshproof was built without MPI");
}
MpiSession::~MpiSession() = default;

MpiRankComms::MpiRankComms(DeviceMesh mesh) : mesh_(mesh) {
  MP_FAIL_INPUT("the mpi launcher is not available: meshproof was built without MPI");
}
MpiRankComms::~MpiRankComms() = default;
Communicator& MpiRankComms::group(DimSet) {
  MP_FAIL_INPUT("the mpi launcher is not available: meshproof was built without MPI");
}

#endif

}  // namespace meshproof::mesh
