// The mpi launcher with a CUDA compute device (docs/design.md section 2: "CPU tensors use MPI
// collectives; CUDA tensors use NCCL"): one communicator per mesh group that sends host buffers
// through the rank's host communicator (MPI) and device buffers through its device communicator
// (NCCL). On the CUDA backend the engine's state and collectives are on the device (NCCL);
// host scalars (loss and grad-norm sums, checkpoint agreement) still go over MPI, so one rank
// needs both.
#pragma once

#include <map>
#include <memory>

#include "mesh/core/communicator.h"

namespace meshproof::mesh {

class SplitComm final : public Communicator {
 public:
  // `host` and `device` must span the same group (same ranks, same index).
  SplitComm(Communicator& host, Communicator& device);
  std::string_view backend() const override { return backend_; }

 protected:
  void do_all_gather(const kernels::Tensor& input, kernels::Tensor& output) override;
  void do_reduce_scatter(const kernels::Tensor& input, kernels::Tensor& output,
                         ReduceOp op) override;
  void do_all_reduce(kernels::Tensor& buffer, ReduceOp op) override;
  void do_broadcast(kernels::Tensor& buffer, int root) override;
  void do_barrier() override;
  void do_all_to_all_v(const kernels::Tensor& input, const std::vector<int64_t>& send_counts,
                       kernels::Tensor& output, const std::vector<int64_t>& recv_counts) override;
  void do_send(const kernels::Tensor& buffer, int peer) override;
  void do_recv(kernels::Tensor& buffer, int peer) override;

 private:
  // The communicator for a buffer on `t`'s device.
  Communicator& pick(const kernels::Tensor& t) { return t.device().is_cpu() ? host_ : device_; }

  Communicator& host_;
  Communicator& device_;
  std::string backend_;  // "mpi+nccl"
};

// One rank's groups over two RankComms of the same mesh and rank (e.g. MpiRankComms and
// NcclRankComms::bootstrap_mpi); both must outlive it.
class SplitRankComms final : public RankComms {
 public:
  SplitRankComms(RankComms& host, RankComms& device);
  int rank() const override { return host_.rank(); }
  const DeviceMesh& mesh() const override { return host_.mesh(); }
  Communicator& group(DimSet dims) override;

 private:
  RankComms& host_;
  RankComms& device_;
  std::map<unsigned, std::unique_ptr<SplitComm>> groups_;  // by DimSet bits
};

}  // namespace meshproof::mesh
