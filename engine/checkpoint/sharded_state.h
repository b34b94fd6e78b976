// The sharded training state of one rank (docs/design.md section 6), as plain data shared by the
// engine (engine/session/session.h) and the checkpoint module: every tensor the rank owns a piece
// of, keyed by its checkpoint key, with the layout that says which box of the global tensor the
// local tensor holds, plus the scalars of the run.
//
// TrainingSession::state() returns entries whose `local` tensors share storage with the live
// training tensors (kernels::Tensor is a handle), so a checkpoint loader that writes into
// `entry.local` (same shape and dtype) restores the run in place; scalars are copied back with
// TrainingSession::load_scalars().
//
// Keys (engine/checkpoint/state_keys.h has the names as constants):
//   model/<param>                       fp32 master weight shard
//   optim/<param>/exp_avg, /exp_avg_sq  fp32 AdamW moments (same layout as the weight)
//   fp8/<linear>/<input|weight|grad_output>/scale          fp32 [1] (delayed recipe)
//   fp8/<linear>/<input|weight|grad_output>/amax_history   fp32 [L] (delayed recipe)
//   fp8/params/<param>/...              FP8 primary weight shards (fsdp.fp8_params)
// Scalars:
//   optim/step        optimizer steps taken (AdamW bias correction)
//   data/cursor       index of the next global batch to draw
//   rng/offset        Philox offset of dropout (dropout is keyed by (seed, step, coordinate): it
//                     equals data/cursor; saved so a resume can check it)
//   lr/step           LR schedule position
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/core/tensor.h"
#include "mesh/core/layout.h"

namespace meshproof::engine {

struct StateEntry {
  std::string key;        // checkpoint key, see above
  mesh::Layout layout;    // global shape + placements on the run's mesh; box(rank) = local's box
  kernels::Tensor local;  // this rank's box of the global tensor (empty box: numel 0)
  // A copy of a key that another pipeline stage holds and saves (the last stage's copy of a tied
  // embed.tok and its moments, docs/design.md section 33): a checkpoint save does not write it,
  // a load fills it from the one global key like any entry, and the rule that each checkpoint key
  // is held by exactly one stage does not count it.
  bool replica = false;
};

struct ShardedState {
  std::vector<StateEntry> entries;         // in a fixed order, identical on every rank
  std::map<std::string, int64_t> scalars;  // see above
};

}  // namespace meshproof::engine
