// Internal to the fault hooks (engine/faults/fault_hooks.cc and the fault_hooks_*.cc files beside
// it): the runs of hook registrations that make_fault_hooks (fault_hooks.cc) calls one after the
// other. A point folds over its hooks in registration order, and several faults register on one
// point (checkpoint_save, checkpoint_restore, amax_group, collective, backward_weight), so the
// runs keep the one order the faults were registered in: the runs in the order declared here and
// each fault's registration inside its run. A new fault registers at the end of the last run.
// Only those files include it.
#pragma once

#include "engine/faults/fault_hooks.h"
#include "engine/faults/faults.h"

namespace meshproof::engine::fault_detail {

// fault_hooks_builtin.cc: the first built-in faults (weight gather padding, amax, state layout,
// HSDP replicas, stale columnwise copy, checkpoint save and restore).
void add_first_builtin_faults(const FaultInjection& f, FaultHooks& h);
// fault_hooks_generic.cc: the user-defined generic faults (docs/design.md section 23).
void add_generic_faults(const FaultInjection& f, FaultHooks& h);
// fault_hooks_builtin.cc: the built-in faults added with issue #20 (stale FP8 weight, RoPE
// positions, SwiGLU checkpoint swizzle, NVFP4 options, restores, gradient accumulation).
void add_issue20_builtin_faults(const FaultInjection& f, FaultHooks& h);
// fault_hooks_parallel.cc: the catalog entries of the parallel machinery (FP8 all-gathers,
// resharded loads, block scales, the MoE router and experts, amax over tp, collectives, pipeline
// stages).
void add_parallel_faults(const FaultInjection& f, FaultHooks& h);

}  // namespace meshproof::engine::fault_detail
