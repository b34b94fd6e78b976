#include "engine/session.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>

#include "engine/data.h"
#include "engine/fp8_all_gather.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "engine/params.h"
#include "engine/recipe.h"
#include "engine/run_rules.h"
#include "kernels/adamw.h"
#include "kernels/cast.h"
#include "kernels/device.h"
#include "kernels/elementwise.h"
#include "kernels/error.h"
#include "kernels/formats.h"
#include "kernels/quantize.h"
#include "mesh/local_comm.h"
#include "mesh/mpi_comm.h"
#include "mesh/nccl_comm.h"
#include "mesh/split_comm.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::Shape;
using kernels::Tensor;
using mesh::Box;
using mesh::DimSet;
using mesh::Layout;
using mesh::MeshDim;
using mesh::Placement;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

Tensor host_empty(const Shape& s, DType dt) { return Tensor::empty(s, dt, kernels::Device::cpu()); }
Tensor host_zeros(const Shape& s, DType dt) { return Tensor::zeros(s, dt, kernels::Device::cpu()); }

// Elements [begin, begin + n) of a dense tensor's flat storage, as a tensor of `shape`.
Tensor flat_slice(const Tensor& t, int64_t begin, const Shape& shape) {
  const int64_t n = shape.numel().value;
  if (n == 0) return host_empty(shape, t.dtype());
  return t.view({t.numel().value}).slice_rows(begin, begin + n).view(shape);
}

// The box of the tensor each rank computes with: the layout with every data-parallel placement
// replaced by Replicate (what the all-gather over dp_shard reassembles).
Box compute_box(const Layout& layout, int rank) {
  std::vector<Placement> p = layout.placements();
  p[static_cast<size_t>(MeshDim::kDpReplicate)] = Placement::replicate();
  p[static_cast<size_t>(MeshDim::kDpShard)] = Placement::replicate();
  return Layout(layout.mesh(), layout.global_shape(), p).box(rank);
}

// The largest local element count over the members of `comm` (the padded chunk size).
int64_t padded_numel(const mesh::Communicator& comm, const Layout& layout) {
  int64_t n = 0;
  for (int r : comm.ranks()) n = std::max(n, layout.box(r).numel().value);
  return n;
}

// Reassembles `target` (a box of the global tensor covered by the members' boxes) from the
// members' local tensors: each member's local tensor is padded with zeros to the largest member
// size, the padded buffers are all-gathered, and only each member's real box is copied out, so
// the padding never reaches the result.
Tensor gather_box(mesh::Communicator& comm, const Layout& layout, const Tensor& local,
                  const Box& target) {
  const int64_t chunk = padded_numel(comm, layout);
  Tensor out = host_empty(target.shape(), DType::kFloat32);
  if (comm.size() == 1) {
    mesh::copy_region(local, layout.box(comm.ranks()[0]), out, target, target);
    return out;
  }
  Tensor send = host_zeros({std::max<int64_t>(chunk, 1)}, DType::kFloat32);
  if (local.numel().value > 0) std::memcpy(send.raw_data(), local.raw_data(), local.nbytes().value);
  Tensor recv = host_empty({comm.size() * send.numel().value}, DType::kFloat32);
  comm.all_gather(send, recv);
  for (int s = 0; s < comm.size(); ++s) {
    const Box& b = layout.box(comm.ranks()[static_cast<size_t>(s)]);
    const Box region = b.intersect(target);
    if (region.empty()) continue;
    const Tensor member = flat_slice(recv, s * send.numel().value, b.shape());
    mesh::copy_region(member, b, out, target, region);
  }
  return out;
}

// The inverse: `full` holds box `source` on every member (each member's own contribution);
// member s receives the reduction (op) of everybody's copy of its box. Each member's box is cut
// out and padded to the largest member size, then reduce-scattered.
Tensor reduce_scatter_box(mesh::Communicator& comm, const Layout& layout, const Tensor& full,
                          const Box& source, mesh::ReduceOp op) {
  const Box& mine = layout.box(comm.ranks()[static_cast<size_t>(comm.rank())]);
  Tensor out = host_empty(mine.shape(), DType::kFloat32);
  if (comm.size() == 1) {
    mesh::copy_region(full, source, out, mine, mine);
    return out;
  }
  const int64_t chunk = std::max<int64_t>(padded_numel(comm, layout), 1);
  Tensor send = host_zeros({comm.size() * chunk}, DType::kFloat32);
  for (int s = 0; s < comm.size(); ++s) {
    const Box& b = layout.box(comm.ranks()[static_cast<size_t>(s)]);
    if (b.empty()) continue;
    Tensor piece = flat_slice(send, s * chunk, b.shape());
    mesh::copy_region(full, source, piece, b, b);
  }
  Tensor recv = host_empty({chunk}, DType::kFloat32);
  comm.reduce_scatter(send, recv, op);
  if (mine.numel().value > 0) std::memcpy(out.raw_data(), recv.raw_data(), out.nbytes().value);
  return out;
}

// Sum of one double per member, identical on every member (gathered, then summed in rank order).
double sum_doubles(mesh::Communicator& comm, double v) {
  if (comm.size() == 1) return v;
  Tensor send = Tensor::from_vector<double>({1}, {v});
  Tensor recv = host_empty({comm.size()}, DType::kFloat64);
  comm.all_gather(send, recv);
  double s = 0;
  for (int i = 0; i < comm.size(); ++i) s += recv.data<double>()[i];
  return s;
}

// Every member's `v` (same length on all members), concatenated in rank order.
std::vector<double> gather_doubles(mesh::Communicator& comm, const std::vector<double>& v) {
  if (comm.size() == 1) return v;
  const int64_t n = static_cast<int64_t>(v.size());
  Tensor send = Tensor::from_vector<double>({n}, v);
  Tensor recv = host_empty({comm.size() * n}, DType::kFloat64);
  comm.all_gather(send, recv);
  return recv.to_vector<double>();
}

// uneven_shard_padding_leak (fault): the dp_shard all-gather's padded receive buffer used as the
// weight without cutting the padding off. torch.chunk makes only trailing chunks short, so each
// member's real rows sit at member * chunk_rows and the buffer viewed as [members * chunk_rows,
// cols] is the real weight followed by zero rows. For Shard(0) weights whose members span all
// columns of `target` (the TP-replicated embedding and lm_head).
Tensor gather_keeping_padding(mesh::Communicator& comm, const Layout& layout, const Tensor& local,
                              const Box& target) {
  const int64_t cols = target.extent[1].value;
  int64_t chunk_rows = 0;
  for (int r : comm.ranks()) chunk_rows = std::max(chunk_rows, layout.box(r).extent[0].value);
  for (int s = 0; s < comm.size(); ++s) {
    const Box& b = layout.box(comm.ranks()[static_cast<size_t>(s)]);
    MP_CHECK(b.empty() || (b.extent[1].value == cols && b.offset[0].value == s * chunk_rows),
             "padded gather: box {} of member {} is not the torch.chunk row chunk of {}", b.str(),
             s, target.str());
  }
  Tensor send = host_zeros({chunk_rows * cols}, local.dtype());
  if (local.numel().value > 0) std::memcpy(send.raw_data(), local.raw_data(), local.nbytes().value);
  Tensor recv = host_empty({comm.size() * chunk_rows * cols}, local.dtype());
  comm.all_gather(send, recv);
  return recv.view({comm.size() * chunk_rows, cols});
}

