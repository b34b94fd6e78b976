// Collectives over a group of ranks, on typed buffers (kernels::Tensor: dtype, element count and
// device travel with the buffer; no raw byte counts in the API). Three backends implement it:
// `local` (virtual ranks as threads of one process, mesh/local/local_comm.h), `mpi` (one process
// per rank, CPU buffers, mesh/mpi/mpi_comm.h) and `nccl` (GPU buffers, mesh/nccl/nccl_comm.h).
//
// Deterministic reductions (docs/design.md section 2): local and mpi reduce fp32 in rank order with
// fp32 accumulation, acc = x_0; acc += x_1; ...; acc += x_{n-1}, so their results are bitwise
// equal. avg is that sum divided by n (acc / float(n), one correctly rounded division; not a
// multiplication by 1/n). max propagates NaN. NCCL uses its own reduction order.
//
// Every collective is blocking: when it returns, the output is complete and the input may be
// reused (device backends synchronise the rank's stream). Each communicator counts calls, bytes
// and wall time per collective kind; bytes follow nccl-tests' "size": all_gather counts the
// gathered output, reduce_scatter the full input, all_reduce and broadcast the buffer, send and
// recv the message.
//
// Point-to-point send/recv (pipeline stages, docs/design.md "Pipeline parallelism") moves the
// bytes of one member's buffer into another's, bit for bit, on every backend. Messages between
// one ordered pair of members arrive in the order they were sent; the two ends agree on dtype
// and element count (local and mpi check it and fail naming both; nccl cannot tell).
#pragma once

#include <array>
#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/core/tensor.h"
#include "kernels/core/units.h"
#include "mesh/core/device_mesh.h"

namespace meshproof::mesh {

class CollectiveRecorder;

enum class ReduceOp : uint8_t { kSum, kAvg, kMax };
enum class CollectiveKind : uint8_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kBarrier,
  kAllToAll,  // all_to_all_v (MoE expert parallelism)
  kSend,      // point-to-point (not collectives, counted alike)
  kRecv
};
inline constexpr int kNumCollectiveKinds = 8;

std::string_view reduce_op_name(ReduceOp op);        // "sum", "avg", "max"
std::string_view collective_name(CollectiveKind k);  // "all_gather", ...
// nccl-tests: busbw = algbw * factor; all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n,
// broadcast 1, barrier 0, all_to_all (n-1)/n, send and recv 1.
double bus_bandwidth_factor(CollectiveKind k, int n);

struct CollectiveStats {
  int64_t count = 0;
  kernels::Bytes bytes;  // summed nccl-tests sizes
  double seconds = 0.0;  // summed wall time of the calls
};

