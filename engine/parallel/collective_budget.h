// The collective budget (docs/design.md section 29): the collectives a step of a run must issue
// for its parameters, derived from the sharding plan and the options alone, never from a run.
// The `collectives` check (harness/checks/check_table.cc) compares it with what the rank's recorder
// saw (mesh/core/collective_recorder.h), per step, as multisets.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/session/session.h"
#include "mesh/core/collective_recorder.h"

namespace meshproof::engine {

// Every collective global rank `rank` must issue in optimizer step `step` (0-based) for a
// parameter of options.config's model on options.mesh with options.fsdp, options.amax_groups and
// the recipe: per micro-batch the dp_shard gathers of each unit's weights (FP8 bytes and scales
// where the plan gathers FP8), the recipe's weight amax reductions, and per gradient sync the
// tp (sequence parallel), dp_shard and dp_replicate gradient reductions. Faults are not part of
// the plan: a run with faults is compared against the fault-free budget.
std::vector<mesh::CollectiveCall> expected_collectives(const RunOptions& options, int rank,
                                                       int64_t step);

}  // namespace meshproof::engine