uint64_t fnv1a(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

TensorDigest digest(const std::string& name, const Tensor& t) {
  TensorDigest d;
  d.name = name;
  d.shape = t.shape();
  d.hash = fnv1a(t.raw_data(), static_cast<size_t>(t.nbytes().value));
  const float* x = t.data<float>();
  d.values.assign(x, x + t.numel().value);
  for (int64_t i = 0; i < t.numel().value; ++i) {
    d.sum += x[i];
    d.l2 += static_cast<double>(x[i]) * x[i];
  }
  d.l2 = std::sqrt(d.l2);
  return d;
}

// `t` as fp32 values on the host (--trace of the FP8 state): fp32 as it is; FP8 codes and e8m0
// scales decoded to the value each code stands for (not dequantized by a scale), so two runs'
// FP8 bytes compare element by element.
Tensor host_fp32(const Tensor& t) {
  const Tensor h = t.device().is_cpu() ? t : t.to(kernels::Device::cpu());
  if (h.dtype() == DType::kFloat32) return h;
  Tensor out = host_empty(h.shape(), DType::kFloat32);
  float* o = out.data<float>();
  const int64_t n = h.numel().value;
  const auto* b = static_cast<const uint8_t*>(h.raw_data());
  switch (h.dtype()) {
    case DType::kE4M3:
      for (int64_t i = 0; i < n; ++i) o[i] = kernels::fmt8::e4m3_to_float(b[i]);
      break;
    case DType::kE5M2:
      for (int64_t i = 0; i < n; ++i) o[i] = kernels::fmt8::e5m2_to_float(b[i]);
      break;
    case DType::kE8M0:
      for (int64_t i = 0; i < n; ++i) o[i] = kernels::fmt8::e8m0_to_float(b[i]);
      break;
    default:
      MP_FAIL("trace: FP8 state tensor of dtype {} {} has no fp32 reading",
              kernels::dtype_name(h.dtype()), h.shape().str());
  }
  return out;
}

// The same quantized tensor with every buffer on `device` (a copy where it is elsewhere).
kernels::QuantizedTensor quantized_on(kernels::QuantizedTensor q, kernels::Device device) {
  for (Tensor* t : {&q.rowwise_data, &q.rowwise_scale_inv, &q.columnwise_data,
                    &q.columnwise_scale_inv, &q.amax, &q.scale})
    if (t->defined() && t->device() != device) *t = t->to(device);
  return q;
}

Tensor on_device(const Tensor& t, kernels::Device device) {
  return t.device() == device ? t : t.to(device);
}

const DimSet kShard{MeshDim::kDpShard};
const DimSet kReplicate{MeshDim::kDpReplicate};
const DimSet kTp{MeshDim::kTp};
const DimSet kData{MeshDim::kDpReplicate, MeshDim::kDpShard};
const DimSet kWorld{MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kTp};
// Every non-empty group (collective statistics: the amax groups may be any of them).
const std::vector<DimSet> kAllGroups = [] {
  std::vector<DimSet> g;
  for (unsigned bits = 1; bits < (1u << mesh::kNumMeshDims); ++bits)
    g.push_back(DimSet::from_bits(bits));
  return g;
}();

}  // namespace

// ---------------------------------------------------------------------------------------------

struct TrainingSession::Impl {
  struct Param {
    ParamSpec spec;
    Layout layout;   // master / moments / gradient shard layout
    Box compute;     // box of the compute tensor after the dp_shard gather
    Tensor master;   // fp32, layout.box(rank)
    Tensor exp_avg;  // fp32, same
    Tensor exp_avg_sq;
    Tensor grad;               // fp32, same (reduced gradient of the last step)
    int64_t unit = kRootUnit;  // FSDP unit: layer index, or kRootUnit
    std::string linear;        // quantized linear of a GEMM weight ("layers.0.attn.qkv"), or ""
    Fp8Shard fp8;              // fsdp.fp8_params: the FP8 primary weight shard (rows of `layout`)
  };

  // The model's per-unit hooks (engine/model.h UnitHooks), forwarded to the session.
  struct Units : UnitHooks {
    Impl* impl = nullptr;
    void before(int64_t unit, Pass pass) override { impl->unit_before(unit, pass); }
    void after(int64_t unit, Pass pass) override { impl->unit_after(unit, pass); }
  };

  RunOptions options;
  const Config& config;
  // Where the model computes (options.backend). The fp32 masters, AdamW moments, reduced
  // gradients and the data-parallel collectives stay on the host; gathered weights go to the
  // compute device and the unsharded gradients come back for the reduce-scatter.
  kernels::Device device;
  mesh::RankComms& comms;
  mesh::DeviceMesh mesh;
  int rank;
  GptModel model;
  MarkovSource data;
  Fp8Recipe recipe;
  std::vector<Param> params;
  ShardedState state;
  bool fp8_gather = false;                       // FP8 all-gather of the linear layers' weights
  bool fp8_params = false;                       // FP8 primary weights (fsdp.fp8_params)
  std::map<int64_t, std::vector<size_t>> units;  // FSDP unit -> indices into params
  Units hooks;
  // Per step: gathered compute weights and unsharded fp32 gradients of the units in use, the
  // FP8-quantized local shards (quantized once per step, gathered at every use), and the bytes
  // of gathered weights currently held.
  TensorMap weights, grads;
  std::map<size_t, Fp8Shard> step_shards;
  std::map<std::string, int64_t> gathered_bytes;
  int64_t gathered_now = 0;
  bool first_micro_batch = false, last_micro_batch = false;
  int64_t step = 0;    // optimizer steps taken
  int64_t cursor = 0;  // next global batch
  std::vector<std::string> notes;
  StepTime time;
  MemoryBreakdown mem;
  // options.allgather_parity, kept on rank 0 (launcher mpi: on every process)
  std::vector<AllGatherParity> parity;

