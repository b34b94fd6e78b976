// The model's logical parameters (docs/design.md sections 3 and 20): names, global shapes, init,
// and the sharding plan as data. Each parameter's spec says, once, what the executor and the
// checkpoint code would otherwise recover from its name: its FSDP unit, its tensor-parallel style
// and, for the weight of a quantized linear layer, the linear's name and kind. The linear layers
// of a transformer block are written once, in block_linears(); param_specs() and the model's
// layer code (engine/model/model_layer.cc, model_mlp.cc) read them from there. The names are the
// checkpoint and export keys; a name-keyed tensor map holds weights, gradients and optimizer state
// alike.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/config/config.h"
#include "kernels/core/tensor.h"
#include "mesh/core/layout.h"

namespace meshproof::engine {

enum class InitKind : uint8_t { kNormal, kOnes, kZeros };

// FSDP unit of the parameters outside the transformer blocks (embeddings, final norm, lm_head);
// unit i >= 0 is layers.i (engine/model/model.h UnitHooks).
inline constexpr int64_t kRootUnit = -1;

// How a linear layer splits over the tp mesh dim (Megatron / torchtitan): column-parallel layers
// split their output features (weight rows), row-parallel layers their input features (weight
// columns) and all-reduce their output.
enum class LinearKind : uint8_t { kColumnParallel, kRowParallel };

// How one parameter is placed over the tp mesh dim (torchtitan's ColwiseParallel /
// RowwiseParallel plan): kColumn = Shard(0) over tp (a column-parallel layer's weight and bias;
// with FSDP the dp_shard placement becomes StridedShard(0, sf=tp)), kRow = Shard(1) over tp (a
// row-parallel layer's weight), kReplicated = the whole tensor on every tp rank (norms,
// embeddings, lm_head, row-parallel biases). engine/parallel/shard_plan.h turns a style and a mesh
// into placements. With model.vocab_parallel the vocabulary-row parameters (embed.tok,
// lm_head.weight) take kColumn too: Shard(0) over tp in torch.chunk rows, uneven vocabularies
// included (docs/design.md section 24).
enum class TpStyle : uint8_t { kReplicated, kColumn, kRow };

// The model dimension a linear layer's features are counted in.
// kQkv: the fused q/k/v rows (A + 2 KV) x d (3H without grouped-query attention).
enum class ModelDim : uint8_t { kHidden, kFfn, kQkv };

// Which activations a linear layer exists for.
enum class LinearUse : uint8_t { kAlways, kUngated, kGated };

// One linear layer of a transformer block: the table block_linears() returns and the single
// place the block's linear layers are written (docs/design.md section 20, "how to add a layer").
struct LinearLayer {
  std::string_view name = {};  // inside the block: "attn.qkv"; parameters "<name>.weight|bias"
  LinearKind kind = LinearKind::kColumnParallel;
  int64_t out_mult = 1;  // out features = out_mult x out_dim
  ModelDim out_dim = ModelDim::kHidden;
  ModelDim in_dim = ModelDim::kHidden;  // in features (the GEMM's K before tp splits it)
  bool residual_out = false;  // writes into the residual stream: init std 0.02 / sqrt(2 layers)
  std::string_view norm_before = {};  // the block norm emitted before it in canonical order, or ""
  LinearUse use = LinearUse::kAlways;
};

// The linear layers of one block for `model`'s activation, in forward (and canonical) order:
// attn.qkv, attn.proj, then mlp.fc1 (GELU/ReLU) or mlp.fc1_gate + mlp.fc1_up (SwiGLU), mlp.fc2.
std::vector<LinearLayer> block_linears(Activation activation);
// The size of `dim` in `model`.
int64_t model_dim(const ModelConfig& model, ModelDim dim);
// "hidden" / "ffn" (the config keys) / "qkv".
std::string_view model_dim_name(ModelDim dim);
// "column_parallel" / "row_parallel".
std::string_view linear_kind_name(LinearKind k);

// Which end of the model a root-unit parameter belongs to: the input (token and position
// embeddings) or the output (final norm, LM head). Pipeline stages place it by this
// (engine/parallel/shard_plan.h stage_holds): the first stage holds the input end, the last the
// output.
enum class ModelEnd : uint8_t { kInput, kOutput };

struct ParamSpec {
  std::string name;      // e.g. "layers.0.attn.qkv.weight"
  kernels::Shape shape;  // global (unsharded) shape
  InitKind init = InitKind::kZeros;
  double std = 0.0;  // for kNormal
  // --- the sharding plan (filled by param_specs) ---
  int64_t unit = kRootUnit;         // FSDP unit: the layer index, or kRootUnit
  ModelEnd end = ModelEnd::kInput;  // root-unit parameters only (layer parameters: unused)
  TpStyle tp = TpStyle::kReplicated;
  // The weight of a quantized linear layer: the linear as the recipe names it (the parameter
  // name without ".weight", e.g. "layers.0.attn.qkv", the name of its FP8 state keys and amax
  // hook calls) and its kind; "" for every other parameter.
  std::string linear;
  LinearKind linear_kind = LinearKind::kColumnParallel;
  bool vocab_rows = false;  // rows are the vocabulary (embed.tok, lm_head.weight)
  // The name whose Philox stream initialises it; "" = its own name. Expert 0 of an MoE layer
  // takes the stream of the dense MLP parameter it replaces (docs/design.md section 27).
  std::string init_stream;
  // Its compute copy stays float32 under every recipe (the MoE router; docs/design.md section 27).
  bool fp32_compute = false;
  // embed.tok of a model with tied embeddings: also the LM head's weight. Pipeline stages hold it
  // on the first and the last stage (docs/design.md section 33).
  bool tied_head = false;

