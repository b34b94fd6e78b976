#include "mesh/core/communicator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>

#include "kernels/core/cuda_check.h"
#include "kernels/core/error.h"
#include "mesh/core/collective_recorder.h"
#include "mesh/core/reduce_kernel.h"

namespace meshproof::mesh {

using kernels::DType;
using kernels::Tensor;

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

std::string_view collective_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kBarrier:
      return "barrier";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
    case CollectiveKind::kSend:
      return "send";
    case CollectiveKind::kRecv:
      return "recv";
  }
  return "?";
}

double bus_bandwidth_factor(CollectiveKind k, int n) {
  switch (k) {
    case CollectiveKind::kAllReduce:
      return 2.0 * (n - 1) / n;
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
      return static_cast<double>(n - 1) / n;
    case CollectiveKind::kBroadcast:
      return 1.0;
    case CollectiveKind::kBarrier:
      return 0.0;
    case CollectiveKind::kAllToAll:
      return static_cast<double>(n - 1) / n;
    case CollectiveKind::kSend:
    case CollectiveKind::kRecv:
      return 1.0;
  }
  return 0.0;
}

Communicator::Communicator(std::vector<int> ranks, int index, std::string label)
    : ranks_(std::move(ranks)), index_(index), label_(std::move(label)) {
  MP_CHECK(0 <= index_ && index_ < size(), "communicator index {} outside group of {}", index_,
           size());
}

std::chrono::milliseconds collective_timeout() {
  const char* v = std::getenv(kCollectiveTimeoutEnv);
  if (v == nullptr || *v == '\0') return kDefaultCollectiveTimeout;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  MP_CHECK_INPUT(end != v && *end == '\0' && std::isfinite(s) && s > 0 && s < 1e9,
                 "{}={}: expected a positive number of seconds", kCollectiveTimeoutEnv, v);
  return std::chrono::milliseconds(std::max<int64_t>(1, std::llround(s * 1000.0)));
}

std::string Communicator::describe() const {
  return fmt::format("{} group [{}]", label_, fmt::join(ranks_, ", "));
}

void Communicator::account(CollectiveKind k, kernels::Bytes bytes, double seconds, ReduceOp op,
                           DType dtype) {
  CollectiveStats& s = stats_[static_cast<size_t>(k)];
  s.count += 1;
  s.bytes += bytes;
  s.seconds += seconds;
  if (recorder_ != nullptr && recorder_->recording())
    recorder_->record(k, op, *this, dtype, bytes.value);
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void check_byte_sized(const Tensor& t, std::string_view what, const Communicator& c) {
  MP_CHECK_INPUT(t.defined(), "{} on {}: undefined tensor", what, c.describe());
  MP_CHECK_INPUT(kernels::dtype_bits(t.dtype()) % 8 == 0,
                 "{} on {}: {} has a sub-byte dtype; gather its packed bytes as uint8", what,
                 c.describe(), t.describe());
}

void check_fp32(const Tensor& t, std::string_view what, const Communicator& c) {
  MP_CHECK_INPUT(t.defined() && t.dtype() == DType::kFloat32,
                 "{} on {}: {} must be float32 (reductions accumulate in fp32)", what, c.describe(),
                 t.describe());
}

// send and recv: a byte-sized buffer and a peer that is another member of the group.
void check_point_to_point(const Tensor& buffer, int peer, const char* what, const Communicator& c) {
  check_byte_sized(buffer, what, c);
  MP_CHECK_INPUT(0 <= peer && peer < c.size() && peer != c.rank(),
                 "{} on {}: peer {} is not another member of the group (this member is {})", what,
                 c.describe(), peer, c.rank());
}

}  // namespace

void Communicator::all_gather(const Tensor& input, Tensor& output) {
  check_byte_sized(input, "all_gather", *this);
  check_byte_sized(output, "all_gather", *this);
  MP_CHECK_INPUT(input.dtype() == output.dtype() && input.device() == output.device() &&
                     output.numel().value == input.numel().value * size(),
                 "all_gather on {}: output {} must hold {} x input {}", describe(),
                 output.describe(), size(), input.describe());
  const auto t0 = std::chrono::steady_clock::now();
  do_all_gather(input, output);
  account(CollectiveKind::kAllGather, output.nbytes(), seconds_since(t0), ReduceOp::kSum,
          input.dtype());
}

void Communicator::reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) {
  check_fp32(input, "reduce_scatter", *this);
  check_fp32(output, "reduce_scatter", *this);
  MP_CHECK_INPUT(op == ReduceOp::kSum || op == ReduceOp::kAvg,
                 "reduce_scatter on {}: op {} not supported (sum or avg)", describe(),
                 reduce_op_name(op));
  MP_CHECK_INPUT(
      input.device() == output.device() && input.numel().value == output.numel().value * size(),
      "reduce_scatter on {}: input {} must hold {} x output {}", describe(), input.describe(),
      size(), output.describe());
  const auto t0 = std::chrono::steady_clock::now();
  do_reduce_scatter(input, output, op);
  account(CollectiveKind::kReduceScatter, input.nbytes(), seconds_since(t0), op, input.dtype());
}

void Communicator::all_reduce(Tensor& buffer, ReduceOp op) {
  check_fp32(buffer, "all_reduce", *this);
  const auto t0 = std::chrono::steady_clock::now();
  do_all_reduce(buffer, op);
  account(CollectiveKind::kAllReduce, buffer.nbytes(), seconds_since(t0), op, buffer.dtype());
}

