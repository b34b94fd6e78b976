#include "engine/config/run_rules.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "engine/model/params.h"
#include "kernels/core/error.h"
#include "mesh/local/local_comm.h"

namespace meshproof::engine {

namespace {

// The first integer in a /proc or /sys file, or -1 ("max", missing, unreadable).
int64_t read_count(const char* path) {
  std::ifstream in(path);
  int64_t v = -1;
  if (!(in >> v)) return -1;
  return v;
}

HostLimits probe() {
  HostLimits h;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) h.memory_bytes = static_cast<int64_t>(pages) * page;
  // Threads: the tightest of the kernel's threads-max, the cgroup's pids.max (minus what the
  // cgroup already runs) and RLIMIT_NPROC (root is exempt from the latter).
  int64_t limit = read_count("/proc/sys/kernel/threads-max");
  auto tighten = [&limit](int64_t v) {
    if (v > 0) limit = limit > 0 ? std::min(limit, v) : v;
  };
  for (const auto& [max_path, cur_path] :
       {std::pair{"/sys/fs/cgroup/pids.max", "/sys/fs/cgroup/pids.current"},
        std::pair{"/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/pids/pids.current"}}) {
    const int64_t max = read_count(max_path), cur = read_count(cur_path);
    if (max > 0) tighten(std::max<int64_t>(1, max - std::max<int64_t>(cur, 0)));
  }
  rlimit r{};
  if (geteuid() != 0 && getrlimit(RLIMIT_NPROC, &r) == 0 && r.rlim_cur != RLIM_INFINITY) {
    tighten(static_cast<int64_t>(r.rlim_cur));
  }
  h.max_threads = std::max<int64_t>(limit, 0);
  return h;
}

std::string gib(int64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1 << 30));
}

}  // namespace

const HostLimits& host_limits() {
  static const HostLimits limits = probe();
  return limits;
}

MemoryEstimate estimate_memory(const RunOptions& o) {
  const Config& c = o.config;
  MemoryEstimate e;
  // In int64: each dim may be up to 4096, their product overflows MeshSpec::world_size's int.
  const int64_t world =
      std::max<int64_t>(1, int64_t{o.mesh.dp_replicate} * o.mesh.dp_shard * o.mesh.tp);
  e.ranks_in_process = o.launcher == "mpi" ? 1 : world;
  // Parameters: each rank holds at least its 1/(dp_shard x tp) share of every tensor as fp32
  // master, exp_avg, exp_avg_sq and gradient (replicated tensors hold more: a lower bound).
  // Counted in double: the point is to refuse sizes whose int64 products would overflow too.
  double params = 0;
  for (const ParamSpec& s : param_specs(c.model))
    params += static_cast<double>(s.shape.numel().value);
  const double shards = static_cast<double>(std::max(1, o.mesh.dp_shard)) *
                        static_cast<double>(std::max(1, o.mesh.tp));
  double bytes = 16.0 * params / shards;
  // The data source's transition table: V^k contexts x V int32 tokens, one per rank (session).
  bytes += 4.0 * std::pow(static_cast<double>(c.model.vocab),
                          static_cast<double>(c.data.markov_order + 1));
  // One micro-batch's fp32 logits [rows, V] on this rank (sequence shard under SP).
  const double dp = std::max(1.0, static_cast<double>(o.mesh.dp_replicate) * o.mesh.dp_shard);
  const double rows = static_cast<double>(c.training.batch) / dp /
                      static_cast<double>(std::max<int64_t>(1, c.training.micro_batches)) *
                      static_cast<double>(c.training.seq_len) /
                      (o.mesh.sequence_parallel ? std::max(1, o.mesh.tp) : 1);
  bytes += 4.0 * rows * static_cast<double>(c.model.vocab);
  e.per_rank_bytes = bytes >= 9.0e18 ? int64_t{9000000000000000000} : static_cast<int64_t>(bytes);
  return e;
}

