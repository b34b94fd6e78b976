#include "mesh/core/collective_recorder.h"

#include <fmt/format.h>

#include <utility>

namespace meshproof::mesh {

std::string describe(const CollectiveCall& c) {
  const bool reduces =
      c.kind == CollectiveKind::kAllReduce || c.kind == CollectiveKind::kReduceScatter;
  return fmt::format("{}{} {} {} {} B {}", collective_name(c.kind),
                     reduces ? fmt::format("({})", reduce_op_name(c.op)) : std::string(), c.group,
                     kernels::dtype_name(c.dtype), c.bytes, c.tensor);
}

void CollectiveRecorder::begin_step(int64_t step) {
  in_step_ = true;
  step_ = step;
}

void CollectiveRecorder::end_step() { in_step_ = false; }

void CollectiveRecorder::record(CollectiveKind kind, ReduceOp op, const Communicator& comm,
                                kernels::DType dtype, int64_t bytes) {
  calls_.push_back({.step = step_,
                    .kind = kind,
                    .op = op,
                    .group = comm.label(),
                    .dtype = dtype,
                    .bytes = bytes,
                    .tensor = subject_});
}

CollectiveRecorder::Subject::Subject(CollectiveRecorder* r, std::string tensor) : r_(r) {
  if (r_ == nullptr) return;
  saved_ = std::exchange(r_->subject_, std::move(tensor));
}

CollectiveRecorder::Subject::~Subject() {
  if (r_ != nullptr) r_->subject_ = std::move(saved_);
}

void attach_recorder(RankComms& comms, CollectiveRecorder* r) {
  for (unsigned bits = 1; bits < (1u << kNumGroupDims); ++bits) {
    const DimSet dims = DimSet::from_bits(bits);
    if (comms.mesh().group_size(dims) > 1) comms.group(dims).set_recorder(r);
  }
}

}  // namespace meshproof::mesh
