#include "mesh/mpi/split_comm.h"

#include <fmt/format.h>

#include "kernels/core/error.h"

namespace meshproof::mesh {

using kernels::Tensor;

SplitComm::SplitComm(Communicator& host, Communicator& device)
    : Communicator(host.ranks(), host.rank(), host.label()),
      host_(host),
      device_(device),
      backend_(fmt::format("{}+{}", host.backend(), device.backend())) {
  MP_CHECK(host.ranks() == device.ranks() && host.rank() == device.rank(),
           "split communicator: host {} and device {} span different groups", host.describe(),
           device.describe());
}

void SplitComm::do_all_gather(const Tensor& input, Tensor& output) {
  pick(input).all_gather(input, output);
}

void SplitComm::do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) {
  pick(input).reduce_scatter(input, output, op);
}

void SplitComm::do_all_reduce(Tensor& buffer, ReduceOp op) { pick(buffer).all_reduce(buffer, op); }

void SplitComm::do_broadcast(Tensor& buffer, int root) { pick(buffer).broadcast(buffer, root); }

void SplitComm::do_barrier() { host_.barrier(); }

void SplitComm::do_all_to_all_v(const Tensor& input, const std::vector<int64_t>& send_counts,
                                Tensor& output, const std::vector<int64_t>& recv_counts) {
  pick(input).all_to_all_v(input, send_counts, output, recv_counts);
}

// Both ends pick by their own buffer's device: a pipeline sends host buffers over MPI and device
// buffers over NCCL, the same on both ends.
void SplitComm::do_send(const Tensor& buffer, int peer) { pick(buffer).send(buffer, peer); }

void SplitComm::do_recv(Tensor& buffer, int peer) { pick(buffer).recv(buffer, peer); }

SplitRankComms::SplitRankComms(RankComms& host, RankComms& device) : host_(host), device_(device) {
  MP_CHECK(host.rank() == device.rank() && host.mesh() == device.mesh(),
           "split rank communicators: host rank {} on {} vs device rank {} on {}", host.rank(),
           host.mesh().str(), device.rank(), device.mesh().str());
}

Communicator& SplitRankComms::group(DimSet dims) {
  auto it = groups_.find(dims.bits());
  if (it == groups_.end())
    it = groups_
             .emplace(dims.bits(),
                      std::make_unique<SplitComm>(host_.group(dims), device_.group(dims)))
             .first;
  return *it->second;
}

}  // namespace meshproof::mesh