  Impl(const RunOptions& o, mesh::RankComms& c)
      : options(o),
        config(options.config),
        // The rank's own device: cuda:0 for virtual ranks, the process's GPU under mpi.
        device(options.backend.is_cuda() ? kernels::current_context().device
                                         : kernels::Device::cpu()),
        comms(c),
        mesh(c.mesh()),
        rank(c.rank()),
        model(options.config),
        data(config.model.vocab, config.data, config.training.batch, config.training.seq_len),
        recipe(config.recipe, [this](const std::string& linear, Fp8Role role, float* amax,
                                     int64_t n) { reduce_amax(linear, role, amax, n); }) {
    // The input rules (engine/run_rules.h check_run) ran in TrainingSession's constructor,
    // before any member allocated.
    const MeshSpec& ms = options.mesh;
    MP_CHECK_INPUT(mesh == ms.device_mesh(),
                   "session: communicators are for mesh {}, options ask {}", mesh.str(),
                   ms.device_mesh().str());
    const RecipeKind rk = config.recipe.kind;
    fp8_params = options.fsdp.fp8_params;
    // stale_columnwise_copy (fault) needs the executor to hold the quantized weights, so it also
    // takes the FP8 all-gather path (bitwise equal to the high-precision gather, see tests).
    // FP8 primary weights are gathered as FP8 (there is no high-precision compute copy).
    fp8_gather =
        (options.fsdp.fp8_all_gather || options.faults.stale_columnwise_copy || fp8_params) &&
        (rk == RecipeKind::kCurrent || rk == RecipeKind::kDelayed || rk == RecipeKind::kMxfp8);
    if (options.fsdp.fp8_all_gather && !fp8_gather)
      notes.push_back(
          fmt::format("fsdp.fp8_all_gather has no effect with recipe {}: weights are "
                      "gathered in high precision",
                      recipe_name(rk)));

    for (const ParamSpec& s : param_specs(config.model)) {
      Layout layout(mesh, s.shape, placements(s.name, ms.tp));
      const Box& b = layout.box(rank);
      Param prm{s, layout, compute_box(layout, rank), {}, {}, {}, {}, kRootUnit, "", {}};
      // Philox init keyed by global element index: materialise only the rows of this box.
      prm.master = host_empty(b.shape(), DType::kFloat32);
      if (!b.empty()) {
        const int64_t r0 = b.offset[0].value, r1 = r0 + b.extent[0].value;
        const Tensor rows = init_param_rows(s, config.seed, r0, r1);
        Box rows_box = Box::whole(s.shape);
        rows_box.offset[0] = b.offset[0];
        rows_box.extent[0] = b.extent[0];
        mesh::copy_region(rows, rows_box, prm.master, b, b);
      }
      prm.exp_avg = host_zeros(b.shape(), DType::kFloat32);
      prm.exp_avg_sq = host_zeros(b.shape(), DType::kFloat32);
      prm.grad = host_zeros(b.shape(), DType::kFloat32);
      if (s.name.starts_with("layers.")) prm.unit = std::stoll(s.name.substr(7));
      prm.linear = quantized_linear(s.name);
      units[prm.unit].push_back(params.size());
      params.push_back(std::move(prm));
    }
    if (rk == RecipeKind::kMxfp8) check_mxfp8_shapes();
    hooks.impl = this;
    for (Param& p : params) {
      const Layout& described = state_layout(p);
      state.entries.push_back({"model/" + p.spec.name, described, p.master});
      state.entries.push_back({"optim/" + p.spec.name + "/exp_avg", described, p.exp_avg});
      state.entries.push_back({"optim/" + p.spec.name + "/exp_avg_sq", described, p.exp_avg_sq});
    }
    // Delayed-scaling states exist from the start (the recipe would create them at the first
    // quantization) so that the state entries cover them before step 0 and a checkpoint loaded
    // before the first step writes into the live tensors.
    if (config.recipe.kind == RecipeKind::kDelayed) {
      std::vector<std::string> linears;
      for (int64_t i = 0; i < config.model.layers; ++i) {
        const std::string p = fmt::format("layers.{}.", i);
        linears.push_back(p + "attn.qkv");
        linears.push_back(p + "attn.proj");
        if (config.model.activation == Activation::kSwiGlu) {
          linears.push_back(p + "mlp.fc1_gate");
          linears.push_back(p + "mlp.fc1_up");
        } else {
          linears.push_back(p + "mlp.fc1");
        }
        linears.push_back(p + "mlp.fc2");
      }
      for (const std::string& l : linears)
        for (const char* role : {"input", "weight", "grad_output"})
          recipe.delayed_states().emplace(
              l + "/" + role,
              kernels::make_delayed_scaling_state(config.recipe.amax_history_len, device));
    }
    // Delayed-scaling states are replicated: every rank holds the reduced amax history.
    for (auto& [name, st] : recipe.delayed_states()) {
      const std::vector<Placement> rep(3, Placement::replicate());
      state.entries.push_back(
          {"fp8/" + name + "/scale", Layout(mesh, st.scale.shape(), rep), st.scale});
      state.entries.push_back({"fp8/" + name + "/amax_history",
                               Layout(mesh, st.amax_history.shape(), rep), st.amax_history});
    }
    if (fp8_params) make_fp8_params();
    store_scalars();
    for (const Param& p : params) {
      mem.params += p.master.nbytes().value + fp8_bytes(p.fp8);
      mem.grads += p.grad.nbytes().value;
      mem.optimizer += p.exp_avg.nbytes().value + p.exp_avg_sq.nbytes().value;
    }
  }

  // MXFP8 quantizes 1x32 and 32x1 blocks of every GEMM operand. engine/config.cc validates the
  // single-rank shapes; on a mesh the operands are this data rank's micro-batch tokens (M of the
  // inputs and output gradients) and the TP-local weight boxes (their dims are the N and K of
  // every operand), so both must stay multiples of 32. Checked up front: an input error naming
  // the mesh rather than a quantization failure in the middle of the first step.
  void check_mxfp8_shapes() const {
    const TrainingConfig& t = config.training;
    const int64_t dp = mesh.group_size(kData);
    const int64_t tokens = t.batch / (dp * t.micro_batches) * t.seq_len;
    MP_CHECK_INPUT(tokens % 32 == 0,
                   "recipe = mxfp8 on mesh {}: each data-parallel rank's micro-batch has "
                   "training.batch / ({} data-parallel ranks x training.micro_batches = {}) x "
                   "training.seq_len = {} tokens, not a multiple of 32",
                   mesh.str(), dp, t.micro_batches, tokens);
    for (const Param& p : params) {
      if (p.linear.empty()) continue;
      const Shape s = p.compute.shape();
      MP_CHECK_INPUT(s[0] % 32 == 0 && s[1] % 32 == 0,
                     "recipe = mxfp8 on mesh {}: the tensor-parallel shard of {} {} is {}, whose "
                     "dims must be multiples of 32 (mesh.tp = {})",
                     mesh.str(), p.spec.name, p.spec.shape.str(), s.str(), options.mesh.tp);
    }
  }

