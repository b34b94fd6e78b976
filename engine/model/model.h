// The GPT model of docs/design.md section 3, forward and backward written out layer by layer.
//
// Rank-local math only: the model is handed its weights as a TensorMap keyed by the design.md names
// (whole tensors here; a sharded executor gathers them first) and adds weight gradients into a
// TensorMap of float32 tensors with the same keys. Communication outside the tensor-parallel
// collectives (gradient reduction, amax reduction for FP8 recipes) happens outside: the sharded
// session (engine/session/session.h) reduces gradients per FSDP unit through UnitHooks and amax
// values through the recipe's amax hook.
//
// Shapes: B = rows of this micro-batch, S = sequence length, M = B*S, H hidden, A heads,
// d = H/A, F ffn, V vocab. The compute dtype is the dtype of the weights handed in: float32 (fp32
// recipe) or bfloat16 (bf16 recipe: bf16 activations, GEMMs with fp32 accumulation and bf16
// output, weight gradients accumulated in fp32).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "engine/model/params.h"
#include "engine/model/recipe.h"
#include "engine/moe/moe.h"
#include "engine/pipeline/pipeline.h"
#include "kernels/core/tensor.h"
#include "mesh/core/communicator.h"

namespace meshproof::engine {

// Tensor parallelism seen from the layer code (docs/design.md section 5). With a tp communicator
// the weights handed in are this rank's TP shards: qkv and fc1 (gate/up) rows [Shard(0)] holding
// whole heads / a slice of F, proj and fc2 columns [Shard(1)]; norms, embeddings, lm_head and the
// proj/fc2 biases whole. The row-parallel outputs are all-reduced (sum) over tp before their bias
// is added; the column-parallel input gradients are all-reduced after their dgrad GEMMs.
//
// Sequence parallelism (sequence_parallel): the residual stream, norms, final norm, lm_head and
// loss run on this rank's sequence shard (positions [t*S/tp, (t+1)*S/tp) of every row); the
// normed activations are all-gathered along the sequence before a column-parallel GEMM and the
// row-parallel outputs reduce-scattered along it (the input gradients the other way round). The
// returned loss sum and the gradients of TP-replicated parameters are then partial sums over
// the tp ranks: the caller sums them over tp. Needs S % tp == 0 and dropout 0.
struct TpContext {
  mesh::Communicator* comm = nullptr;  // tp group; nullptr or size 1: no tensor parallelism
  bool sequence_parallel = false;
  // RoPE positions under sequence parallelism: the global ones (correct), or each sequence
  // shard's local ones (the rope_positions_local_under_sp fault, engine/faults/fault_hooks.h).
  bool rope_global_positions = true;
  // The data-parallel group (dp_replicate x dp_shard) of this rank, or nullptr on one rank: the
  // MoE load-balancing statistics are summed over it (docs/design.md section 27).
  mesh::Communicator* data = nullptr;
  // The MoE router GEMM in fp32 (correct) or bf16 (the router_not_fp32 fault,
  // engine/faults/fault_hooks.h).
  bool router_fp32 = true;
  // Expert parallelism (docs/design.md "Expert parallelism"): the dp_shard group, inside which
  // each run of `ep` consecutive members exchanges tokens with the owners of their experts by
  // all_to_all_v; ep = 1 (or nullptr): every rank computes every expert on its own tokens.
  mesh::Communicator* expert = nullptr;
  int ep = 1;
  // The owner's expert weight gradients are multiplied by this: 1 (correct) or ep (the
  // expert_grad_scaled_by_ep fault, engine/faults/fault_hooks.h).
  double expert_grad_factor = 1.0;
  // The MoE load-balancing statistics of the whole global batch per layer (indexed by layer;
  // docs/design.md "Tensor-parallel experts", the aux loss with micro-batches), summed by a
  // routing pre-pass over every micro-batch and data-parallel rank (GptModel::routing_stats):
  // when set, each micro-batch's aux loss and its gradient use them instead of the statistics of
  // this micro-batch summed over the data ranks. nullptr: one micro-batch, or no aux loss.
  const std::vector<moe::BalanceStats>* moe_load = nullptr;
  // The experts' wgrad input operands (MXFP8 and block scaling): 0 (correct) quantizes each
  // expert's operands per expert on its block padded to the recipe's alignment; > 0 (the
  // expert_split_padding_too_small fault, engine/faults/fault_hooks.h) takes them from ONE grouped
  // columnwise quantization of all experts' rows, each expert's rows padded to this many.
  int64_t expert_split_padding = 0;
  bool active() const { return comm != nullptr && comm->size() > 1; }
  bool sp() const { return active() && sequence_parallel; }
};

// Identifies a micro-batch inside the global batch: dropout masks are keyed by the global
// coordinates (step, global row, position, feature), so they do not depend on micro-batching or
// the mesh, and recompute regenerates them exactly.
struct BatchCoords {
  int64_t step = 0;
  int64_t row_begin = 0;  // global row of the first sequence of this micro-batch
};

// FSDP units seen from the layer code (docs/design.md section 5, FSDP2's per-module all-gather): an
// executor that shards the weights gathers a unit's weights into the TensorMap right before the
// model first uses them and frees them (or reduces their gradients) right after. Unit kRootUnit
// is everything outside the layers (embeddings, final norm, lm_head), unit i >= 0 is layers.i.
// Call order for one micro-batch:
//   forward:  before(root, F); for i ascending: before(i, F), layer i, after(i, F);
//   backward: before(root, B); lm_head + final norm; for i descending: before(i, B), [recompute],
//             layer i backward, after(i, B); embedding backward; after(root, B).
//   forward only: after(root, F) at the end instead of the backward.
// before(u, B) must also make u's gradient tensors (float32, zeros or accumulated) available in
// the gradient TensorMap.
// (kRootUnit is declared with the parameter specs, engine/model/params.h: each spec names its
// unit.)
enum class Pass { kForward, kBackward };

// Tied embeddings (docs/design.md section 33): the gradient key of the LM head's contribution to
// embed.tok's gradient. When the gradient map holds it, the head's weight gradient of every
// micro-batch accumulates there (H = h0 + h1 + ...) and the embedding backward's into embed.tok
// (E = e0 + e1 + ...); the caller adds them once, E + H, before the gradient is reduced, so that
// pipeline stages holding E (first) and H (last) apart reproduce the sum bit for bit. Without the
// key both accumulate into embed.tok (h0 + e0 + h1 + e1: gradient checks of one call).
inline constexpr const char* kTiedHeadGrad = "embed.tok@lm_head";

class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before(int64_t unit, Pass pass) = 0;
  virtual void after(int64_t unit, Pass pass) = 0;
};