class Communicator {
 public:
  // `ranks`: the group's global ranks in group order; `index`: this rank's position in it.
  Communicator(std::vector<int> ranks, int index, std::string label);
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return index_; }  // index inside the group
  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int>& ranks() const { return ranks_; }
  const std::string& label() const { return label_; }  // e.g. "dp_shard"
  std::string describe() const;                        // "dp_shard group [0, 2, 4, 6]"
  virtual std::string_view backend() const = 0;        // "local", "mpi", "nccl"

  // output[s * input.numel() + k] = input_of_member_s[k]. Any byte-sized dtype; output has
  // size() * input.numel() elements. The input may be the member's own slice of the output.
  void all_gather(const kernels::Tensor& input, kernels::Tensor& output);
  // fp32: output[k] = reduce_s input_of_member_s[rank() * output.numel() + k]; input has
  // size() * output.numel() elements. op is kSum or kAvg.
  void reduce_scatter(const kernels::Tensor& input, kernels::Tensor& output, ReduceOp op);
  // fp32, in place: buffer = reduce over members of buffer.
  void all_reduce(kernels::Tensor& buffer, ReduceOp op);
  // Any byte-sized dtype: every member's buffer becomes member `root`'s buffer.
  void broadcast(kernels::Tensor& buffer, int root);
  void barrier();
  // Point-to-point: `peer` is the member index inside this group (not this member). send
  // returns when `buffer` may be reused (local: copied out; mpi: delivered or buffered by MPI;
  // nccl: the stream waited on), recv when the bytes are in `buffer`. Any byte-sized dtype.
  // local and nccl buffer a send without a matching recv posted; under mpi a large send may wait
  // for its recv (MPI's rendezvous protocol), so a schedule must not send in a cycle without
  // receives in between. Waits are bounded by the collective watchdog (collective_timeout()).
  void send(const kernels::Tensor& buffer, int peer);
  void recv(kernels::Tensor& buffer, int peer);

  // Personalised exchange (MPI_Alltoallv; NCCL: grouped ncclSend/ncclRecv). Any byte-sized
  // dtype, counts in elements, one per member in group order: `input` holds send_counts[0]
  // elements for member 0, then send_counts[1] for member 1, ...; `output` receives
  // recv_counts[s] elements from member s, in member order. recv_counts[s] must equal member s's
  // send_counts[rank()] (the caller exchanges counts first, e.g. by an all_to_all_v of int64
  // counts with every count 1); a zero count sends nothing. Input and output must not overlap.
  // Bytes counted: the input's (what this member sends, nccl-tests' alltoall "size").
  void all_to_all_v(const kernels::Tensor& input, const std::vector<int64_t>& send_counts,
                    kernels::Tensor& output, const std::vector<int64_t>& recv_counts);

  const CollectiveStats& stats(CollectiveKind k) const { return stats_[static_cast<size_t>(k)]; }
  void reset_stats() { stats_ = {}; }
  // Every later collective is also recorded by `r` while it records
  // (mesh/core/collective_recorder.h); nullptr stops it. The recorder must outlive its attachment.
  void set_recorder(CollectiveRecorder* r) { recorder_ = r; }

 protected:
  virtual void do_all_gather(const kernels::Tensor& input, kernels::Tensor& output) = 0;
  virtual void do_reduce_scatter(const kernels::Tensor& input, kernels::Tensor& output,
                                 ReduceOp op) = 0;
  virtual void do_all_reduce(kernels::Tensor& buffer, ReduceOp op) = 0;
  virtual void do_broadcast(kernels::Tensor& buffer, int root) = 0;
  virtual void do_barrier() = 0;
  // Counts checked by all_to_all_v: sizes match the group, sums match the tensors.
  virtual void do_all_to_all_v(const kernels::Tensor& input,
                               const std::vector<int64_t>& send_counts, kernels::Tensor& output,
                               const std::vector<int64_t>& recv_counts) = 0;
  virtual void do_send(const kernels::Tensor& buffer, int peer) = 0;
  virtual void do_recv(kernels::Tensor& buffer, int peer) = 0;

 private:
  void account(CollectiveKind k, kernels::Bytes bytes, double seconds, ReduceOp op,
               kernels::DType dtype);

  std::vector<int> ranks_;
  int index_;
  std::string label_;
  std::array<CollectiveStats, kNumCollectiveKinds> stats_{};
  CollectiveRecorder* recorder_ = nullptr;
};

// The collective watchdog of the local and mpi launchers: how long a member waits for the others
// in one collective before the run fails (local: a kRuntime error; mpi: the whole job aborts)
// with the collective, the group and the ranks that never arrived. MESHPROOF_COLLECTIVE_TIMEOUT
// (seconds, a positive number, fractions allowed) when set, else kDefaultCollectiveTimeout:
// generous, because a slow rank (a checkpoint save, a report write) is not a stalled one. A
// malformed value is a kInput error naming the variable.
inline constexpr std::chrono::seconds kDefaultCollectiveTimeout{300};
inline constexpr const char* kCollectiveTimeoutEnv = "MESHPROOF_COLLECTIVE_TIMEOUT";
std::chrono::milliseconds collective_timeout();

// One rank's view of the communicators of every mesh group (backend-agnostic): engine code asks
// for `group({MeshDim::kDpShard})` and runs the same on every launcher.
class RankComms {
 public:
  virtual ~RankComms() = default;
  virtual int rank() const = 0;  // global rank
  virtual const DeviceMesh& mesh() const = 0;
  // The communicator of this rank's group spanning `dims` (empty set: a group of one).
  virtual Communicator& group(DimSet dims) = 0;
};

// Reduces n fp32 inputs of `count` elements into `out` in rank order (see the top of this file);
// `out` may alias an input. The host reference that local and mpi share.
void reduce_rank_order_host(float* out, const float* const* inputs, int n, int64_t count,
                            ReduceOp op);
#if MESHPROOF_HAVE_CUDA
// The same on device memory, on `stream` (cudaStream_t): per element the same sequence of fp32
// operations as the host version, so results are bitwise equal. n <= kMaxDeviceReduceInputs.
inline constexpr int kMaxDeviceReduceInputs = 64;  // == detail::kMaxReduceInputs
void reduce_rank_order_device(float* out, const float* const* inputs, int n, int64_t count,
                              ReduceOp op, void* stream);
#endif

}  // namespace meshproof::mesh
