// Injected faults (docs/design.md section 7): each reproduces a real bug class of sharded FP8
// training and must be caught by a check. Plain data handed to the engine; the harness maps the
// scenario's fault catalog entries (harness/scenario_faults.cc) onto it. A fault is active from
// step `from_step` on (counted in optimizer steps; 0 = from the start).
#pragma once

#include <cstdint>
#include <string>

namespace meshproof::engine {

struct FaultInjection {
  // Per-tensor amax of sharded weights not MAX-reduced over the weight-sharding group, so
  // gather(quantize(shard)) != quantize(gather(shard)). Caught by allgather_parity, reference.
  bool amax_not_reduced = false;
  // FSDP x TP weights laid out left-to-right (Shard(0) over dp_shard then tp) instead of
  // StridedShard(0, sf=tp): checkpoint chunks land in the wrong global rows on another mesh.
  // Caught by resume_cross_mesh.
  bool tp_fsdp_left_to_right = false;
  // FP8 scale / amax history omitted from checkpoints (resumed delayed scaling restarts at 1).
  bool fp8_state_dropped_from_checkpoint = false;
  // scale_inv (and scale) round-tripped through bf16 when saved.
  bool scale_inv_saved_bf16 = false;
  // Backward uses a columnwise (transposed) FP8 weight copy from before the last optimizer step.
  bool stale_columnwise_copy = false;
  int64_t stale_columnwise_layer = -1;  // -1: every layer
  // Data cursor not restored on resume (the resumed run replays batches from step 0).
  bool data_cursor_not_restored = false;
  // Optimizer state not restored on resume: "all", "exp_avg", "exp_avg_sq" or "step".
  bool optimizer_state_not_restored = false;
  std::string optimizer_state_part = "all";
  // HSDP gradients not all-reduced over dp_replicate (replicas drift apart).
  bool hsdp_replicas_not_reduced = false;
  // The zero padding that evens out uneven shards for collectives leaks into the math (padded
  // rows are treated as real rows of the weight).
  bool uneven_shard_padding_leak = false;

  // Loading into an FP8-parameter model restores the delayed-scaling amax histories from their
  // init values instead of the checkpoint's (TE PR #567). Caught by state.
  bool amax_history_restored_from_init = false;
  // The optimizer step counter advanced by a synthetic step before the load, which keeps the
  // advance: the resumed optim/step is one past the saved one (Megatron-LM #5974). Caught by
  // state.
  bool optimizer_step_advanced_before_load = false;
  // Gradient accumulation over micro-batches keeps only the last micro-batch's gradient (each
  // micro-batch's backward overwrites the accumulator; Megatron-LM PR #7186). Caught by
  // reference with a train.micro_batches override.
  bool grad_accum_last_micro_batch_only = false;

  int64_t from_step = 0;

  bool active(int64_t step) const { return step >= from_step; }
  bool any() const {
    return amax_not_reduced || tp_fsdp_left_to_right || fp8_state_dropped_from_checkpoint ||
           scale_inv_saved_bf16 || stale_columnwise_copy || data_cursor_not_restored ||
           optimizer_state_not_restored || hsdp_replicas_not_reduced || uneven_shard_padding_leak ||
           amax_history_restored_from_init || optimizer_step_advanced_before_load ||
           grad_accum_last_micro_batch_only;
  }
};

}  // namespace meshproof::engine