class GptModel {
 public:
  explicit GptModel(const Config& config);

  // Forward and backward of one micro-batch.
  //   tokens: int32 [B, S+1]; inputs are columns [0, S), targets columns [1, S+1).
  //   grad_scale: d(objective)/d(sum of this micro-batch's per-position losses), i.e.
  //     1 / (global positions) for the mean loss over the global batch.
  // Adds weight gradients into `grads` (float32). Returns the SUM of per-position losses.
  // `recipe` (optional) quantizes the GEMM operands of the linear layers and is told when the
  // forward and the backward pass end (delayed-scaling updates). `units` (optional): the
  // executor's per-unit gather/release hooks; without them every weight and gradient must be in
  // the maps up front.
  double forward_backward(const TensorMap& weights, const kernels::Tensor& tokens,
                          const BatchCoords& coords, double grad_scale, TensorMap& grads,
                          Fp8Recipe* recipe = nullptr, const TpContext& tp = {},
                          UnitHooks* units = nullptr) const;

  // Forward only: the sum of per-position losses.
  double forward_loss(const TensorMap& weights, const kernels::Tensor& tokens,
                      const BatchCoords& coords, Fp8Recipe* recipe = nullptr) const;

  // The routing pre-pass of the MoE load-balancing loss with micro-batches: the forward of one
  // micro-batch (recipe and unit hooks as in forward_backward; the recipe's state advances as in
  // the forward of forward_backward, the caller restores it), returning each MoE layer's
  // statistics of this rank's tokens of it, not reduced (dense layers: empty), indexed by layer.
  std::vector<moe::BalanceStats> routing_stats(const TensorMap& weights,
                                               const kernels::Tensor& tokens,
                                               const BatchCoords& coords, Fp8Recipe* recipe,
                                               const TpContext& tp, UnitHooks* units) const;
  // Pipeline stages (docs/design.md section 33): one micro-batch's passes over layers
  // [span.first, span.first + span.count), the embeddings on the first stage, the final norm,
  // LM head and loss on the last. forward_backward is stage_forward + stage_backward of the one
  // stage of all layers, so a stage runs exactly the calls (unit hooks included) that the same
  // layers run with one stage.
  struct StageState;  // one micro-batch's activations between its forward and its backward
  // Forward of one micro-batch on a stage. tokens as forward_backward's (every stage reads them:
  // the first for its inputs, the last for its targets); `input` [rows, H] in the compute dtype
  // (rows = B*S, or B*S/tp under sequence parallelism) is the residual stream entering the stage
  // (ignored on the first stage). Sets `output` to the residual stream leaving a stage that is
  // not the last and `loss` to the last stage's loss sum (0 elsewhere). `training`: keep what
  // stage_backward needs (and compute the loss gradient on the last stage).
  std::shared_ptr<StageState> stage_forward(
      const StageLayers& span, const TensorMap& weights, const kernels::Tensor& tokens,
      const kernels::Tensor& input, const BatchCoords& coords, double grad_scale, Fp8Recipe* recipe,
      const TpContext& tp, UnitHooks* units, bool training, kernels::Tensor& output, double& loss,
      std::vector<moe::BalanceStats>* routing = nullptr) const;
  // Backward of the micro-batch `state` holds: `grad_output` [rows, H] is the gradient of the
  // stage's output (ignored on the last stage, which starts from its loss). Adds the stage's
  // weight gradients into `grads`; returns the gradient of the stage's input (undefined on the
  // first stage). The weights are read from `weights` again (they may have been released and
  // gathered again since the forward).
  kernels::Tensor stage_backward(StageState& state, const TensorMap& weights, TensorMap& grads,
                                 const kernels::Tensor& grad_output, UnitHooks* units) const;
  // The loss sum stage_forward returned plus the stage's MoE load-balancing terms, as
  // forward_backward returns it for the whole model: micro_batch_loss of stage_loss_parts.
  double stage_loss(const StageState& state) const;
  // The parts of a micro-batch's loss sum on one stage (docs/design.md section 33, "MoE under
  // stages"): each MoE layer's load-balancing loss is computed where the layer lives, the
  // cross-entropy on the last stage, which adds them all.
  struct StageLoss {
    double cross_entropy = 0;       // stage_forward's loss sum (the last stage; 0 on the others)
    int64_t rows = 0;               // the positions this rank adds each aux loss for
    std::vector<double> layer_aux;  // the stage's layers' aux losses in layer order (dense: 0)
  };
  StageLoss stage_loss_parts(const StageState& state) const;
  // cross_entropy + (0 + layer_aux[0] + layer_aux[1] + ...) * rows, the one expression of a
  // micro-batch's loss sum: with one stage layer_aux is every layer's; with pipeline stages the
  // last stage passes every layer's aux loss of the micro-batch (gathered over pp, model order),
  // so the sum is one stage's bit for bit.
  static double micro_batch_loss(double cross_entropy, const std::vector<double>& layer_aux,
                                 int64_t rows);
  // The routing pre-pass on a pipeline stage (docs/design.md section 33): stage_forward of the
  // span without training, the unit hooks as routing_stats calls them; returns the statistics of
  // the span's MoE layers, indexed by layer (every other layer empty), and sets `output` to the
  // residual stream for the next stage. routing_stats is this over the one stage of all layers.
  std::vector<moe::BalanceStats> stage_routing_stats(
      const StageLayers& span, const TensorMap& weights, const kernels::Tensor& tokens,
      const kernels::Tensor& input, const BatchCoords& coords, Fp8Recipe* recipe,
      const TpContext& tp, UnitHooks* units, kernels::Tensor& output) const;

