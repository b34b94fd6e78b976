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

  int64_t from_step = 0;

  // NVFP4 (docs/design.md section 25): the random Hadamard transform applied to only one wgrad
  // operand (the output gradient's columnwise copy, not the input's), so dW = dY^T T^T X no longer
  // equals dY^T X. Caught by golden, reference.
  bool nvfp4_rht_on_one_operand = false;
  // NVFP4 block scales rounded up to a power of two instead of E4M3 (MXFP4-style scales where
  // NVFP4 requires E4M3). Caught by golden.
  bool nvfp4_block_scale_pow2 = false;

  bool active(int64_t step) const { return step >= from_step; }
  bool any() const {
    return amax_not_reduced || tp_fsdp_left_to_right || fp8_state_dropped_from_checkpoint ||
           scale_inv_saved_bf16 || stale_columnwise_copy || data_cursor_not_restored ||
           optimizer_state_not_restored || hsdp_replicas_not_reduced || uneven_shard_padding_leak ||
           nvfp4_rht_on_one_operand || nvfp4_block_scale_pow2;
  }
};

}  // namespace meshproof::engine
