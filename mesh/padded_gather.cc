#include "mesh/padded_gather.h"

#include <algorithm>

#include "kernels/error.h"

namespace meshproof::mesh {

using kernels::Tensor;

namespace {

// Elements [begin, begin + numel(shape)) of a dense tensor's flat storage, as `shape`.
Tensor flat_slice(const Tensor& t, int64_t begin, const kernels::Shape& shape) {
  const int64_t n = shape.numel().value;
  if (n == 0) return Tensor::empty(shape, t.dtype(), t.device());
  return t.view({t.numel().value}).slice_rows(begin, begin + n).view(shape);
}

}  // namespace

std::vector<Box> member_boxes(const Communicator& comm, const Layout& layout) {
  std::vector<Box> boxes;
  for (int r : comm.ranks()) boxes.push_back(layout.box(r));
  return boxes;
}

Tensor gather_padded(Communicator& comm, const std::vector<Box>& boxes, const Tensor& local,
                     const Box& target, Padding padding) {
  const int n = comm.size();
  MP_CHECK(static_cast<int>(boxes.size()) == n, "gather_padded: {} boxes for {} members",
           boxes.size(), n);
  const kernels::Device dev = local.device();
  const Box& mine = boxes[static_cast<size_t>(comm.rank())];
  MP_CHECK(local.shape() == mine.shape(), "gather_padded: local {} is not the shape of box {}",
           local.describe(), mine.str());
  int64_t chunk = 0;  // elements per member in the collective
  for (const Box& b : boxes) chunk = std::max(chunk, b.numel().value);
  chunk = std::max<int64_t>(chunk, 1);

  if (padding == Padding::kKeep) {
    MP_CHECK(target.rank() == 2, "gather_padded: kKeep needs a 2-D target, got {}", target.str());
    const int64_t cols = target.extent[1].value;
    int64_t chunk_rows = 0;
    for (const Box& b : boxes) chunk_rows = std::max(chunk_rows, b.extent[0].value);
    for (int s = 0; s < n; ++s) {
      const Box& b = boxes[static_cast<size_t>(s)];
      MP_CHECK(b.empty() || (b.extent[1].value == cols && b.offset[1] == target.offset[1] &&
                             b.offset[0].value == target.offset[0].value + s * chunk_rows),
               "padded gather: box {} of member {} is not the torch.chunk row chunk of {}", b.str(),
               s, target.str());
    }
    chunk = std::max<int64_t>(chunk_rows * cols, 1);
    Tensor send = Tensor::zeros({chunk}, local.dtype(), dev);
    kernels::copy_bytes(send.raw_data(), dev, local.raw_data(), dev, local.nbytes());
    if (n == 1) return flat_slice(send, 0, {chunk_rows, cols});
    Tensor recv = Tensor::empty({n * chunk}, local.dtype(), dev);
    comm.all_gather(send, recv);
    return flat_slice(recv, 0, {n * chunk_rows, cols});
  }

  Tensor out = Tensor::empty(target.shape(), local.dtype(), dev);
  if (n == 1) {
    const Box region = mine.intersect(target);
    if (!region.empty()) copy_region(local, mine, out, target, region);
    return out;
  }
  Tensor send = Tensor::zeros({chunk}, local.dtype(), dev);
  kernels::copy_bytes(send.raw_data(), dev, local.raw_data(), dev, local.nbytes());
  Tensor recv = Tensor::empty({n * chunk}, local.dtype(), dev);
  comm.all_gather(send, recv);
  for (int s = 0; s < n; ++s) {
    const Box& b = boxes[static_cast<size_t>(s)];
    const Box region = b.intersect(target);
    if (region.empty()) continue;
    copy_region(flat_slice(recv, s * chunk, b.shape()), b, out, target, region);
  }
  return out;
}

Tensor reduce_scatter_box(Communicator& comm, const Layout& layout, const Tensor& full,
                          const Box& source, ReduceOp op, bool run) {
  const kernels::Device dev = full.device();
  MP_CHECK(full.dtype() == kernels::DType::kFloat32,
           "reduce_scatter_box: {} is not float32 (reductions are fp32)", full.describe());
  const Box& mine = layout.box(comm.ranks()[static_cast<size_t>(comm.rank())]);
  Tensor out = Tensor::empty(mine.shape(), kernels::DType::kFloat32, dev);
  if (comm.size() == 1 || !run) {
    copy_region(full, source, out, mine, mine);
    return out;
  }
  int64_t chunk = 1;
  for (int r : comm.ranks()) chunk = std::max(chunk, layout.box(r).numel().value);
  Tensor send = Tensor::zeros({comm.size() * chunk}, kernels::DType::kFloat32, dev);
  for (int s = 0; s < comm.size(); ++s) {
    const Box& b = layout.box(comm.ranks()[static_cast<size_t>(s)]);
    if (b.empty()) continue;
    Tensor piece = send.slice_rows(s * chunk, s * chunk + b.numel().value).view(b.shape());
    copy_region(full, source, piece, b, b);
  }
  Tensor recv = Tensor::empty({chunk}, kernels::DType::kFloat32, dev);
  comm.reduce_scatter(send, recv, op);
  kernels::copy_bytes(out.raw_data(), dev, recv.raw_data(), dev, out.nbytes());
  return out;
}

}  // namespace meshproof::mesh