  const Config& config() const { return config_; }

 private:
  struct LayerActs;
  // One MLP's and one layer's parameters as pointers into the weights (T = const Tensor) or into
  // the gradients (T = Tensor): one description, looked up one way, for both.
  template <class T>
  struct MlpParams;
  template <class T>
  struct LayerParams;
  using MlpWeights = MlpParams<const kernels::Tensor>;
  using MlpGrads = MlpParams<kernels::Tensor>;
  using LayerWeights = LayerParams<const kernels::Tensor>;
  using LayerGrads = LayerParams<kernels::Tensor>;
  struct MlpActs;

  struct Linear;
  double run(const TensorMap& weights, const kernels::Tensor& tokens, const BatchCoords& coords,
             double grad_scale, TensorMap* grads, Fp8Recipe* recipe, const TpContext& tp,
             UnitHooks* units) const;
  LayerWeights layer_weights(const TensorMap& w, int64_t i) const;
  LayerGrads layer_grads(TensorMap& g, int64_t i) const;
  template <class T, class At>
  LayerParams<T> layer_params(int64_t i, At at) const;
  template <class T, class At>
  MlpParams<T> mlp_params(const std::string& q, At at) const;
  MlpActs mlp_acts(int64_t rows, int64_t f, kernels::DType dt) const;
  void mlp_forward(const MlpWeights& w, const std::string& q, const kernels::Tensor& x,
                   Linear& linear, MlpActs& a, kernels::Tensor& out) const;
  void mlp_backward(const MlpWeights& w, MlpGrads& g, const std::string& q,
                    const kernels::Tensor& dy, const kernels::Tensor& x, const MlpActs& a,
                    Linear& linear, kernels::Tensor& dx) const;
  void moe_forward(const LayerWeights& w, int64_t layer, Linear& linear, LayerActs& a,
                   kernels::Tensor& out) const;
  std::vector<kernels::Tensor> grouped_columnwise(const kernels::Tensor& x,
                                                  const moe::Dispatch& blocks, int64_t padding,
                                                  const std::string& linear,
                                                  Fp8Recipe& recipe) const;
  void moe_backward(const LayerWeights& w, LayerGrads& g, int64_t layer, Linear& linear,
                    const LayerActs& a, const kernels::Tensor& d_out, kernels::Tensor& d_ln2) const;
  void layer_forward(const LayerWeights& w, int64_t layer, const BatchCoords& coords, int64_t batch,
                     Linear& linear, LayerActs& a) const;
  void layer_backward(const LayerWeights& w, LayerGrads& g, int64_t layer,
                      const BatchCoords& coords, int64_t batch, Linear& linear, const LayerActs& a,
                      kernels::Tensor& dx) const;
  void norm_forward(const kernels::Tensor& x, const kernels::Tensor& w, const kernels::Tensor* b,
                    kernels::Tensor& y, kernels::Tensor& mean, kernels::Tensor& rstd) const;
  void norm_backward(const kernels::Tensor& dy, const kernels::Tensor& x, const kernels::Tensor& w,
                     const kernels::Tensor& mean, const kernels::Tensor& rstd, kernels::Tensor& dx,
                     kernels::Tensor& dw, kernels::Tensor* db) const;

  Config config_;
};

}  // namespace meshproof::engine
