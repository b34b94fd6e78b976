// The padded all-gather (docs/design.md sections 5 and 20): the one collective that reassembles
// a tensor from shards of unequal size. torch.chunk boxes make trailing shards short or empty;
// collectives move equal sizes, so every member's local tensor is padded with zeros to the
// largest member's element count, the padded buffers are all-gathered, and each member's real
// box is copied out of the receive buffer. The FSDP weight gather (fp32/bf16 masters), the FP8
// all-gather (e4m3 bytes, e8m0 block scales) and tracing's global views all go through it.
//
// On the device of the local tensor (host or GPU): every buffer is allocated there and the
// region copies are device copies (mesh::copy_region, 2-D on a device), so a device tensor's
// collective never touches the host. Bitwise: the result holds the members' bytes unchanged,
// whatever their dtype.
#pragma once

#include <vector>

#include "kernels/core/tensor.h"
#include "mesh/core/communicator.h"
#include "mesh/core/layout.h"

namespace meshproof::mesh {

enum class Padding : uint8_t {
  // The result is `target`: only each member's real box reaches it (what the math needs).
  kCut,
  // The receive buffer itself, [members x chunk_rows, cols]: every member's rows followed by
  // the zero rows that pad its chunk. Only for torch.chunk row chunks that span the columns of
  // `target` (member s at row s x chunk_rows of it). The uneven_shard_padding_leak fault uses it:
  // it is the bug of treating the padding as rows of the weight.
  kKeep,
};

// Collective over `comm`. `boxes[s]`: the box of the global tensor that member s (index in
// comm.ranks()) holds, `local` this member's tensor of shape boxes[comm.rank()].shape(), dense,
// on any device. With Padding::kCut returns `target` (a box of the same global tensor; each
// member's box is intersected with it, the parts of `target` no member covers are left
// uninitialised, so callers pass boxes that cover it); with kKeep see above. The send buffer holds
// max(1, largest member numel) elements. A comm of one member copies without a collective.
kernels::Tensor gather_padded(Communicator& comm, const std::vector<Box>& boxes,
                              const kernels::Tensor& local, const Box& target,
                              Padding padding = Padding::kCut);

// The gathered weight's inverse (the FSDP gradient reduce-scatter): `full` holds box `source` on
// every member (each member's own contribution, float32); member s receives the reduction (op) of
// everybody's copy of its box layout.box(comm.ranks()[s]). Each member's box is cut out and padded
// to the largest member size, then reduce-scattered. `run` false (the skip_collective fault): no
// collective, each member keeps its own copy of its box. On full's device, like gather_padded.
kernels::Tensor reduce_scatter_box(Communicator& comm, const Layout& layout,
                                   const kernels::Tensor& full, const Box& source, ReduceOp op,
                                   bool run);

// True when `boxes` (one per member, in member order) are equal, non-empty slabs along dim 0 that
// span every other dim of `whole` and stack to exactly `whole` (the FSDP row shards of a weight
// whose rows the group divides). Member s's elements are then elements [s * chunk, (s + 1) *
// chunk) of `whole`'s dense storage: gather_padded gathers straight into its result and
// reduce_scatter_box sends `full` as it is, without padded buffers or region copies (the same
// bytes either way).
bool stacked_rows(const std::vector<Box>& boxes, const Box& whole);

// The boxes of comm's members under `layout` (layout.box(rank) for each of comm.ranks()).
std::vector<Box> member_boxes(const Communicator& comm, const Layout& layout);

}  // namespace meshproof::mesh