  bool quantized() const { return !linear.empty(); }
  bool weight_decay() const { return shape.rank() >= 2; }  // AdamW decays ndim >= 2 only
};

// All parameters in canonical order: embed.tok, embed.pos, layers.{i}.*, final_ln.*, lm_head.
// Per block: ln1, then the block_linears() in order (weight, bias each), ln2 before the first MLP
// linear. RMSNorm drops the norm biases; tied embeddings drop lm_head.weight; model.bias = false
// drops the linear biases; RoPE drops embed.pos.
// MoE layers (docs/design.md section 27) replace the MLP linears by, after ln2:
// moe.router.weight [E, H], then per expert e moe.experts.{e}.<fc1 | fc1_gate, fc1_up>, fc2
// (weight, bias each), then moe.shared.* with model.moe.shared_expert.
std::vector<ParamSpec> param_specs(const ModelConfig& model);

// Tensors keyed by parameter name, iterated in canonical (insertion) order. Looked up by hash:
// the model and the FSDP executor look every weight and gradient up by name on every call, and an
// ordered map's compares of the long shared prefixes ("layers.3.mlp.") were about 4% of an 8-rank
// small-model run (docs/design.md section 36, fourth round).
class TensorMap {
 public:
  void insert(const std::string& name, kernels::Tensor t);
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Removes `name` (absent: no-op); references to other entries stay valid.
  void erase(const std::string& name);
  kernels::Tensor& at(const std::string& name);
  const kernels::Tensor& at(const std::string& name) const;
  const std::vector<std::string>& names() const { return names_; }
  void zero_all();

 private:
  std::vector<std::string> names_;
  std::unordered_map<std::string, kernels::Tensor> tensors_;
};

// The box `box` of parameter `spec` as float32 (shape box.shape()): the element with global flat
// index g gets std * philox_normal(seed, philox_stream(name), g) for normal init. Any shard can be
// materialised alone, generating only its own elements, and equals the same box of the whole
// tensor (a column shard of a row-parallel weight draws its columns, not whole rows).
// Boxes of 2^23 elements and more are drawn by several threads (init_threads), bitwise the same.
kernels::Tensor init_param_box(const ParamSpec& spec, uint64_t seed, const mesh::Box& box);
// The same with `threads` (>= 1) drawing threads, each a contiguous share of the box's rows.
kernels::Tensor init_param_box(const ParamSpec& spec, uint64_t seed, const mesh::Box& box,
                               int threads);
// How many threads draw a box of `elements` with `cpus` usable: one per 2^22 elements, at most
// `cpus` (and 64), at least one.
int init_threads(int64_t elements, int cpus);
// Rows [row_begin, row_end) of parameter `spec`: init_param_box over those rows, all columns.
kernels::Tensor init_param_rows(const ParamSpec& spec, uint64_t seed, int64_t row_begin,
                                int64_t row_end);
// Every parameter, whole, in float32 on the CPU.
TensorMap init_params(const ModelConfig& model, uint64_t seed);
// Zero tensors with the parameters' shapes (gradients, optimizer moments), float32.
TensorMap zeros_like_params(const ModelConfig& model);

}  // namespace meshproof::engine