  // docs/design.md section 5: column-parallel qkv/fc1 Shard(0) over tp, with FSDP StridedShard(0,
  // sf=tp) over dp_shard so that dp_shard ranks hold pieces of their own TP shard; row-parallel
  // proj/fc2 weights Shard(1) over tp; everything else replicated over tp; Shard(0) over dp_shard
  // and Replicate over dp_replicate.
  std::vector<Placement> placements(const std::string& name, int tp) const {
    std::vector<Placement> p(3, Placement::replicate());
    p[static_cast<size_t>(MeshDim::kDpShard)] = Placement::shard(0);
    if (tp == 1) return p;
    const bool column =
        name.find(".attn.qkv.") != std::string::npos || name.find(".mlp.fc1") != std::string::npos;
    const bool row = name.ends_with(".attn.proj.weight") || name.ends_with(".mlp.fc2.weight");
    if (column) {
      p[static_cast<size_t>(MeshDim::kTp)] = Placement::shard(0);
      if (mesh.size(MeshDim::kDpShard) > 1)
        p[static_cast<size_t>(MeshDim::kDpShard)] = Placement::strided_shard(0, tp);
    } else if (row) {
      p[static_cast<size_t>(MeshDim::kTp)] = Placement::shard(1);
    }
    return p;
  }

  // The layout a parameter's checkpoint entries describe: its own, except under the
  // tp_fsdp_left_to_right fault, where the shards are the strided ones but the state describes
  // them as Shard(0) over dp_shard then tp (left to right), so a checkpoint puts their rows at the
  // wrong global offsets (visible when it is loaded on another mesh).
  std::vector<Layout> described_layouts;  // per param, filled on first use
  const Layout& state_layout(const Param& p) {
    const size_t i = static_cast<size_t>(&p - params.data());
    if (described_layouts.size() < params.size()) {
      described_layouts.clear();
      for (const Param& q : params) {
        Layout described = q.layout;
        if (options.faults.tp_fsdp_left_to_right &&
            q.layout.placement(MeshDim::kDpShard).kind == Placement::Kind::kStridedShard) {
          std::vector<Placement> pl = q.layout.placements();
          pl[static_cast<size_t>(MeshDim::kDpShard)] = Placement::shard(0);
          Layout l2r(mesh, q.spec.shape, pl);
          if (l2r.box(rank).shape() == q.layout.box(rank).shape()) described = l2r;
        }
        described_layouts.push_back(described);
      }
    }
    return described_layouts[i];
  }

  // stale_columnwise_copy (fault): from faults.from_step on, backward (dgrad) uses the columnwise
  // copy of the weight quantized before the previous optimizer step instead of this step's.
  // The weight is gathered once or twice per step (reshard_after_forward): the copy of the
  // previous step is the one recorded at the first gather of that step.
  struct ColumnwiseCopies {
    int64_t step = -1;                  // step of `current`
    std::pair<Tensor, Tensor> current;  // data, scale_inv
    std::pair<Tensor, Tensor> previous;
    bool has_previous = false;
  };
  std::map<std::string, ColumnwiseCopies> columnwise_copies;  // by linear
  void stale_columnwise(const std::string& linear, kernels::QuantizedTensor& w) {
    const int64_t layer = options.faults.stale_columnwise_layer;
    const bool this_layer = layer < 0 || linear.starts_with(fmt::format("layers.{}.", layer));
    ColumnwiseCopies& c = columnwise_copies[linear];
    if (c.step != step) {
      if (c.step >= 0) {
        c.previous = c.current;
        c.has_previous = true;
      }
      c.current = {w.columnwise_data, w.columnwise_scale_inv};
      c.step = step;
    }
    if (this_layer && options.faults.active(step) && c.has_previous) {
      w.columnwise_data = c.previous.first;
      w.columnwise_scale_inv = c.previous.second;
    }
  }

  bool rk_delayed() const { return config.recipe.kind == RecipeKind::kDelayed; }
  // "layers.0.attn.qkv" for the weight of a quantized linear layer, "" otherwise: the parameter
  // name without ".weight", the name every FP8 state key and amax hook call uses.
  static std::string quantized_linear(const std::string& name) {
    for (const char* l : {".attn.qkv.weight", ".attn.proj.weight", ".mlp.fc1.weight",
                          ".mlp.fc1_gate.weight", ".mlp.fc1_up.weight", ".mlp.fc2.weight"})
      if (name.ends_with(l)) return name.substr(0, name.size() - std::string(".weight").size());
    return "";
  }

  void store_scalars() {
    state.scalars["optim/step"] = step;
    state.scalars["data/cursor"] = cursor;
    state.scalars["rng/offset"] = cursor;
    state.scalars["lr/step"] = step;
  }
  void load_scalars() {
    step = state.scalars.at("optim/step");
    cursor = state.scalars.at("data/cursor");
  }

  // FP8 amax reduction (docs/design.md sections 4 and 5): each amax the recipe records is
  // MAX-reduced over the group of the ranks that hold a piece of its tensor (engine/amax_groups.h:
  // weights over dp_shard + tp, activations and gradients over the data dims plus tp where the
  // tensor is split over tp), looked up per linear and role in the default table or
  // options.amax_groups. Every rank therefore quantizes with the single-rank scales.
  // amax_not_reduced (fault): while active every tensor's group is empty (no reduction): each
  // rank scales by its own piece.
  DimSet amax_dims(const std::string& linear, Fp8Role role) const {
    if (options.faults.amax_not_reduced && options.faults.active(step)) return DimSet{};
    return amax_group({linear_kind(linear), role}, options.mesh, options.amax_groups);
  }
  void reduce_amax(const std::string& linear, Fp8Role role, float* amax, int64_t n) {
    mesh::Communicator& group = comms.group(amax_dims(linear, role));
    if (group.size() == 1) return;
    Tensor buf = Tensor::from_vector<float>({n}, std::vector<float>(amax, amax + n));
    group.all_reduce(buf, mesh::ReduceOp::kMax);
    std::memcpy(amax, buf.raw_data(), static_cast<size_t>(n) * sizeof(float));
  }

  // Seconds spent in every collective of every group so far (all kinds together).
  double all_collective_seconds() {
    double total = 0;
    for (const auto& [kind, seconds] : collective_seconds()) total += seconds;
    return total;
  }

  std::map<std::string, double> collective_seconds() {
    std::map<std::string, double> s;
    for (DimSet d : kAllGroups) {
      mesh::Communicator& c = comms.group(d);
      for (int k = 0; k < mesh::kNumCollectiveKinds; ++k) {
        const auto kind = static_cast<mesh::CollectiveKind>(k);
        s[std::string(mesh::collective_name(kind))] += c.stats(kind).seconds;
      }
    }
    return s;
  }