std::vector<ConfigIssue> check_run(const RunOptions& o, const HostLimits& limits) {
  std::vector<ConfigIssue> issues = check_config(o.config);
  const auto need = [&issues](const char* key, bool cond, std::string message) {
    if (!cond) issues.push_back({key, std::move(message)});
  };
  const Config& c = o.config;
  const ModelConfig& m = c.model;
  const TrainingConfig& t = c.training;
  const MeshSpec& ms = o.mesh;
  need("mesh.dp_replicate", ms.dp_replicate >= 1,
       fmt::format("mesh.dp_replicate = {} must be >= 1", ms.dp_replicate));
  need("mesh.dp_shard", ms.dp_shard >= 1,
       fmt::format("mesh.dp_shard = {} must be >= 1", ms.dp_shard));
  need("mesh.tp", ms.tp >= 1, fmt::format("mesh.tp = {} must be >= 1", ms.tp));
  need("mesh.pp", ms.pp >= 1, fmt::format("mesh.pp = {} must be >= 1", ms.pp));
  // A structurally broken config or mesh: the rules below divide by its sizes.
  if (!issues.empty() && (ms.dp_replicate < 1 || ms.dp_shard < 1 || ms.tp < 1 || ms.pp < 1 ||
                          t.micro_batches < 1 || m.heads < 1 || t.seq_len < 1)) {
    return issues;
  }
  const int64_t tp = ms.tp, dp = int64_t{ms.dp_replicate} * ms.dp_shard;
  need("mesh.tp", m.heads % tp == 0,
       fmt::format("model.heads = {} is not divisible by tp = {}", m.heads, tp));
  // Grouped-query attention: whole KV groups (their query heads, k and v) per tp rank.
  need("mesh.tp", kv_heads_of(m) % tp == 0,
       fmt::format("model.kv_heads = {} is not divisible by tp = {} (KV groups split over tp)",
                   kv_heads_of(m), tp));
  need("mesh.sequence_parallel", !ms.sequence_parallel || tp > 1,
       "needs tensor parallelism (mesh.tp > 1)");
  need("mesh.sequence_parallel", !ms.sequence_parallel || t.seq_len % tp == 0,
       fmt::format("model.seq_len = {} is not divisible by tp = {}", t.seq_len, tp));
  // Dropout masks are keyed by contiguous global element ranges of [B*S, H]; a sequence shard
  // is not contiguous, so sequence parallelism is limited to dropout 0.
  need("mesh.sequence_parallel", !ms.sequence_parallel || m.dropout == 0.0,
       fmt::format("needs model.dropout = 0 (got {}): dropout masks are keyed by contiguous "
                   "token ranges, which a sequence shard is not",
                   m.dropout));
  // Pipeline stages (docs/design.md section 33). Built and proven bitwise equal to one stage:
  // dense models with untied embeddings on recipes without cross-pass state; the rest is refused
  // rather than run unproven.
  // An explicit split of the layers over the stages (engine/pipeline/pipeline.h
  // stage_layer_counts).
  if (!m.pp_layers.empty()) {
    int64_t sum = 0;
    bool positive = true;
    for (int64_t n : m.pp_layers) {
      positive = positive && n >= 1;
      sum += std::clamp<int64_t>(n, 0, int64_t{1} << 20);  // no overflow on absurd entries
    }
    need("model.pp_layers", static_cast<int64_t>(m.pp_layers.size()) == ms.pp,
         fmt::format("[{}] has {} entries; mesh.pp = {} needs one per stage",
                     fmt::join(m.pp_layers, ", "), m.pp_layers.size(), ms.pp));
    need("model.pp_layers", positive,
         fmt::format("[{}]: every stage needs at least one layer", fmt::join(m.pp_layers, ", ")));
    need("model.pp_layers", !positive || sum == m.layers,
         fmt::format("[{}] sums to {}, model.layers = {}", fmt::join(m.pp_layers, ", "), sum,
                     m.layers));
  }
  if (ms.pp > 1) {
    need("mesh.pp", ms.pp <= m.layers,
         fmt::format("mesh.pp = {} exceeds model.layers = {}: every stage needs at least one layer",
                     ms.pp, m.layers));
    // Recipe delayed runs: each stage updates its own linears' amax histories after each of
    // its forwards (input, weight) and backwards (grad_output), in micro-batch order per role,
    // as one stage does (docs/design.md section 33).
    // Faults under stages: every hook is keyed by parameter, linear, checkpoint key or step and
    // acts on the stage that holds what it names. An amax reduction over pp cannot: the linear
    // lives on one stage, whose MAX-reduction over the pp group no other stage would join.
    // (The dims are read as written, '+'-joined names: a malformed list is the harness's error.)
    const std::string dims = fmt::format("+{}+", o.faults.amax_group_dims);
    need("faults", o.faults.amax_group_linear.empty() || dims.find("+pp+") == std::string::npos,
         fmt::format("amax_group over dims '{}' cannot run with pipeline stages (mesh.pp = {}): "
                     "the linear '{}' is held by one stage, and its amax reduction over pp would "
                     "wait for stages that do not hold it; leave pp out of the dims",
                     o.faults.amax_group_dims, ms.pp, o.faults.amax_group_linear));
  }
  const int64_t split = dp * t.micro_batches;
  need("training.batch", t.batch % split == 0,
       fmt::format("{} is not divisible by dp_replicate x dp_shard x micro_batches = {} x {} x {} "
                   "= {}",
                   t.batch, ms.dp_replicate, ms.dp_shard, t.micro_batches, split));

  const RecipeKind rk = c.recipe.kind;
  const bool fp8 = rk != RecipeKind::kFp32 && rk != RecipeKind::kBf16;
  // fsdp.fp8_all_gather with a high-precision recipe runs with a note (high-precision gather):
  // the reference run of an FP8 scenario may well be bf16. Recipe block has FP8 weights but no
  // FP8 all-gather (each shard's 128x128 tiles would have to be whole, and the gathered tile
  // codes equal to quantizing the gathered weight, neither built nor tested): refused rather
  // than accepted and run as a high-precision gather.
  need("fsdp.fp8_all_gather", !o.fsdp.fp8_all_gather || rk != RecipeKind::kBlock,
       "with recipe block is not built (the block-scaled weight would be gathered in high "
       "precision, not as FP8); use recipe current, delayed, mxfp8 or nvfp4, or "
       "fp8_all_gather: false");
  need("fsdp.fp8_params", !o.fsdp.fp8_params || fp8,
       fmt::format("needs recipe current, delayed or mxfp8, got {}", recipe_name(rk)));
  need("fsdp.fp8_params", !o.fsdp.fp8_params || !fp8 || rk != RecipeKind::kBlock,
       "needs recipe delayed, current or mxfp8 (block-scaled weights are not kept as FP8 primary "
       "weights), got block");

  need("fsdp.fp8_params", !o.fsdp.fp8_params || rk != RecipeKind::kNvfp4,
       "needs recipe delayed, current or mxfp8 (NVFP4 weights are not kept as FP4 primary "
       "weights), got nvfp4");
  if (rk == RecipeKind::kNvfp4 && t.batch % split == 0) {
    // Each data rank's tokens (M) and the TP-local weight boxes (N, K) must hold whole 1x16
    // blocks, 16x16 tiles and RHT groups, so that the pieces quantize like the whole tensor.
    const int64_t tokens = t.batch / split * t.seq_len;
    const std::string on =
        fmt::format("recipe = nvfp4 on mesh (dp_replicate {}, dp_shard {}, tp {})", ms.dp_replicate,
                    ms.dp_shard, ms.tp);
    need("training.batch", tokens % 16 == 0,
         fmt::format("{}: each data-parallel rank's micro-batch has global_batch / (dp x "
                     "micro_batches) x seq_len = {} tokens, not a multiple of 16 (1x16 blocks)",
                     on, tokens));
    if (tp > 1) {
      for (const auto& [what, value] : {std::pair{"hidden / tp (proj K)", m.hidden / tp},
                                        std::pair{"ffn / tp (fc2 K)", m.ffn / tp}}) {
        need("mesh.tp", value % 16 == 0,
             fmt::format("{}: {} = {} is not a multiple of 16 (1x16 blocks)", on, what, value));
      }
    }
    if (o.fsdp.fp8_all_gather) {
      // The FP4 all-gather (docs/design.md section 28) quantizes each dp_shard shard of a GEMM
      // weight's TP-local rows on its own: 16x16 tiles must not cross shards, so every
      // torch.chunk piece must be a non-empty multiple of 16 rows. No padding helps: a tile
      // across two shards takes its E4M3 code from both shards' values.
      for (const ParamSpec& p : param_specs(m)) {
        if (!p.quantized() || p.unit != 0) continue;  // every layer has layer 0's shapes
        const int64_t rows = p.tp == TpStyle::kColumn ? p.shape[0] / tp : p.shape[0];
        const int64_t chunk = (rows + ms.dp_shard - 1) / ms.dp_shard;
        std::string sizes;
        bool ok = true;
        for (int64_t i = 0; i < ms.dp_shard; ++i) {
          const int64_t n = std::clamp<int64_t>(rows - i * chunk, 0, chunk);
          ok = ok && n > 0 && n % 16 == 0;
          sizes += fmt::format("{}{}", i == 0 ? "" : ", ", n);
        }
        if (ok) continue;
        need("fsdp.fp8_all_gather", false,
             fmt::format("{}: {} {} has {} rows per tp rank, cut over dp_shard {} into shards of "
                         "{} rows; the FP4 all-gather needs every shard to hold a non-empty "
                         "multiple of 16 rows (16x16 tiles may not cross shards)",
                         on, p.name, p.shape.str(), rows, ms.dp_shard, sizes));
        break;
      }
    }
  }
  if (rk == RecipeKind::kMxfp8 && t.batch % split == 0) {
    // On a mesh the GEMM operands are this data rank's micro-batch tokens (M; a sequence shard
    // before the SP gather) and the TP-local weight boxes (N and K): multiples of 32 for the
    // 1x32 / 32x1 blocks.
    const int64_t tokens = t.batch / split * t.seq_len;
    const std::string on =
        fmt::format("recipe = mxfp8 on mesh (dp_replicate {}, dp_shard {}, tp {})", ms.dp_replicate,
                    ms.dp_shard, ms.tp);
    need("training.batch", tokens % 32 == 0,
         fmt::format("{}: each data-parallel rank's micro-batch has global_batch / (dp x "
                     "micro_batches) x seq_len = {} tokens, not a multiple of 32 (1x32 / 32x1 "
                     "blocks)",
                     on, tokens));
    if (tp > 1) {
      for (const auto& [what, value] : {std::pair{"hidden / tp (proj K)", m.hidden / tp},
                                        std::pair{"ffn / tp (fc2 K)", m.ffn / tp}}) {
        need("mesh.tp", value % 32 == 0,
             fmt::format("{}: {} = {} is not a multiple of 32 (1x32 / 32x1 blocks)", on, what,
                         value));
      }
    }
    if (o.fsdp.fp8_params) {
      // FP8 primary weights live as shards: every dp_shard chunk of each GEMM weight's
      // TP-local rows must hold whole 32x1 columnwise blocks. For torch.chunk over n <= 31
      // ranks that holds exactly when the rows are a multiple of 32 * n.
      const std::string fc1 =
          m.activation == Activation::kSwiGlu ? "layers.0.mlp.fc1_gate" : "layers.0.mlp.fc1";
      struct Weight {
        std::string name;
        int64_t rows, cols, local_rows;  // global shape; rows per tp rank
      };
      const int64_t qkv_rows = (m.heads + 2 * kv_heads_of(m)) * (m.hidden / m.heads);
      const Weight weights[] = {{"layers.0.attn.qkv", qkv_rows, m.hidden, qkv_rows / tp},
                                {"layers.0.attn.proj", m.hidden, m.hidden, m.hidden},
                                {fc1, m.ffn, m.hidden, m.ffn / tp},
                                {"layers.0.mlp.fc2", m.hidden, m.ffn, m.hidden}};
      for (const Weight& w : weights) {
        if (w.local_rows % (32 * ms.dp_shard) == 0) continue;
        need("mesh.dp_shard", false,
             fmt::format("fsdp.fp8_params with recipe mxfp8: {}.weight [{}, {}] has {} rows per "
                         "tp rank, not a multiple of 32 x dp_shard = {} (each shard must hold "
                         "whole 32x1 blocks)",
                         w.name, w.rows, w.cols, w.local_rows, 32 * ms.dp_shard));
        break;
      }
    }
  }

  // Expert parallelism (docs/design.md "Expert parallelism"): ep borrows dp_shard ranks; each
  // group of ep consecutive dp_shard members splits the experts evenly.
  need("mesh.ep", ms.ep >= 1, fmt::format("mesh.ep = {} must be >= 1", ms.ep));
  if (ms.ep > 1) {
    need("mesh.ep", m.moe.enabled(),
         fmt::format("mesh.ep = {} needs model.moe (experts to split over the ep ranks)", ms.ep));
    need("mesh.ep", ms.dp_shard % ms.ep == 0,
         fmt::format("mesh.ep = {} does not divide mesh.dp_shard = {} (expert parallelism "
                     "borrows dp_shard ranks)",
                     ms.ep, ms.dp_shard));
    need("mesh.ep", !m.moe.enabled() || m.moe.experts % ms.ep == 0,
         fmt::format("mesh.ep = {} does not divide model.moe.experts = {} (each ep rank owns "
                     "experts / ep experts)",
                     ms.ep, m.moe.experts));
  }

  // What this machine can hold: refused up front rather than after minutes of allocation.
  // Only for a valid configuration (a broken one has no meaningful size).
  if (!issues.empty()) return issues;
  if (o.launcher != "mpi" && limits.max_threads > 0) {
    // One thread per rank, or one fiber worker per CPU when the host ranks outnumber the CPUs
    // (mesh/local/rank_fibers.h): the same decision the local world takes.
    const int64_t world = int64_t{ms.pp} * dp * tp;
    const int64_t workers = mesh::local_fiber_workers(static_cast<int>(world), o.backend,
                                                      mesh::rank_threading_from_env());
    const int64_t threads = workers > 0 ? workers : world;
    need("mesh", threads <= limits.max_threads,
         fmt::format("launcher local runs {} ranks on {} threads ({}), but this process may "
                     "start at most {} threads here",
                     world, threads, workers > 0 ? "fibers on one worker per CPU" : "one per rank",
                     limits.max_threads));
  }
  if (limits.memory_bytes > 0) {
    const MemoryEstimate e = estimate_memory(o);
    need("model",
         static_cast<double>(e.per_rank_bytes) * static_cast<double>(e.ranks_in_process) <=
             static_cast<double>(limits.memory_bytes),
         fmt::format("the run needs at least {} of host memory ({} rank{} in this process x {} "
                     "each: fp32 weights, AdamW moments and gradients, the data table, logits); "
                     "this machine has {}",
                     gib(e.process_bytes()), e.ranks_in_process, e.ranks_in_process == 1 ? "" : "s",
                     gib(e.per_rank_bytes), gib(limits.memory_bytes)));
  }
  return issues;
}

void require_valid_run(const RunOptions& options) {
  const std::vector<ConfigIssue> issues = check_run(options);
  if (!issues.empty()) {
    MP_FAIL_INPUT("{}: {}", issues.front().key_path, issues.front().message);
  }
}

}  // namespace meshproof::engine
