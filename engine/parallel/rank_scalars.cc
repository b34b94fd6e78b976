#include "engine/parallel/rank_scalars.h"

#include "kernels/core/tensor.h"

namespace meshproof::engine {

using kernels::Tensor;

double sum_doubles(mesh::Communicator& comm, double v) {
  if (comm.size() == 1) return v;
  Tensor send = Tensor::from_vector<double>({1}, {v});
  Tensor recv = Tensor::empty({comm.size()}, kernels::DType::kFloat64, kernels::Device::cpu());
  comm.all_gather(send, recv);
  double s = 0;
  for (int i = 0; i < comm.size(); ++i) s += recv.data<double>()[i];
  return s;
}

std::vector<double> gather_doubles(mesh::Communicator& comm, const std::vector<double>& v) {
  if (comm.size() == 1) return v;
  const int64_t n = static_cast<int64_t>(v.size());
  Tensor send = Tensor::from_vector<double>({n}, v);
  Tensor recv = Tensor::empty({comm.size() * n}, kernels::DType::kFloat64, kernels::Device::cpu());
  comm.all_gather(send, recv);
  return recv.to_vector<double>();
}

}  // namespace meshproof::engine