  // allgather_parity: the FP8 all-gathered weight against quantize(gather(shard)) on every rank
  // (fp8_all_gather_parity, same inputs). Rank 0 (launcher mpi: every process) keeps one record
  // per weight and step with the byte counts summed over all ranks, so that a rank whose copy
  // differs cannot hide, and the largest error; scale_inv values are the keeping rank's.
  void record_parity(const Param& p, const Tensor& local, const Tensor* scale,
                     const kernels::QuantizedTensor& gathered) {
    // The reference's amax group is the default weight group, whatever the run's table says:
    // the reference is the single-rank quantization.
    const DimSet ref_group =
        default_amax_group({linear_kind(p.linear), Fp8Role::kWeight}, options.mesh);
    AllGatherParity r = fp8_all_gather_parity(comms.group(kShard), comms.group(ref_group), p.layout,
                                              local, p.compute, config.recipe.kind, scale, gathered,
                                              current_scale_options());
    const std::vector<double> all = gather_doubles(
        comms.group(kWorld),
        {static_cast<double>(r.bytes), static_cast<double>(r.mismatched_bytes), r.max_abs_error});
    r.step = step;
    r.tensor = p.spec.name;
    r.bytes = r.mismatched_bytes = 0;
    for (size_t i = 0; i < all.size(); i += 3) {
      r.bytes += static_cast<int64_t>(all[i]);
      r.mismatched_bytes += static_cast<int64_t>(all[i + 1]);
      r.max_abs_error = std::max(r.max_abs_error, all[i + 2]);
    }
    if (rank == 0 || options.launcher == "mpi") parity.push_back(std::move(r));
    const std::string note =
        "allgather_parity: the reference high-precision gathers are counted in the collective "
        "figures";
    if (std::find(notes.begin(), notes.end(), note) == notes.end()) notes.push_back(note);
  }

  // uneven_shard_padding_leak (fault): the vocabulary-sized weights (embed.tok, lm_head.weight)
  // keep the zero rows that pad uneven dp_shard chunks, so the logits gain zero classes.
  bool padding_leaks(const Param& p) const {
    return options.faults.uneven_shard_padding_leak && options.faults.active(step) &&
           (p.spec.name == "embed.tok" || p.spec.name == "lm_head.weight");
  }

  // --- FSDP units (engine/model.h UnitHooks) -------------------------------------------------

  // Gathers the compute weights of `unit` that are not held (before its first use in a pass)
  // and, in the backward, makes its gradient accumulators available.
  void unit_before(int64_t unit, Pass pass) {
    for (size_t i : units.at(unit)) {
      const Param& p = params[i];
      if (!weights.contains(p.spec.name)) gather_weight(i);
      // The gradient has the gathered weight's shape (uneven_shard_padding_leak: with the rows
      // of the padding, dropped before the reduce-scatter).
      if (pass == Pass::kBackward && !grads.contains(p.spec.name))
        grads.insert(p.spec.name,
                     Tensor::zeros(weights.at(p.spec.name).shape(), DType::kFloat32, device));
    }
  }

  // After the forward of a layer: free its gathered weights (reshard_after_forward; the backward
  // gathers them again) or keep them. After the backward of a unit: free its weights and, after
  // the last micro-batch (deferred sync), reduce its gradients.
  void unit_after(int64_t unit, Pass pass) {
    const bool keep =
        pass == Pass::kForward && unit != kRootUnit && !options.fsdp.reshard_after_forward;
    if (!keep) release_weights(unit);
    if (pass == Pass::kBackward && (last_micro_batch || options.fsdp.sync_each_micro_batch))
      reduce_gradients(unit);
  }

  void gather_weight(size_t i) {
    const Param& p = params[i];
    mesh::Communicator& shard = comms.group(kShard);
    int64_t bytes = 0;
    if (fp8_gather && !p.linear.empty()) {
      // FP8 all-gather: gather the FP8 bytes + scales of the local shard, quantized once per
      // step (or held as the FP8 primary weight).
      const Fp8Shard& local = fp8_shard(i);
      Fp8GatherResult g = gather_shard(shard, p.layout, local, p.compute, config.recipe.kind);
      // The shard's high-precision values: the fp32 master of an FP8 primary weight, else the
      // bf16 compute copy that was quantized.
      const Tensor& hp = fp8_params                      ? p.master
                         : local.high_precision_fallback ? local.high_precision
                                                         : step_hp.at(i);
      if (options.allgather_parity)
        record_parity(p, hp, rk_delayed() ? &local.q.scale : nullptr, g.weight);
      if (g.high_precision_fallback && std::find(notes.begin(), notes.end(), g.note) == notes.end())
        notes.push_back(g.note);
      bytes = g.weight.rowwise_data.nbytes().value + g.weight.columnwise_data.nbytes().value;
      if (options.faults.stale_columnwise_copy) stale_columnwise(p.linear, g.weight);
      // The amax of the shard's high-precision values (recorded by delayed scaling).
      const Tensor amax = kernels::compute_amax(hp);
      recipe.set_prequantized_weight(p.linear, quantized_on(std::move(g.weight), device),
                                     on_device(amax, device));
      // The layer code reads only the shape of a prequantized weight.
      weights.insert(p.spec.name, Tensor::empty(p.compute.shape(), DType::kBFloat16, device));
    } else {
      Tensor full = padding_leaks(p) ? gather_keeping_padding(shard, p.layout, p.master, p.compute)
                                     : gather_box(shard, p.layout, p.master, p.compute);
      if (config.recipe.kind != RecipeKind::kFp32) full = kernels::cast_to(full, DType::kBFloat16);
      bytes = full.nbytes().value;
      weights.insert(p.spec.name, on_device(full, device));
    }
    gathered_bytes[p.spec.name] = bytes;
    gathered_now += bytes;
    mem.gathered_weights = std::max(mem.gathered_weights, gathered_now);
  }

  void release_weights(int64_t unit) {
    for (size_t i : units.at(unit)) {
      const Param& p = params[i];
      if (!weights.contains(p.spec.name)) continue;
      weights.erase(p.spec.name);
      gathered_now -= gathered_bytes.at(p.spec.name);
      if (!p.linear.empty()) recipe.clear_prequantized_weight(p.linear);
    }
  }

  // The local shard of GEMM weight i quantized for the FP8 all-gather: the FP8 primary weight,
  // or the bf16 compute copy of the master shard quantized at its first gather of the step (the
  // amax group is the weight's, as for the recipe's own weight quantization, reduce_amax).
  std::map<size_t, Tensor> step_hp;  // bf16 compute copies of the shards in step_shards
  const Fp8Shard& fp8_shard(size_t i) {
    const Param& p = params[i];
    if (fp8_params) return p.fp8;
    auto it = step_shards.find(i);
    if (it != step_shards.end()) return it->second;
    Tensor local = kernels::cast_to(p.master, DType::kBFloat16);
    Fp8Shard q = quantize_local(p, local);
    step_hp[i] = std::move(local);
    return step_shards.emplace(i, std::move(q)).first->second;
  }

