// The device-resident training state (docs/design.md, "Device-resident training state") on the
// CUDA backend with virtual ranks on cuda:0: the sharded optimizer step on device shards is
// bitwise the CPU's and moves only the 8-byte sum of squares to the host; a whole training step
// moves no bulk byte between host and device (only scalars); a checkpoint save is one
// batched download; 30 runs in one process leave the device's free memory flat. Resume and
// determinism of scenarios/gpu_hsdp_tp.yaml are its own checks (runner.gpu.gpu_hsdp_tp). Skips
// with the reason when no GPU is usable (fails under MESHPROOF_REQUIRE_GPU=1: tests/gpu_test.h).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "engine/checkpoint/checkpoint.h"
#include "engine/faults/fault_hooks.h"
#include "engine/optim/optimizer.h"
#include "engine/parallel/shard_plan.h"
#include "engine/session/session.h"
#include "harness/run/train_run.h"
#include "harness/scenario/scenario_loader.h"
#include "kernels/core/cuda_check.h"
#include "kernels/core/device.h"
#include "kernels/core/runtime.h"
#include "mesh/local/local_comm.h"
#include "tests/engine/test_config.h"
#include "tests/gpu_test.h"
#include "tests/source_dir.h"

namespace meshproof::engine {
namespace {

// The CUDA backend only: compiled in CUDA builds (the clang sanitizer build has none).
#if MESHPROOF_HAVE_CUDA

namespace fs = std::filesystem;
using kernels::CopyCounts;

class DeviceStateGpu : public ::testing::Test {
 protected:
  void SetUp() override { MP_SKIP_WITHOUT_GPU(); }
};

// The scenario's matrix entries (recipes current and mxfp8) as run options on cuda:0.
std::vector<RunOptions> scenario_runs() {
  std::vector<RunOptions> out;
  for (const harness::Scenario& s : harness::load_scenario_file(
           (test_support::source_dir() / "scenarios/gpu_hsdp_tp.yaml").string())) {
    RunOptions o = harness::engine_run_options(s);
    o.backend = kernels::Device::cuda(0);
    o.launcher = "local";
    out.push_back(std::move(o));
  }
  return out;
}

// Per rank, per step: the rank's host<->device copies during that step (the after_step hook of
// step k minus that of step k - 1; the first from before_start, after construction).
struct Counted {
  RunResult result;
  std::vector<std::vector<CopyCounts>> steps;  // [rank][step]
};

Counted run_counted(
    RunOptions o, const std::function<bool(ShardedState&, mesh::RankComms&, int64_t)>& save = {}) {
  const int world = o.mesh.world_size();
  Counted c;
  c.steps.resize(static_cast<size_t>(world));
  std::vector<CopyCounts> last(static_cast<size_t>(world));
  const auto now = [] {
    const kernels::CopyCounter* k = kernels::current_context().copies;
    EXPECT_NE(k, nullptr) << "the local launcher installs a per-rank copy counter";
    return k != nullptr ? k->counts() : CopyCounts{};
  };
  o.before_start = [&](ShardedState&, mesh::RankComms& comms) {
    last[static_cast<size_t>(comms.rank())] = now();
  };
  o.after_step = [&](ShardedState& state, mesh::RankComms& comms, int64_t done) {
    const size_t r = static_cast<size_t>(comms.rank());
    const CopyCounts t = now();
    c.steps[r].push_back(t - last[r]);
    const bool saved = save && save(state, comms, done);
    last[r] = now();  // a save is not the next step's traffic
    return saved;
  };
  c.result = run_training(o);
  return c;
}

// One rank's result of a sharded optimizer step: its shards after the step (host copies, taken
// after the counting) and the host<->device copies of the step itself.
struct OptimizerOutcome {
  double grad_norm = 0;
  std::vector<std::vector<float>> master, exp_avg, exp_avg_sq;
  CopyCounts copies;
};

// Two sharded optimizer steps on dp_shard 2 x tp 2 with the plan's shards on `device`: the
// gradients are set from a fixed pattern (host values, uploaded before the counting), large
// enough that clipping engages (max_grad_norm 0.5). Returns rank r's outcome at index r.
std::vector<OptimizerOutcome> optimizer_steps(kernels::Device device) {
  Config c = testing::make_config({.layers = 1});
  c.training.max_grad_norm = 0.5;
  const mesh::DeviceMesh m(1, 2, 2);
  mesh::LocalWorldOptions wo;
  wo.device = device;
  mesh::LocalWorld world(m, wo);
  std::vector<OptimizerOutcome> out(static_cast<size_t>(m.world_size()));
  world.run([&](mesh::RankComms& comms) {
    ShardPlan plan(c, m, comms.rank(), FaultHooks{}, device);
    OptimizerOutcome& o = out[static_cast<size_t>(comms.rank())];
    for (int64_t step = 0; step < 2; ++step) {
      for (size_t i = 0; i < plan.params().size(); ++i) {
        ShardedParam& p = plan.params()[i];
        std::vector<float> g(static_cast<size_t>(p.grad.numel().value));
        const size_t salt = i * 104729 + static_cast<size_t>(step * 31 + comms.rank() * 17);
        for (size_t k = 0; k < g.size(); ++k)
          g[k] = static_cast<float>(static_cast<int>((k * 7919 + salt) % 201) - 100) / 64.0f;
        p.grad.copy_from(kernels::Tensor::from_vector(p.grad.shape(), g));
      }
      const CopyCounts before = kernels::current_context().copies->counts();
      o.grad_norm = sharded_optimizer_step(plan, comms, c.training, step).grad_norm;
      kernels::synchronize_current();
      if (step == 1) o.copies = kernels::current_context().copies->counts() - before;
    }
    for (const ShardedParam& p : plan.params()) {
      o.master.push_back(p.master.to_vector<float>());
      o.exp_avg.push_back(p.exp_avg.to_vector<float>());
      o.exp_avg_sq.push_back(p.exp_avg_sq.to_vector<float>());
    }
  });
  return out;
}

// The optimizer on device shards (sum_of_squares_total, scale_, adamw_step as device kernels) is
// bitwise the CPU backend's: grad norm, masters and both moments after two clipped steps; the step
// moves exactly one 8-byte scalar to the host (the rank's sum of squares) and nothing up.
TEST_F(DeviceStateGpu, OptimizerStepIsBitwiseTheCpusAndMovesOneScalar) {
  const std::vector<OptimizerOutcome> cpu = optimizer_steps(kernels::Device::cpu());
  const std::vector<OptimizerOutcome> gpu = optimizer_steps(kernels::Device::cuda(0));
  ASSERT_EQ(cpu.size(), gpu.size());
  for (size_t r = 0; r < cpu.size(); ++r) {
    EXPECT_EQ(cpu[r].grad_norm, gpu[r].grad_norm) << "rank " << r;
    EXPECT_GT(cpu[r].grad_norm, 0.5) << "clipping must engage";
    EXPECT_EQ(cpu[r].master, gpu[r].master) << "rank " << r;
    EXPECT_EQ(cpu[r].exp_avg, gpu[r].exp_avg) << "rank " << r;
    EXPECT_EQ(cpu[r].exp_avg_sq, gpu[r].exp_avg_sq) << "rank " << r;
    EXPECT_EQ(cpu[r].copies.total(), 0) << "the CPU backend crosses no PCIe";
    EXPECT_EQ(gpu[r].copies.device_to_host, 8) << "rank " << r;
    EXPECT_EQ(gpu[r].copies.host_to_device, 0) << "rank " << r;
    EXPECT_EQ(gpu[r].copies.copies, 1) << "rank " << r;
  }
}

// The acceptance of issue #15's traffic item (docs/design.md, "Host-device traffic per step"): on
// a step without a checkpoint save or a trace, no rank moves a single bulk byte between the host
// and the device, in either direction: the tokens are made on the device, the embedding's ids
// and the loss's targets are checked there, its row losses summed there, the amaxes reduced there,
// and only scalars (at most 8 bytes each: the loss of each micro-batch, the id checks' words, the
// rank's sum of squares) cross. Every step is held to it, the first included (the Markov tables
// are uploaded at construction, before `before_start`). Both recipes of the scenario (current and
// mxfp8), and two micro-batches so that the accumulation path is covered too.
TEST_F(DeviceStateGpu, StepsMoveOnlyScalars) {
  for (RunOptions o : scenario_runs()) {
    o.config.training.micro_batches = 2;
    o.steps = 3;
    const Counted c = run_counted(o);
    ASSERT_EQ(c.result.metrics.size(), 3u);
    for (size_t r = 0; r < c.steps.size(); ++r) {
      ASSERT_EQ(c.steps[r].size(), 3u) << "rank " << r;
      for (size_t k = 0; k < c.steps[r].size(); ++k) {
        const CopyCounts& s = c.steps[r][k];
        EXPECT_EQ(s.bulk_copies, 0) << "rank " << r << " step " << k + 1;
        EXPECT_EQ(s.bulk_host_to_device, 0) << "rank " << r << " step " << k + 1;
        EXPECT_EQ(s.bulk_device_to_host, 0) << "rank " << r << " step " << k + 1;
        // The loss comes back every micro-batch: at least two scalars, all of at most 8 bytes.
        EXPECT_GE(s.copies, 2) << "rank " << r << " step " << k + 1;
        EXPECT_LE(s.total(), s.copies * kernels::kScalarCopyBytes)
            << "rank " << r << " step " << k + 1;
        if (r == 0)
          RecordProperty("scalar_copies_rank0_step" + std::to_string(k + 1),
                         std::to_string(s.copies));
      }
    }
  }
}

// The same for NVFP4 weights (their tile codes, the FP8 all-gather of packed FP4 bytes and the
// columnwise rebuild run on the device): the nvfp4 entries of scenarios/fp8_all_gather.yaml
// (dp_shard 4, and dp_shard 2 x tp 2) on cuda:0, two steps, without the scenario's
// allgather_parity check (a check, which downloads what it compares).
TEST_F(DeviceStateGpu, Nvfp4AllGatherStepsMoveOnlyScalars) {
  int runs = 0;
  for (const harness::Scenario& s : harness::load_scenario_file(
           (test_support::source_dir() / "scenarios/fp8_all_gather.yaml").string())) {
    RunOptions o = harness::engine_run_options(s);
    if (o.config.recipe.kind != RecipeKind::kNvfp4) continue;
    o.backend = kernels::Device::cuda(0);
    o.launcher = "local";
    o.allgather_parity = false;
    o.steps = 2;
    const Counted c = run_counted(o);
    ASSERT_EQ(c.result.metrics.size(), 2u);
    ++runs;
    for (size_t r = 0; r < c.steps.size(); ++r)
      for (size_t k = 0; k < c.steps[r].size(); ++k) {
        EXPECT_EQ(c.steps[r][k].bulk_copies, 0) << "rank " << r << " step " << k + 1;
        EXPECT_LE(c.steps[r][k].total(), c.steps[r][k].copies * kernels::kScalarCopyBytes)
            << "rank " << r << " step " << k + 1;
      }
  }
  EXPECT_EQ(runs, 2) << "the scenario's two nvfp4 meshes";
}

// Pipeline stages (pp = 2 x FSDP 2, both schedules and both recipes of scenarios/pp_fsdp.yaml)
// on cuda:0: the activations and gradients between stages travel device to device
// (mesh/local/local_comm.cc send/recv), so the steps move only scalars. A pipelined run takes no
// step hooks (engine/config/run_rules.cc), so the steps' traffic is measured as the process's
// copies of a 4-step run minus those of a 2-step run of the same options (construction, the end of
// the run and the reports are the same in both): the two extra steps must add no bulk copy and only
// scalars.
TEST_F(DeviceStateGpu, PipelineStepsMoveOnlyScalars) {
  int runs = 0;
  for (const harness::Scenario& s : harness::load_scenario_file(
           (test_support::source_dir() / "scenarios/pp_fsdp.yaml").string())) {
    RunOptions o = harness::engine_run_options(s);
    ASSERT_EQ(o.mesh.pp, 2);
    o.backend = kernels::Device::cuda(0);
    o.launcher = "local";
    const auto counted = [&](int64_t steps) {
      RunOptions r = o;
      r.steps = steps;
      const CopyCounts before = kernels::global_copy_counter().counts();
      const RunResult result = run_training(r);
      EXPECT_EQ(result.metrics.size(), static_cast<size_t>(steps)) << s.name;
      return kernels::global_copy_counter().counts() - before;
    };
    const CopyCounts two = counted(2), four = counted(4);
    const CopyCounts steps = four - two;
    ++runs;
    EXPECT_EQ(steps.bulk_copies, 0) << s.name;
    EXPECT_EQ(steps.bulk_host_to_device, 0) << s.name;
    EXPECT_EQ(steps.bulk_device_to_host, 0) << s.name;
    // The loss of each micro-batch comes back: at least one scalar per extra step.
    EXPECT_GE(steps.copies, 2) << s.name;
    EXPECT_LE(steps.total(), steps.copies * kernels::kScalarCopyBytes) << s.name;
  }
  EXPECT_EQ(runs, 4) << "the scenario's two schedules x two recipes";
}

// MoE layers on the device (docs/design.md section 37): the model of scenarios/moe_fsdp.yaml
// (4 experts, top 2, shared expert; both recipes, fp32 and mxfp8) on 1 rank, FSDP 2 and FSDP 2 x
// ep 2, two micro-batches, three steps. Without the load-balancing loss the only bulk copies of a
// step are the routers' per-expert counts: downloads of exactly E int64 (32 bytes), at least one
// per MoE layer and micro-batch, nothing uploaded. With the loss (the scenario's 0.01) the
// statistics travel too, each copy still a handful of numbers: at most the gathered statistics
// of every rank ((2E + 1) doubles per rank), never a token row block (rows x hidden).
TEST_F(DeviceStateGpu, MoeStepsMoveOnlyScalarsAndExpertCounts) {
  int runs = 0;
  for (const harness::Scenario& s : harness::load_scenario_file(
           (test_support::source_dir() / "scenarios/moe_fsdp.yaml").string())) {
    for (const auto& [shard, ep] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{2, 2}})
      for (double aux : {0.0, 0.01}) {
        RunOptions o = harness::engine_run_options(s);
        o.backend = kernels::Device::cuda(0);
        o.launcher = "local";
        o.mesh = MeshSpec{};
        o.mesh.dp_shard = shard;
        o.mesh.ep = ep;
        o.config.training.micro_batches = 2;
        o.config.model.moe.aux_loss_coef = aux;
        o.steps = 3;
        const int64_t experts = o.config.model.moe.experts;
        int64_t layers = 0;  // MoE layers: layer i is one when i % every == 0
        for (int64_t i = 0; i < o.config.model.layers; ++i)
          layers += i % o.config.model.moe.every == 0;
        ASSERT_EQ(experts, 4);
        const std::string what = s.name + " dp_shard " + std::to_string(shard) + " ep " +
                                 std::to_string(ep) + " aux " + std::to_string(aux);
        const Counted c = run_counted(o);
        ASSERT_EQ(c.result.metrics.size(), 3u) << what;
        ++runs;
        for (size_t r = 0; r < c.steps.size(); ++r)
          for (size_t k = 0; k < c.steps[r].size(); ++k) {
            const CopyCounts& n = c.steps[r][k];
            const std::string at =
                what + " rank " + std::to_string(r) + " step " + std::to_string(k + 1);
            EXPECT_GE(n.bulk_copies, layers * 2) << at
                                                 << ": a count download per layer and "
                                                    "micro-batch";
            if (aux == 0.0) {
              EXPECT_EQ(n.bulk_host_to_device, 0) << at;
              EXPECT_EQ(n.bulk_device_to_host, n.bulk_copies * experts * 8) << at;
            } else {
              EXPECT_LE(n.bulk_host_to_device + n.bulk_device_to_host,
                        n.bulk_copies * shard * (2 * experts + 1) * 8)
                  << at;
            }
          }
      }
  }
  EXPECT_EQ(runs, 12) << "two recipes x three meshes x two aux settings";
}

// A checkpoint save downloads this rank's state in one batched copy (kernels::to_host_batched):
// the step with a save moves exactly one bulk download more than the steps without.
TEST_F(DeviceStateGpu, CheckpointSaveIsOneBatchedDownload) {
  const RunOptions o = scenario_runs().at(0);
  const fs::path root =
      fs::temp_directory_path() / ("meshproof_devstate_" + std::to_string(::getpid()));
  fs::remove_all(root);
  std::vector<CopyCounts> during_save(static_cast<size_t>(o.mesh.world_size()));
  const Counted c = run_counted(o, [&](ShardedState& state, mesh::RankComms& comms, int64_t done) {
    if (done != 2) return false;
    const CopyCounts before = kernels::current_context().copies->counts();
    save_checkpoint(root, done, state, comms);
    during_save[static_cast<size_t>(comms.rank())] =
        kernels::current_context().copies->counts() - before;
    return true;
  });
  ASSERT_EQ(c.result.metrics.size(), static_cast<size_t>(o.config.training.steps));
  for (size_t r = 0; r < during_save.size(); ++r) {
    EXPECT_EQ(during_save[r].bulk_host_to_device, 0) << "rank " << r;
    EXPECT_GT(during_save[r].bulk_device_to_host, 0) << "rank " << r;
    // One bulk copy; the save's other copies are the agreement's scalars
    // (engine/checkpoint/checkpoint.cc).
    EXPECT_EQ(during_save[r].bulk_copies, 1) << "rank " << r;
  }
  fs::remove_all(root);
}

// The leak check: 30 runs in one process (streams, communicators, cuBLASLt handles and
// workspaces created and destroyed per run) leave the device's free memory where the first run
// left it. Tolerance 64 MiB: the stream-ordered pool keeps what the first run reserved (its
// release threshold is raised, kernels/core/tensor.cc), so a flat process differs only by allocator
// granularity (2 MiB pages); one leaked cuBLASLt workspace per virtual rank and run (8 x 4 MiB or
// more) would exceed it within the first two runs of the 29 measured.
TEST_F(DeviceStateGpu, ThirtyRunsKeepDeviceMemoryFlat) {
  RunOptions o = scenario_runs().at(0);
  o.steps = 2;
  run_training(o);  // warm-up: the pool, the library handles and the kernels' modules
  size_t free0 = 0, total = 0;
  MP_CUDA_CHECK(cudaMemGetInfo(&free0, &total));
  for (int i = 1; i < 30; ++i) run_training(o);
  size_t free1 = 0;
  MP_CUDA_CHECK(cudaMemGetInfo(&free1, &total));
  const int64_t lost = static_cast<int64_t>(free0) - static_cast<int64_t>(free1);
  RecordProperty("device_bytes_lost_over_29_runs", std::to_string(lost));
  EXPECT_LE(lost, int64_t{64} << 20) << "free " << free0 << " -> " << free1 << " of " << total;
}

#endif  // MESHPROOF_HAVE_CUDA

}  // namespace
}  // namespace meshproof::engine
