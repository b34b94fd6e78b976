#include "mesh/core/padded_gather.h"

#include <algorithm>

#include "kernels/core/error.h"

namespace meshproof::mesh {

using kernels::Tensor;

namespace {

// Elements [begin, begin + numel(shape)) of a dense tensor's flat storage, as `shape`.
Tensor flat_slice(const Tensor& t, int64_t begin, const kernels::Shape& shape) {
  const int64_t n = shape.numel().value;
  if (n == 0) return Tensor::empty(shape, t.dtype(), t.device());
  return t.view({t.numel().value}).slice_rows(begin, begin + n).view(shape);
}

// `local` flattened to `chunk` elements: itself when it has that many, else a copy followed by
// zeros (only the padding is zero-filled).
Tensor padded_to(const Tensor& local, int64_t chunk) {
  const int64_t n = local.numel().value;
  if (n == chunk) return local.view({chunk});
  Tensor send = Tensor::empty({chunk}, local.dtype(), local.device());
  kernels::copy_bytes(send.raw_data(), local.device(), local.raw_data(), local.device(),
                      local.nbytes());
  send.slice_rows(n, chunk).zero_();
  return send;
}

// stacked_rows over n members whose boxes box_of(s) returns (no copies of the boxes).
template <typename BoxOf>
bool stacked_rows_of(int n, const BoxOf& box_of, const Box& whole) {
  if (n == 0 || whole.rank() == 0) return false;
  const Box& first = box_of(0);
  const int64_t rows = first.rank() == whole.rank() ? first.extent[0].value : 0;
  if (rows <= 0) return false;
  int64_t row = whole.offset[0].value;
  for (int s = 0; s < n; ++s) {
    const Box& b = box_of(s);
    if (b.rank() != whole.rank() || b.offset[0].value != row || b.extent[0].value != rows)
      return false;
    for (int d = 1; d < whole.rank(); ++d) {
      const auto i = static_cast<size_t>(d);
      if (b.offset[i] != whole.offset[i] || b.extent[i] != whole.extent[i]) return false;
    }
    row += rows;
  }
  return row == whole.end(0);
}

}  // namespace

bool stacked_rows(const std::vector<Box>& boxes, const Box& whole) {
  return stacked_rows_of(
      static_cast<int>(boxes.size()),
      [&](int s) -> const Box& { return boxes[static_cast<size_t>(s)]; }, whole);
}

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
  if (stacked_rows(boxes, target)) {
    // The members' boxes tile `target` in member order: gather straight into it.
    Tensor flat = out.view({n * chunk});
    comm.all_gather(local.view({chunk}), flat);
    return out;
  }
  const Tensor send = padded_to(local, chunk);
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
  const auto box_of = [&](int s) -> const Box& {
    return layout.box(comm.ranks()[static_cast<size_t>(s)]);
  };
  if (stacked_rows_of(comm.size(), box_of, source)) {
    // The members' boxes tile `source` in member order: `full` is the send buffer as it is and
    // this member's chunk lands in `out` directly.
    const int64_t chunk = mine.numel().value;
    Tensor flat = out.view({chunk});
    comm.reduce_scatter(full.view({comm.size() * chunk}), flat, op);
    return out;
  }
  int64_t chunk = 1;
  for (int s = 0; s < comm.size(); ++s) chunk = std::max(chunk, box_of(s).numel().value);
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