  Fp8Shard quantize_local(const Param& p, const Tensor& local) {
    // The shard is quantized on the host, next to its master: the delayed scale comes along.
    // A copy of the delayed scale: the recipe updates its state in place after the forward, while
    // the shard keeps the scale it was quantized with (q.scale, allgather_parity's reference for
    // the backward re-gather).
    Tensor scale;
    if (rk_delayed())
      scale = recipe.delayed_states().at(p.linear + "/weight").scale.to(kernels::Device::cpu());
    // Current scaling MAX-reduces the shard's amax over the weight's amax group (empty under the
    // amax_not_reduced fault).
    return quantize_shard(comms.group(kShard), comms.group(amax_dims(p.linear, Fp8Role::kWeight)),
                          p.layout, local, p.compute, config.recipe.kind,
                          scale.defined() ? &scale : nullptr, true, current_scale_options());
  }
  // Weight scales of current scaling follow the recipe's eps and power-of-2 option, as in
  // Fp8Recipe::quantize.
  CurrentScaleOptions current_scale_options() const {
    return {.eps = static_cast<float>(config.recipe.eps), .pow2 = power_2_scale_of(config.recipe)};
  }

  // Reduce-scatter (avg) over dp_shard, then all-reduce (avg) over dp_replicate (HSDP), of the
  // unit's accumulated gradients; the unsharded gradients are freed. With
  // fsdp.sync_each_micro_batch this runs after every micro-batch and the reduced shards of the
  // micro-batches after the first are added to p.grad (the next micro-batch's backward starts
  // from fresh zero gradients).
  void reduce_gradients(int64_t unit) {
    mesh::Communicator& shard = comms.group(kShard);
    mesh::Communicator& replicate = comms.group(kReplicate);
    const bool skip_replicas =
        options.faults.hsdp_replicas_not_reduced && options.faults.active(step);
    // Sequence parallelism: gradients of TP-replicated parameters are partial sums over the
    // sequence shards of the tp ranks.
    const bool sp = options.mesh.sequence_parallel && mesh.size(MeshDim::kTp) > 1;
    for (size_t i : units.at(unit)) {
      Param& p = params[i];
      Tensor& g = grads.at(p.spec.name);
      if (sp && !p.layout.placement(MeshDim::kTp).is_shard())
        comms.group(kTp).all_reduce(g, mesh::ReduceOp::kSum);
      // uneven_shard_padding_leak: the gradient rows of the padding are dropped here.
      const Tensor real = g.shape()[0] == p.compute.extent[0].value
                              ? g
                              : g.slice_rows(0, p.compute.extent[0].value);
      Tensor reduced = reduce_scatter_box(shard, p.layout, on_device(real, kernels::Device::cpu()),
                                          p.compute, mesh::ReduceOp::kAvg);
      if (replicate.size() > 1 && !skip_replicas && reduced.numel().value > 0)
        replicate.all_reduce(reduced, mesh::ReduceOp::kAvg);
      if (!options.fsdp.sync_each_micro_batch || first_micro_batch || reduced.numel().value == 0) {
        p.grad = std::move(reduced);
      } else {
        kernels::add_(p.grad, reduced);
      }
      grads.erase(p.spec.name);
    }
  }

  // --- FP8 primary weights (fsdp.fp8_params) -------------------------------------------------

  static int64_t fp8_bytes(const Fp8Shard& f) {
    int64_t n = 0;
    for (const Tensor* t : {&f.q.rowwise_data, &f.q.rowwise_scale_inv, &f.q.columnwise_data,
                            &f.q.columnwise_scale_inv})
      if (t->defined()) n += t->nbytes().value;
    return n;
  }

  // Quantizes every GEMM weight's master shard into its FP8 primary weight and adds the FP8
  // bytes and scales to the checkpoint state (a resumed run computes with the loaded FP8 weights,
  // as TransformerEngine's Float8Tensor parameters do).
  void make_fp8_params() {
    for (Param& p : params) {
      if (p.linear.empty()) continue;
      p.fp8 = quantize_local(p, p.master);
      MP_CHECK_INPUT(!p.fp8.high_precision_fallback,
                     "fsdp.fp8_params: weight {} {} cannot be held as mxfp8 shards on mesh {}: "
                     "every dp_shard shard needs a multiple of 32 rows ({})",
                     p.spec.name, p.spec.shape.str(), mesh.str(), p.fp8.note);
      const Layout& described = state_layout(p);
      const std::string key = "fp8/params/" + p.spec.name;
      state.entries.push_back({key + "/rowwise_data", described, p.fp8.q.rowwise_data});
      if (config.recipe.kind != RecipeKind::kMxfp8) {
        const std::vector<Placement> rep(3, Placement::replicate());
        state.entries.push_back(
            {key + "/scale_inv", Layout(mesh, Shape{1}, rep), p.fp8.q.rowwise_scale_inv});
        continue;
      }
      // MXFP8: the e8m0 scales and the columnwise copy follow the weight's row placements.
      const int64_t rows = p.spec.shape[0], cols = p.spec.shape[1];
      const auto add = [&](const std::string& name, const Shape& global, const Tensor& t) {
        Layout l(mesh, global, described.placements());
        MP_CHECK_INPUT(l.box(rank).shape() == t.shape(),
                       "fsdp.fp8_params: {} of {}: shard {} does not match its layout box {} on "
                       "mesh {}",
                       name, p.spec.name, t.shape().str(), l.box(rank).str(), mesh.str());
        state.entries.push_back({key + "/" + name, l, t});
      };
      add("rowwise_scale_inv", Shape{rows, cols / 32}, p.fp8.q.rowwise_scale_inv);
      add("columnwise_data", Shape{rows, cols}, p.fp8.q.columnwise_data);
      add("columnwise_scale_inv", Shape{rows / 32, cols}, p.fp8.q.columnwise_scale_inv);
    }
  }

  // After the optimizer step: re-quantize the FP8 primary weights from the updated masters, in
  // place (the checkpoint state shares their storage).
  void requantize_fp8_params() {
    for (Param& p : params) {
      if (p.linear.empty()) continue;
      Fp8Shard fresh = quantize_local(p, p.master);
      for (auto [dst, src] :
           {std::pair{&p.fp8.q.rowwise_data, &fresh.q.rowwise_data},
            std::pair{&p.fp8.q.rowwise_scale_inv, &fresh.q.rowwise_scale_inv},
            std::pair{&p.fp8.q.columnwise_data, &fresh.q.columnwise_data},
            std::pair{&p.fp8.q.columnwise_scale_inv, &fresh.q.columnwise_scale_inv}})
        if (dst->defined()) dst->copy_from(*src);
      p.fp8.q.amax = fresh.q.amax;
      p.fp8.q.scale = fresh.q.scale;
    }
  }

  // --- --trace: the FP8 state (docs/design.md section 16) ----------------------------------

  // The forward's FP8 state of the last step (RunOptions::trace): taken at the step's start, before
  // the forward reads the delayed scales and the FP8 primary weights.
  std::vector<TensorDigest> fp8_trace_before;

