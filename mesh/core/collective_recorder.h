// The collective recorder (docs/design.md section 29): what a rank's communicators ran, one entry
// per collective call, for the `collectives` check. The mesh records the call (kind, reduction,
// the communicator's group label, dtype, nccl-tests bytes); the engine says, at the call site,
// which tensor the call serves (a parameter's name from the sharding plan: the recorder never
// parses names) and which optimizer step it belongs to. Only calls made inside a step and while
// a subject is set are recorded: the budget covers the collectives the engine attributes to a
// tensor, and a rank without a recorder pays one null-pointer test per collective.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/core/dtype.h"
#include "mesh/core/communicator.h"

namespace meshproof::mesh {

struct CollectiveCall {
  int64_t step = 0;  // 0-based optimizer step
  CollectiveKind kind = CollectiveKind::kAllGather;
  // The reduction of reduce_scatter and all_reduce; kSum for the others (unused).
  ReduceOp op = ReduceOp::kSum;
  std::string group;  // the communicator's label, "dp_shard", "dp_shard+tp", ...
  kernels::DType dtype = kernels::DType::kFloat32;
  int64_t bytes = 0;   // nccl-tests size (mesh/core/communicator.h)
  std::string tensor;  // what the engine said the call serves ("layers.0.attn.qkv.weight")
  bool operator==(const CollectiveCall&) const = default;
};

// "all_reduce(max) dp_shard+tp float32 4 B layers.0.attn.qkv.weight"
std::string describe(const CollectiveCall& c);

class CollectiveRecorder {
 public:
  // Calls are recorded between begin_step and end_step, while a subject is set.
  void begin_step(int64_t step);
  void end_step();
  bool recording() const { return in_step_ && !subject_.empty(); }
  void record(CollectiveKind kind, ReduceOp op, const Communicator& comm, kernels::DType dtype,
              int64_t bytes);
  const std::vector<CollectiveCall>& calls() const { return calls_; }

  // Sets the tensor the collectives issued in its lifetime serve (nested: the innermost wins;
  // a null recorder makes it a no-op, so call sites need no test).
  class Subject {
   public:
    Subject(CollectiveRecorder* r, std::string tensor);
    ~Subject();
    Subject(const Subject&) = delete;
    Subject& operator=(const Subject&) = delete;

   private:
    CollectiveRecorder* r_;
    std::string saved_;
  };

 private:
  bool in_step_ = false;
  int64_t step_ = 0;
  std::string subject_;
  std::vector<CollectiveCall> calls_;
};

// Attaches `r` (or detaches, with nullptr) to the communicator of every group of `comms`
// spanning more than one rank.
void attach_recorder(RankComms& comms, CollectiveRecorder* r);

}  // namespace meshproof::mesh
