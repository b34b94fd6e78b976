// The FP8 weight store of a training session (docs/design.md sections 5, 20 and 27): the GEMM
// weights' FP8 (and NVFP4) side. With the FP8 all-gather (fsdp.fp8_all_gather, or a fault that
// needs the quantized weights) it quantizes each weight's local shard once per step (bf16 compute
// copy of the fp32 master, amax MAX-reduced over the weight's amax group) and gathers FP8 bytes +
// scales at every use; with FP8 primary weights (fsdp.fp8_params) it holds the FP8 shards
// themselves, adds them to the checkpoint state and re-quantizes them from the masters after every
// optimizer step. A gathered weight goes to the recipe as a prequantized weight; the layer code
// reads only its shape. allgather_parity records are taken here.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "engine/checkpoint/sharded_state.h"
#include "engine/faults/fault_hooks.h"
#include "engine/model/recipe.h"
#include "engine/parallel/fp8_all_gather.h"
#include "engine/parallel/shard_plan.h"
#include "engine/session/session.h"
#include "mesh/core/collective_recorder.h"
#include "mesh/core/communicator.h"

namespace meshproof::engine {

// Notes of a run (reported fallbacks and behaviour changes), each kept once.
struct RunNotes {
  std::vector<std::string> list;
  void add(const std::string& note);
};

class Fp8WeightStore {
 public:
  // The group an amax of (linear, role) is MAX-reduced over (the session's table + fault hooks).
  using AmaxDims = std::function<mesh::DimSet(std::string_view linear, Fp8Role role)>;

  // `gathers_fp8`: whether GEMM weights are gathered as FP8 (decided by the session from the
  // options and recipe). With options.fsdp.fp8_params the primary weights are made here and
  // added to `state` (input error when an mxfp8 shard is not 32-row aligned).
  Fp8WeightStore(const RunOptions& options, bool gathers_fp8, ShardPlan& plan,
                 mesh::RankComms& comms, Fp8Recipe& recipe, const FaultHooks& faults,
                 AmaxDims amax_dims, kernels::Device device, RunNotes& notes, ShardedState& state);

  bool gathers_fp8() const { return gathers_fp8_; }
  bool primary_weights() const { return fp8_params_; }
  // Forgets the per-step quantized shards (at a step's start and after its backward).
  void clear_step();
  // Gathers GEMM weight `i` of the plan as FP8 over dp_shard and hands it to the recipe (at
  // optimizer step `step`); returns the gathered bytes.
  int64_t gather(size_t i, int64_t step);
  // After optimizer step `step`: re-quantizes the FP8 primary weights from the updated masters,
  // in place (the checkpoint state shares their storage).
  void requantize(int64_t step);
  // Records the store's collectives, each with the weight it serves (nullptr: off).
  void set_recorder(mesh::CollectiveRecorder* r) { recorder_ = r; }
  // Bytes of parameter i's FP8 primary weight (0 without fp8_params).
  int64_t primary_bytes(size_t i) const;
  // allgather_parity records (rank 0, or every process with launcher mpi). With pipeline stages
  // each stage records its own weights; this merges them (collective over the pp group: every
  // rank calls it) ordered by step, then model index, each weight's records in gather order.
  std::vector<AllGatherParity> parity();

 private:
  const Fp8Shard& local_shard(size_t i);
  Fp8Shard quantize_local(const ShardedParam& p, const kernels::Tensor& local);
  CurrentScaleOptions current_scale_options() const;
  kernels::Nvfp4Options nvfp4_options(const ShardedParam& p) const;
  void record_parity(const ShardedParam& p, int64_t step, const kernels::Tensor& local,
                     const kernels::Tensor* scale, const kernels::QuantizedTensor& gathered);
  void make_primary_weights(ShardedState& state);
  // The gathered weight when the FP8 all-gather is replaced (`act`: skipped, or moved through
  // act.dtype): the shard's high-precision values `hp` gathered (or only this rank's rows) and
  // quantized whole with the shard's scale.
  Fp8GatherResult gather_high_precision(const ShardedParam& p, const Fp8Shard& local,
                                        const kernels::Tensor& hp,
                                        const FaultHooks::CollectiveAction& act);

  const RunOptions& options_;
  const Config& config_;
  bool gathers_fp8_ = false;
  bool fp8_params_ = false;
  ShardPlan& plan_;
  mesh::RankComms& comms_;
  Fp8Recipe& recipe_;
  const FaultHooks& faults_;
  AmaxDims amax_dims_;
  kernels::Device device_;
  RunNotes& notes_;
  std::map<size_t, Fp8Shard> primary_;         // fsdp.fp8_params: FP8 primary weight shards
  std::map<size_t, Fp8Shard> step_shards_;     // quantized once per step, gathered at every use
  std::map<size_t, kernels::Tensor> step_hp_;  // bf16 compute copies of the step_shards_
  std::vector<AllGatherParity> parity_;
  std::vector<size_t> parity_index_;  // the model index of each parity_ record's weight
  int64_t step_ = 0;                  // the optimizer step of the current gather or re-quantization
  mesh::CollectiveRecorder* recorder_ = nullptr;
};

}  // namespace meshproof::engine