  // The FP8 state entries (checkpoint keys fp8/...) in the order a step uses them: per quantized
  // linear in forward order, the delayed-scaling scale and amax history of its input, weight and
  // grad_output, then its FP8 primary weight (data and scale_inv); any other fp8/ entry after
  // them in state order.
  std::vector<const StateEntry*> fp8_entries_in_step_order() const {
    std::map<std::string, const StateEntry*> by_key;
    for (const StateEntry& e : state.entries)
      if (e.key.starts_with("fp8/")) by_key[e.key] = &e;
    std::vector<const StateEntry*> out;
    const auto take = [&](const std::string& key) {
      const auto it = by_key.find(key);
      if (it == by_key.end()) return;
      out.push_back(it->second);
      by_key.erase(it);
    };
    for (const Param& p : params) {
      if (p.linear.empty()) continue;
      for (const char* role : {"input", "weight", "grad_output"})
        for (const char* what : {"scale", "amax_history"})
          take(fmt::format("fp8/{}/{}/{}", p.linear, role, what));
      const std::string weight = "fp8/params/" + p.spec.name + "/";
      for (const StateEntry& e : state.entries)
        if (e.key.starts_with(weight)) take(e.key);
    }
    for (const StateEntry& e : state.entries) take(e.key);
    return out;
  }

  // Global fp32 digests of the FP8 state (collective), named prefix + checkpoint key.
  std::vector<TensorDigest> fp8_state_digests(const std::string& prefix) {
    std::vector<TensorDigest> d;
    mesh::Communicator& world = comms.group(kWorld);
    for (const StateEntry* e : fp8_entries_in_step_order())
      d.push_back(digest(prefix + e->key, gather_box(world, e->layout, host_fp32(e->local),
                                                     Box::whole(e->layout.global_shape()))));
    return d;
  }

  StepMetrics run_step() {
    // Before the step's clock starts: tracing is not the step's time.
    if (options.trace) fp8_trace_before = fp8_state_digests("");
    const TrainingConfig& t = config.training;
    const auto t0 = Clock::now();
    const std::map<std::string, double> coll0 = collective_seconds();
    StepMetrics metrics;
    metrics.step = step;

    // Forward/backward over this data-parallel rank's rows, micro-batched. The model asks for
    // each unit's weights as it reaches it (per-layer all-gather over dp_shard; freed after the
    // layer's forward with reshard_after_forward and gathered again for its backward); fp32
    // gradients accumulate locally and each unit's are reduced after its backward in the last
    // micro-batch (deferred sync: one reduction per step).
    const auto tc = Clock::now();
    const double coll_compute0 = all_collective_seconds();
    weights = TensorMap{};
    grads = TensorMap{};
    step_shards.clear();
    step_hp.clear();
    gathered_now = 0;
    recipe.clear_prequantized_weights();
    const int64_t dp = mesh.group_size(kData);
    const int64_t j = mesh.group_index(rank, kData);
    const int64_t local_rows = t.batch / dp, micro_rows = local_rows / t.micro_batches;
    const double positions = static_cast<double>(t.batch * t.seq_len);
    // Gradients are averaged over the data-parallel ranks, so each rank's objective is its rows'
    // loss sum scaled by dp / global positions.
    const double grad_scale = static_cast<double>(dp) / positions;
    double loss_sum = 0;
    for (int64_t mb = 0; mb < t.micro_batches; ++mb) {
      first_micro_batch = mb == 0;
      last_micro_batch = mb + 1 == t.micro_batches;
      const int64_t row0 = j * local_rows + mb * micro_rows;
      const Tensor tokens = data.rows(cursor, row0, row0 + micro_rows);
      loss_sum += model.forward_backward(
          weights, tokens, {cursor, row0}, grad_scale, grads, &recipe,
          TpContext{&comms.group(kTp), options.mesh.sequence_parallel}, &hooks);
    }
    MP_CHECK(grads.names().empty() && weights.names().empty(),
             "session: {} gradients and {} weights left unreleased after the backward",
             grads.names().size(), weights.names().size());
    step_shards.clear();
    step_hp.clear();
    // The phases exclude the collectives that ran inside them (reported per kind below), so the
    // parts of the breakdown do not count the same seconds twice.
    time.compute = seconds_since(tc) - (all_collective_seconds() - coll_compute0);
    const bool sp = options.mesh.sequence_parallel && mesh.size(MeshDim::kTp) > 1;
    metrics.loss = sum_doubles(comms.group(sp ? kWorld : kData), loss_sum) / positions;

    // Global norm: the shards over dp_shard x tp are disjoint except for tp-replicated
    // parameters, which only tp rank 0 counts; dp_replicate replicas are not summed.
    const auto to = Clock::now();
    const double coll_optimizer0 = all_collective_seconds();
    double sq = 0;
    const bool tp_lead = mesh.coord(rank, MeshDim::kTp) == 0;
    for (const Param& p : params)
      if (tp_lead || p.layout.placement(MeshDim::kTp).is_shard())
        sq += kernels::sum_of_squares(p.grad);
    metrics.grad_norm =
        std::sqrt(sum_doubles(comms.group(DimSet{MeshDim::kDpShard, MeshDim::kTp}), sq));
    const double coef = clip_coefficient(metrics.grad_norm, t.max_grad_norm);
    metrics.lr = learning_rate(t, step);
    for (Param& p : params) {
      if (coef < 1.0) kernels::scale_(p.grad, coef);
      if (p.master.numel().value == 0) continue;
      kernels::AdamWHyper hp{metrics.lr, t.beta1, t.beta2, t.adam_eps,
                             p.spec.weight_decay() ? t.weight_decay : 0.0};
      kernels::adamw_step(p.master, p.grad, p.exp_avg, p.exp_avg_sq, step + 1, hp);
    }
    if (fp8_params) requantize_fp8_params();
    time.optimizer = seconds_since(to) - (all_collective_seconds() - coll_optimizer0);
    ++step;
    ++cursor;
    store_scalars();

    const std::map<std::string, double> coll1 = collective_seconds();
    time.collectives.clear();
    for (const auto& [k, v] : coll1)
      if (v - coll0.at(k) > 0) time.collectives[k] = v - coll0.at(k);
    time.total = seconds_since(t0);
    if (kernels::MemoryTracker* m = kernels::current_context().memory)
      mem.peak = m->peak(device.type).value;
    // On the CPU everything shares the tracker's peak; on a GPU the device holds the gathered
    // weights, unsharded gradients and activations (the sharded state stays on the host).
    const int64_t resident = device.is_cpu()
                                 ? mem.params + mem.grads + mem.optimizer + mem.gathered_weights
                                 : mem.gathered_weights;
    mem.activations = std::max<int64_t>(0, mem.peak - resident);
    return metrics;
  }

  std::map<std::string, Tensor> gather_all(bool grad) {
    std::map<std::string, Tensor> out;
    mesh::Communicator& world = comms.group(kWorld);
    for (const Param& p : params)
      out[p.spec.name] =
          gather_box(world, p.layout, grad ? p.grad : p.master, Box::whole(p.spec.shape));
    return out;
  }
};

namespace {
// check_run before the session's members exist: the model, the data table and the shards
// allocate in their constructors.
const RunOptions& checked(const RunOptions& options) {
  require_valid_run(options);
  return options;
}
}  // namespace