void Communicator::broadcast(Tensor& buffer, int root) {
  check_byte_sized(buffer, "broadcast", *this);
  MP_CHECK_INPUT(0 <= root && root < size(), "broadcast on {}: root {} outside the group",
                 describe(), root);
  const auto t0 = std::chrono::steady_clock::now();
  do_broadcast(buffer, root);
  account(CollectiveKind::kBroadcast, buffer.nbytes(), seconds_since(t0), ReduceOp::kSum,
          buffer.dtype());
}

void Communicator::barrier() {
  const auto t0 = std::chrono::steady_clock::now();
  do_barrier();
  account(CollectiveKind::kBarrier, kernels::Bytes(0), seconds_since(t0), ReduceOp::kSum,
          DType::kUInt8);
}

void Communicator::all_to_all_v(const Tensor& input, const std::vector<int64_t>& send_counts,
                                Tensor& output, const std::vector<int64_t>& recv_counts) {
  check_byte_sized(input, "all_to_all_v", *this);
  check_byte_sized(output, "all_to_all_v", *this);
  MP_CHECK_INPUT(input.dtype() == output.dtype() && input.device() == output.device(),
                 "all_to_all_v on {}: input {} and output {} differ in dtype or device", describe(),
                 input.describe(), output.describe());
  const auto n = static_cast<size_t>(size());
  MP_CHECK_INPUT(send_counts.size() == n && recv_counts.size() == n,
                 "all_to_all_v on {}: {} send and {} receive counts for {} members", describe(),
                 send_counts.size(), recv_counts.size(), n);
  int64_t sent = 0, received = 0;
  for (size_t s = 0; s < n; ++s) {
    MP_CHECK_INPUT(send_counts[s] >= 0 && recv_counts[s] >= 0,
                   "all_to_all_v on {}: negative count for member {} (send {}, receive {})",
                   describe(), s, send_counts[s], recv_counts[s]);
    sent += send_counts[s];
    received += recv_counts[s];
  }
  MP_CHECK_INPUT(sent == input.numel().value && received == output.numel().value,
                 "all_to_all_v on {}: send counts sum to {} for input {}, receive counts to {} "
                 "for output {}",
                 describe(), sent, input.describe(), received, output.describe());
  const auto t0 = std::chrono::steady_clock::now();
  do_all_to_all_v(input, send_counts, output, recv_counts);
  account(CollectiveKind::kAllToAll, input.nbytes(), seconds_since(t0), ReduceOp::kSum,
          input.dtype());
}

void Communicator::send(const Tensor& buffer, int peer) {
  check_point_to_point(buffer, peer, "send", *this);
  const auto t0 = std::chrono::steady_clock::now();
  do_send(buffer, peer);
  account(CollectiveKind::kSend, buffer.nbytes(), seconds_since(t0), ReduceOp::kSum,
          buffer.dtype());
}

void Communicator::recv(Tensor& buffer, int peer) {
  check_point_to_point(buffer, peer, "recv", *this);
  const auto t0 = std::chrono::steady_clock::now();
  do_recv(buffer, peer);
  account(CollectiveKind::kRecv, buffer.nbytes(), seconds_since(t0), ReduceOp::kSum,
          buffer.dtype());
}

// Blocks of kBlock elements: each input's block is added into a local accumulator in rank order,
// then the block is stored. Per element this is the same sequence of fp32 operations as one
// element at a time (acc = x_0; acc += x_1; ...), but the inner loops run along the elements,
// where the compiler vectorises them. Every input block is read before `out`'s block is written,
// so `out` may still alias an input.
void reduce_rank_order_host(float* out, const float* const* inputs, int n, int64_t count,
                            ReduceOp op) {
  MP_CHECK(n >= 1, "reduce over {} inputs", n);
  const float divisor = static_cast<float>(n);
  constexpr int64_t kBlock = 512;
  float acc[kBlock];
  for (int64_t k0 = 0; k0 < count; k0 += kBlock) {
    const int64_t m = std::min(kBlock, count - k0);
    const float* x0 = inputs[0] + k0;
    for (int64_t i = 0; i < m; ++i) acc[i] = x0[i];
    for (int s = 1; s < n; ++s) {
      const float* x = inputs[s] + k0;
      if (op == ReduceOp::kMax) {
        for (int64_t i = 0; i < m; ++i)
          acc[i] = (x[i] > acc[i] || x[i] != x[i]) ? x[i] : acc[i];  // NaN propagates
      } else {
        for (int64_t i = 0; i < m; ++i) acc[i] += x[i];
      }
    }
    if (op == ReduceOp::kAvg)
      for (int64_t i = 0; i < m; ++i) acc[i] = acc[i] / divisor;
    std::copy(acc, acc + m, out + k0);
  }
}

#if MESHPROOF_HAVE_CUDA
static_assert(kMaxDeviceReduceInputs == detail::kMaxReduceInputs);

void reduce_rank_order_device(float* out, const float* const* inputs, int n, int64_t count,
                              ReduceOp op, void* stream) {
  MP_CHECK(1 <= n && n <= kMaxDeviceReduceInputs, "device reduce over {} inputs (max {})", n,
           kMaxDeviceReduceInputs);
  const auto kop = op == ReduceOp::kSum   ? detail::ReduceKernelOp::kSum
                   : op == ReduceOp::kAvg ? detail::ReduceKernelOp::kAvg
                                          : detail::ReduceKernelOp::kMax;
  MP_CUDA_CHECK_STATUS(detail::launch_reduce_rank_order(out, inputs, n, count, kop, stream));
}
#endif

}  // namespace meshproof::mesh
