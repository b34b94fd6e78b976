#include "mesh/core/layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <span>

#include "kernels/core/error.h"

namespace meshproof::mesh {

using kernels::Elements;
using kernels::Shape;
using kernels::Tensor;

std::string Placement::str() const {
  switch (kind) {
    case Kind::kReplicate:
      return "Replicate()";
    case Kind::kShard:
      return fmt::format("Shard({})", dim);
    case Kind::kStridedShard:
      return fmt::format("StridedShard({}, sf={})", dim, split_factor);
  }
  return "?";
}

Elements Box::numel() const {
  int64_t n = 1;
  for (const Elements& e : extent) {
    MP_CHECK_INPUT(e.value >= 0, "box {} has a negative extent", str());
    MP_CHECK_INPUT(!__builtin_mul_overflow(n, e.value, &n),
                   "box {} has more elements than an int64 can count", str());
  }
  return Elements(n);
}

int64_t Box::end(int d) const {
  const size_t i = static_cast<size_t>(d);
  int64_t e = 0;
  MP_CHECK_INPUT(!__builtin_add_overflow(offset[i].value, extent[i].value, &e),
                 "box {}: offset + extent of dim {} overflows int64", str(), d);
  return e;
}

Shape Box::shape() const { return Shape(std::span<const kernels::Elements>(extent)); }

Box Box::intersect(const Box& other) const {
  MP_CHECK(rank() == other.rank(), "intersect boxes of rank {} and {}", rank(), other.rank());
  Box out;
  for (int d = 0; d < rank(); ++d) {
    const size_t i = static_cast<size_t>(d);
    const int64_t lo = std::max(offset[i].value, other.offset[i].value);
    const int64_t hi = std::min(end(d), other.end(d));
    out.offset.emplace_back(lo);
    out.extent.emplace_back(std::max<int64_t>(hi - lo, 0));
  }
  return out;
}

bool Box::contains(const Box& inner) const {
  if (rank() != inner.rank()) return false;
  for (int d = 0; d < rank(); ++d) {
    const size_t i = static_cast<size_t>(d);
    if (inner.offset[i] < offset[i] || inner.end(d) > end(d)) return false;
  }
  return true;
}

std::string Box::str() const {
  std::vector<std::string> parts;
  for (size_t i = 0; i < offset.size(); ++i) {
    // Printed without adding (the sum may overflow on a malformed box).
    parts.push_back(offset[i].value >= 0 && extent[i].value >= 0 &&
                            offset[i].value <= INT64_MAX - extent[i].value
                        ? fmt::format("{}:{}", offset[i].value, offset[i].value + extent[i].value)
                        : fmt::format("{}+{}", offset[i].value, extent[i].value));
  }
  return fmt::format("[{}]", fmt::join(parts, ", "));
}

Box Box::whole(const Shape& shape) {
  Box b;
  for (int64_t d : shape.dims()) {
    b.offset.emplace_back(0);
    b.extent.emplace_back(d);
  }
  return b;
}

Layout::Layout(DeviceMesh mesh, Shape global_shape, std::vector<Placement> placements)
    : mesh_(mesh), global_shape_(global_shape), placements_(std::move(placements)) {
  const int ndim = global_shape_.rank();
  MP_CHECK_INPUT(static_cast<int>(placements_.size()) == kNumMeshDims,
                 "layout of tensor {}: {} placements given, one per mesh dim ({}) expected",
                 global_shape_.str(), placements_.size(), kNumMeshDims);
  for (int64_t d : global_shape_.dims()) {
    MP_CHECK_INPUT(d >= 0, "layout: negative dimension in shape {}", global_shape_.str());
  }

  // Per tensor dim, the mesh dims that chunk it, in the order they apply (see the header).
  std::vector<std::vector<MeshDim>> order(static_cast<size_t>(ndim));
  struct Pending {
    bool active = false;
    MeshDim mesh_dim = MeshDim::kDpReplicate;
    int remaining = 1;
  };
  std::vector<Pending> pending(static_cast<size_t>(ndim));
  for (MeshDim m : kAllMeshDims) {
    const Placement& p = placement(m);
    if (!p.is_shard()) continue;
    MP_CHECK_INPUT(0 <= p.dim && p.dim < ndim,
                   "layout of tensor {}: {} on mesh dim {} names tensor dim {} but the tensor has "
                   "{} dims",
                   global_shape_.str(), p.str(), mesh_dim_name(m), p.dim, ndim);
    const size_t d = static_cast<size_t>(p.dim);
    if (p.kind == Placement::Kind::kStridedShard) {
      MP_CHECK_INPUT(p.split_factor >= 1, "layout of tensor {}: {} needs a split factor >= 1",
                     global_shape_.str(), p.str());
      MP_CHECK_INPUT(!pending[d].active,
                     "layout of tensor {}: nested StridedShard placements on tensor dim {} are "
                     "not supported",
                     global_shape_.str(), p.dim);
      if (p.split_factor == 1) {
        order[d].push_back(m);  // no pre-sharding: identical to Shard(d)
      } else {
        pending[d] = Pending{true, m, p.split_factor};
      }
      continue;
    }
    order[d].push_back(m);
    if (pending[d].active) {
      MP_CHECK_INPUT(pending[d].remaining % mesh_.size(m) == 0,
                     "layout of tensor {}: {} on mesh dim {} has a split factor that is not the "
                     "product of the Shard({}) mesh sizes to its right (next one: {}={})",
                     global_shape_.str(), placement(pending[d].mesh_dim).str(),
                     mesh_dim_name(pending[d].mesh_dim), p.dim, mesh_dim_name(m), mesh_.size(m));
      pending[d].remaining /= mesh_.size(m);
      if (pending[d].remaining == 1) {
        order[d].push_back(pending[d].mesh_dim);
        pending[d].active = false;
      }
    }
  }
  for (size_t d = 0; d < pending.size(); ++d) {
    MP_CHECK_INPUT(!pending[d].active,
                   "layout of tensor {}: {} on mesh dim {}: the split factor must equal the "
                   "product of the mesh sizes of the Shard({}) placements to its right",
                   global_shape_.str(), placement(pending[d].mesh_dim).str(),
                   mesh_dim_name(pending[d].mesh_dim), d);
  }

  // Nested torch.chunk per tensor dim: chunk size ceil(n/k), trailing chunks smaller or empty.
  boxes_.reserve(static_cast<size_t>(mesh_.world_size()));
  for (int r = 0; r < mesh_.world_size(); ++r) {
    const Coords c = mesh_.coords(r);
    Box b = Box::whole(global_shape_);
    for (size_t d = 0; d < order.size(); ++d) {
      int64_t off = 0;
      int64_t ext = global_shape_.dims()[d];
      for (MeshDim m : order[d]) {
        const int64_t n = mesh_.size(m);
        const int64_t i = c[static_cast<size_t>(m)];
        // ceil(ext / n) and min(i * chunk, ext) without overflow (shapes may come from files).
        const int64_t chunk = ext / n + (ext % n != 0 ? 1 : 0);
        int64_t start = 0;
        if (__builtin_mul_overflow(i, chunk, &start) || start > ext) start = ext;
        const int64_t len = std::min(chunk, ext - start);
        off += start;
        ext = len;
      }
      b.offset[d] = Elements(off);
      b.extent[d] = Elements(ext);
    }
    boxes_.push_back(std::move(b));
  }

  // Distinct non-empty boxes: nested chunks are either equal (replicas) or disjoint.
  int64_t covered = 0;
  for (int r = 0; r < mesh_.world_size(); ++r) {
    const Box& b = boxes_[static_cast<size_t>(r)];
    if (b.empty()) continue;
    const bool seen =
        std::any_of(chunks_.begin(), chunks_.end(), [&](const Chunk& ch) { return ch.box == b; });
    if (!seen) {
      chunks_.push_back(Chunk{r, b});
      covered += b.numel().value;
    }
  }
  MP_CHECK(covered == global_shape_.numel().value,
           "layout {}: distinct chunks cover {} of {} elements", str(), covered,
           global_shape_.numel().value);
}

const Box& Layout::box(int rank) const {
  MP_CHECK_INPUT(0 <= rank && rank < mesh_.world_size(), "rank {} outside layout {}", rank, str());
  return boxes_[static_cast<size_t>(rank)];
}

std::string Layout::str() const {
  std::vector<std::string> ps;
  for (const Placement& p : placements_) ps.push_back(p.str());
  return fmt::format("{} ({}) on {}", global_shape_.str(), fmt::join(ps, ", "), mesh_.str());
}

void copy_region(const Tensor& src, const Box& src_box, Tensor& dst, const Box& dst_box,
                 const Box& region) {
  MP_CHECK(src.dtype() == dst.dtype(), "copy_region from {} into {}: dtypes differ", src.describe(),
           dst.describe());
  MP_CHECK(src.shape() == src_box.shape() && dst.shape() == dst_box.shape(),
           "copy_region: {} does not match its box {} or {} does not match {}", src.describe(),
           src_box.str(), dst.describe(), dst_box.str());
  MP_CHECK(src_box.contains(region) && dst_box.contains(region),
           "copy_region: region {} is not inside source box {} and target box {}", region.str(),
           src_box.str(), dst_box.str());
  const int bits = kernels::dtype_bits(src.dtype());
  MP_CHECK(bits % 8 == 0, "copy_region of {}: sub-byte dtypes cannot be cut into boxes",
           src.describe());
  if (region.empty()) return;
  const int64_t esize = bits / 8;
  const int ndim = region.rank();
  if (ndim == 0) {
    kernels::copy_bytes(dst.raw_data(), dst.device(), src.raw_data(), src.device(),
                        kernels::Bytes(esize));
    return;
  }
  auto strides = [ndim](const Box& b) {
    std::vector<int64_t> s(static_cast<size_t>(ndim), 1);
    for (int d = ndim - 2; d >= 0; --d) {
      s[static_cast<size_t>(d)] =
          s[static_cast<size_t>(d) + 1] * b.extent[static_cast<size_t>(d) + 1].value;
    }
    return s;
  };
  const std::vector<int64_t> ss = strides(src_box);
  const std::vector<int64_t> ds = strides(dst_box);
  // The longest contiguous run: trailing dims that the region, source and target all span fully
  // merge with the next dim out.
  int k = ndim - 1;
  int64_t run = region.extent[static_cast<size_t>(k)].value;
  while (k > 0 && region.extent[static_cast<size_t>(k)] == src_box.extent[static_cast<size_t>(k)] &&
         region.extent[static_cast<size_t>(k)] == dst_box.extent[static_cast<size_t>(k)]) {
    --k;
    run *= region.extent[static_cast<size_t>(k)].value;
  }
  // Iterate over the region's index tuples for dims [0, outer). On the host each tuple of dims
  // [0, k) is one contiguous run; with a device involved the runs of dim k - 1 are one strided
  // 2-D copy (kernels::copy_bytes_2d), so a region of a device tensor costs one copy per tuple
  // of dims [0, k - 1) (one in all for a 2-D tensor), not one per row.
  const bool device_copy = !src.device().is_cpu() || !dst.device().is_cpu();
  const int outer = device_copy && k >= 1 ? k - 1 : k;
  std::vector<int64_t> idx(static_cast<size_t>(outer), 0);
  const char* sp = static_cast<const char*>(src.raw_data());
  char* dp = static_cast<char*>(dst.raw_data());
  while (true) {
    int64_t so = 0, dof = 0;
    for (int d = 0; d < ndim; ++d) {
      const size_t i = static_cast<size_t>(d);
      const int64_t g = region.offset[i].value + (d < outer ? idx[i] : 0);
      so += (g - src_box.offset[i].value) * ss[i];
      dof += (g - dst_box.offset[i].value) * ds[i];
    }
    if (outer < k) {
      const size_t r = static_cast<size_t>(k - 1);
      kernels::copy_bytes_2d(dp + dof * esize, dst.device(), ds[r] * esize, sp + so * esize,
                             src.device(), ss[r] * esize, run * esize, region.extent[r].value);
    } else {
      kernels::copy_bytes(dp + dof * esize, dst.device(), sp + so * esize, src.device(),
                          kernels::Bytes(run * esize));
    }
    int d = outer - 1;
    while (d >= 0) {
      const size_t i = static_cast<size_t>(d);
      if (++idx[i] < region.extent[i].value) break;
      idx[i] = 0;
      --d;
    }
    if (d < 0) break;
  }
}

Tensor shard(const Tensor& global, const Layout& layout, int rank) {
  MP_CHECK_INPUT(global.shape() == layout.global_shape(),
                 "shard: tensor {} does not match layout {}", global.describe(), layout.str());
  const Box& b = layout.box(rank);
  Tensor local = Tensor::empty(b.shape(), global.dtype(), global.device());
  copy_region(global, Box::whole(global.shape()), local, b, b);
  return local;
}

Tensor unshard(const std::vector<Tensor>& locals, const Layout& layout) {
  MP_CHECK_INPUT(static_cast<int>(locals.size()) == layout.mesh().world_size(),
                 "unshard: {} local tensors for layout {} with {} ranks", locals.size(),
                 layout.str(), layout.mesh().world_size());
  for (int r = 0; r < layout.mesh().world_size(); ++r) {
    const Tensor& t = locals[static_cast<size_t>(r)];
    MP_CHECK_INPUT(
        t.defined() && t.shape() == layout.local_shape(r) && t.dtype() == locals[0].dtype(),
        "unshard: rank {} holds {} but layout {} expects {}[{}]", r, t.describe(), layout.str(),
        kernels::dtype_name(locals[0].dtype()), layout.local_shape(r).str());
  }
  Tensor global = Tensor::empty(layout.global_shape(), locals[0].dtype(), locals[0].device());
  const Box whole = Box::whole(layout.global_shape());
  for (const Chunk& ch : layout.chunks()) {
    copy_region(locals[static_cast<size_t>(ch.owner)], ch.box, global, whole, ch.box);
  }
  return global;
}

std::vector<Transfer> reshard_plan(const Layout& src, const Layout& dst) {
  MP_CHECK_INPUT(src.global_shape() == dst.global_shape(),
                 "reshard from {} to {}: global shapes differ", src.str(), dst.str());
  std::vector<Transfer> plan;
  for (int r = 0; r < dst.mesh().world_size(); ++r) {
    const Box& target = dst.box(r);
    if (target.empty()) continue;
    for (const Chunk& ch : src.chunks()) {
      Box overlap = ch.box.intersect(target);
      if (!overlap.empty()) plan.push_back(Transfer{ch.owner, r, std::move(overlap)});
    }
  }
  return plan;
}

std::vector<Tensor> reshard(const std::vector<Tensor>& src_locals, const Layout& src,
                            const Layout& dst) {
  MP_CHECK_INPUT(static_cast<int>(src_locals.size()) == src.mesh().world_size(),
                 "reshard: {} local tensors for source layout {}", src_locals.size(), src.str());
  for (int r = 0; r < src.mesh().world_size(); ++r) {
    MP_CHECK_INPUT(src_locals[static_cast<size_t>(r)].shape() == src.local_shape(r),
                   "reshard: rank {} holds {} but layout {} expects {}", r,
                   src_locals[static_cast<size_t>(r)].describe(), src.str(),
                   src.local_shape(r).str());
  }
  std::vector<Tensor> out;
  for (int r = 0; r < dst.mesh().world_size(); ++r) {
    out.push_back(Tensor::empty(dst.local_shape(r), src_locals[0].dtype(), src_locals[0].device()));
  }
  for (const Transfer& t : reshard_plan(src, dst)) {
    copy_region(src_locals[static_cast<size_t>(t.src_rank)], src.box(t.src_rank),
                out[static_cast<size_t>(t.dst_rank)], dst.box(t.dst_rank), t.region);
  }
  return out;
}

}  // namespace meshproof::mesh