TrainingSession::TrainingSession(const RunOptions& options, mesh::RankComms& comms)
    : impl_(std::make_unique<Impl>(checked(options), comms)) {}
TrainingSession::~TrainingSession() = default;
StepMetrics TrainingSession::step() { return impl_->run_step(); }
ShardedState& TrainingSession::state() { return impl_->state; }
void TrainingSession::load_scalars() { impl_->load_scalars(); }
std::map<std::string, Tensor> TrainingSession::gather_params() { return impl_->gather_all(false); }
std::vector<TensorDigest> TrainingSession::digests() {
  // The forward's FP8 state ("fp8/<key>", taken at the step's start), then in canonical
  // parameter order (embeddings, layers in order, head) the gradients and the weights the step's
  // optimizer update produced from them, then the FP8 state after the step ("updated/fp8/<key>":
  // the delayed scales and amax histories updated by the step, the re-quantized FP8 weights).
  MP_CHECK(impl_->options.trace,
           "TrainingSession::digests needs RunOptions::trace: the forward's FP8 state is taken at "
           "each step's start only when tracing");
  std::vector<TensorDigest> d = std::move(impl_->fp8_trace_before);
  impl_->fp8_trace_before.clear();
  const std::map<std::string, Tensor> grads = impl_->gather_all(true);
  const std::map<std::string, Tensor> weights = impl_->gather_all(false);
  for (const Impl::Param& p : impl_->params)
    d.push_back(digest("grad/" + p.spec.name, grads.at(p.spec.name)));
  for (const Impl::Param& p : impl_->params)
    d.push_back(digest("param/" + p.spec.name, weights.at(p.spec.name)));
  for (TensorDigest& u : impl_->fp8_state_digests("updated/")) d.push_back(std::move(u));
  return d;
}
int64_t TrainingSession::steps_done() const { return impl_->step; }
MemoryBreakdown TrainingSession::memory() const { return impl_->mem; }
const std::vector<std::string>& TrainingSession::notes() const { return impl_->notes; }
const StepTime& TrainingSession::last_time() const { return impl_->time; }
const std::vector<AllGatherParity>& TrainingSession::parity() const { return impl_->parity; }

// ---------------------------------------------------------------------------------------------

namespace {

RankReport rank_report(TrainingSession& s, mesh::RankComms& comms) {
  RankReport r;
  r.rank = comms.rank();
  r.coords = comms.mesh().coords(r.rank);
  r.memory = s.memory();
  for (DimSet d : kAllGroups) {
    mesh::Communicator& c = comms.group(d);
    if (c.size() == 1) continue;
    for (int k = 0; k < mesh::kNumCollectiveKinds; ++k) {
      const auto kind = static_cast<mesh::CollectiveKind>(k);
      const mesh::CollectiveStats& st = c.stats(kind);
      if (st.count == 0) continue;
      r.collectives.push_back({std::string(mesh::collective_name(kind)), d.str(), st.count,
                               st.bytes.value, st.seconds});
    }
  }
  return r;
}

// The body every rank runs; rank 0 (or the only rank) fills `result`'s global parts.
void run_rank(const RunOptions& options, mesh::RankComms& comms, RunResult& result,
              std::mutex& mu) {
  TrainingSession session(options, comms);
  if (options.before_start) {
    options.before_start(session.state(), comms);
    session.load_scalars();
  }
  const int64_t steps = options.steps > 0 ? options.steps : options.config.training.steps;
  using Clock = std::chrono::steady_clock;
  // The global results (metrics, traces, final parameters) are the same on every rank: rank 0
  // hands them out, and with launcher mpi every process does (each is the only rank it has).
  const bool lead = comms.rank() == 0 || options.launcher == "mpi";
  for (int64_t i = 0; i < steps; ++i) {
    const StepMetrics m = session.step();
    std::vector<TensorDigest> d;
    if (options.trace) d = session.digests();
    StepTime time = session.last_time();
    if (options.after_step) {
      const auto t0 = Clock::now();
      const bool saved = options.after_step(session.state(), comms, session.steps_done());
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      time.total += seconds;
      if (saved) time.checkpoint = seconds;
    }
    if (lead) {
      result.metrics.push_back(m);
      result.times.push_back(time);
      if (options.trace) result.trace.push_back(std::move(d));
      if (options.on_step) options.on_step(m);
    }
  }
  std::map<std::string, Tensor> final_params = session.gather_params();
  RankReport report = rank_report(session, comms);
  std::lock_guard<std::mutex> lock(mu);
  result.ranks.push_back(std::move(report));
  if (lead) {
    result.final_params = std::move(final_params);
    result.notes = session.notes();
    result.parity = session.parity();
  }
}

}  // namespace

void run_on_ranks(const RunOptions& options, const std::function<void(mesh::RankComms&)>& body,
                  const std::function<void()>& after) {
  // Every input rule, the thread count and memory of this machine included, before any rank
  // thread starts.
  require_valid_run(options);
  const mesh::DeviceMesh dmesh = options.mesh.device_mesh();
  if (options.backend.is_cuda()) {
    const kernels::CudaStatus& cuda = kernels::cuda_status();
    MP_CHECK_INPUT(cuda.usable, "run_training: backend {} is not usable here: {}",
                   options.backend.str(), cuda.reason);
  }
  if (options.launcher == "local") {
    mesh::LocalWorld world(dmesh, {.device = options.backend});
    world.run(body);
    if (after) after();
  } else if (options.launcher == "mpi") {
    // MPI cannot be initialised again after MPI_Finalize, and a process may train many times (a
    // scenario's checks, several scenarios): initialised on first use, finalised at exit.
    static mesh::MpiSession mpi(nullptr, nullptr);
    mesh::MpiRankComms host(dmesh);
    if (options.backend.is_cuda()) {
      // One GPU per process (node-local rank modulo the visible GPUs): host buffers over MPI,
      // device buffers (the model's tensor-parallel collectives) over NCCL.
      mesh::NcclRankComms nccl = mesh::NcclRankComms::bootstrap_mpi(dmesh);
      const kernels::ScopedRankContext context(nccl.context());
      mesh::SplitRankComms comms(host, nccl);
      body(comms);
    } else {
      body(host);
    }
    if (after) after();
  } else {
    MP_FAIL_INPUT("launcher '{}': expected 'local' or 'mpi'", options.launcher);
  }
}

RunResult run_training(const RunOptions& options) {
  RunResult result;
  std::mutex mu;
  run_on_ranks(
      options, [&](mesh::RankComms& comms) { run_rank(options, comms, result, mu); },
      [&] {
        // Tensors made on a rank thread are accounted to that rank's tracker, which dies with
        // the world: hand out copies owned by the caller's context.
        for (auto& [name, t] : result.final_params) t = t.clone();
      });
  std::sort(result.ranks.begin(), result.ranks.end(),
            [](const RankReport& a, const RankReport& b) { return a.rank < b.rank; });
  return result;
}

}  // namespace meshproof::engine
