// Checks that read the whole model under pipeline stages (docs/design.md section 33): the trace
// digests of FP8 primary weights and the FP8 all-gather parity records. Each stage digests and
// compares only its own parameters; the results are combined over the pp group in model order,
// so a pipelined run must report exactly what the one-stage run on the same inner mesh reports.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>

#include "engine/config/run_rules.h"
#include "engine/model/params.h"
#include "engine/pipeline/pipeline.h"
#include "engine/session/session.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

using testing::expect_same_run;
using testing::make_config;
using testing::run_options;
using testing::TestModel;

// 4 layers over 2 stages, FSDP 2 inside each, 4 micro-batches, FP8 current (or delayed) scaling
// with the FP8 all-gather: every GEMM weight is gathered as FP8 at every use.
RunOptions fp8_options(int pp, PpSchedule schedule, RecipeKind recipe = RecipeKind::kCurrent) {
  TestModel tm;
  tm.layers = 4;
  tm.recipe = recipe;
  Config c = make_config(tm);
  c.training.micro_batches = 4;
  c.training.pp_schedule = schedule;
  MeshSpec m;
  m.pp = pp;
  m.dp_shard = 2;
  RunOptions o = run_options(c, m, 2);
  o.fsdp.fp8_all_gather = true;
  return o;
}

// The parity records ordered by (step, model index of the weight), each weight's records in the
// order they were taken: the order the pipelined run reports them in.
std::vector<AllGatherParity> by_step_and_model_index(std::vector<AllGatherParity> records,
                                                     const Config& c) {
  std::map<std::string, size_t> index;
  const std::vector<ParamSpec> specs = param_specs(c.model);
  for (size_t i = 0; i < specs.size(); ++i) index[specs[i].name] = i;
  std::stable_sort(records.begin(), records.end(), [&](const auto& a, const auto& b) {
    return std::pair(a.step, index.at(a.tensor)) < std::pair(b.step, index.at(b.tensor));
  });
  return records;
}

void expect_same_record(const AllGatherParity& a, const AllGatherParity& b,
                        const std::string& ctx) {
  EXPECT_EQ(a.step, b.step) << ctx;
  EXPECT_EQ(a.tensor, b.tensor) << ctx;
  EXPECT_EQ(a.bytes, b.bytes) << ctx << " " << a.tensor;
  EXPECT_EQ(a.mismatched_bytes, b.mismatched_bytes) << ctx << " " << a.tensor;
  EXPECT_EQ(a.max_abs_error, b.max_abs_error) << ctx << " " << a.tensor;
  EXPECT_EQ(a.scale_inv, b.scale_inv) << ctx << " " << a.tensor;
  EXPECT_EQ(a.reference_scale_inv, b.reference_scale_inv) << ctx << " " << a.tensor;
}

const AllGatherParity* first_mismatch(const std::vector<AllGatherParity>& records) {
  for (const AllGatherParity& p : records)
    if (p.mismatched_bytes > 0) return &p;
  return nullptr;
}

// FP8 primary weights traced: the forward's FP8 state (the FP8 shards' bytes and scales), the
// gradients, the weights and the re-quantized FP8 state of every step, hash for hash and name
// for name the one-stage run's, under both schedules.
TEST(PipelineChecks, Fp8PrimaryWeightDigestsAreOneStages) {
  // Delayed scaling adds its per-linear scales and amax histories (fp8/<linear>/<role>/...),
  // held by the stage of the linear, to the digests.
  for (RecipeKind recipe : {RecipeKind::kCurrent, RecipeKind::kDelayed}) {
    RunOptions one = fp8_options(1, PpSchedule::kGpipe, recipe);
    one.fsdp.fp8_params = true;
    one.trace = true;
    ASSERT_TRUE(check_run(one).empty());
    const RunResult ref = run_training(one);
    ASSERT_EQ(ref.trace.size(), 2u);
    size_t fp8_entries = 0, delayed_entries = 0;
    for (const TensorDigest& d : ref.trace[0]) {
      fp8_entries += d.name.starts_with("fp8/params/") || d.name.starts_with("updated/fp8/params/");
      delayed_entries += d.name.ends_with("/amax_history");
    }
    // 4 layers x 4 GEMM weights (qkv, proj, fc1, fc2), each with data and scale_inv, before and
    // after the step: the digests are not vacuous. Delayed: 16 linears x 3 roles, an amax
    // history each, before and after.
    EXPECT_GE(fp8_entries, 4u * 4u * 2u * 2u);
    if (recipe == RecipeKind::kDelayed) {
      EXPECT_GE(delayed_entries, 16u * 3u * 2u);
    }
    for (PpSchedule sched : {PpSchedule::kGpipe, PpSchedule::kOneFOneB}) {
      RunOptions o = fp8_options(2, sched, recipe);
      o.fsdp.fp8_params = true;
      o.trace = true;
      EXPECT_TRUE(check_run(o).empty()) << pp_schedule_name(sched);
      const RunResult run = run_training(o);
      const std::string ctx =
          fmt::format("{} pp 2 {}", recipe_name(recipe), pp_schedule_name(sched));
      expect_same_run(ref, run, ctx);
      ASSERT_EQ(run.trace.size(), ref.trace.size()) << ctx;
      for (size_t step = 0; step < ref.trace.size(); ++step) {
        ASSERT_EQ(run.trace[step].size(), ref.trace[step].size()) << ctx << " step " << step;
        for (size_t i = 0; i < ref.trace[step].size(); ++i) {
          EXPECT_EQ(run.trace[step][i].name, ref.trace[step][i].name) << ctx << " step " << step;
          EXPECT_EQ(run.trace[step][i].hash, ref.trace[step][i].hash)
              << ctx << " step " << step << " " << ref.trace[step][i].name;
          EXPECT_EQ(run.trace[step][i].shape, ref.trace[step][i].shape)
              << ctx << " " << ref.trace[step][i].name;
        }
      }
    }
  }
}

// The all-gather parity records under stages: every stage compares its own FP8 gathers; the
// merged list is the one-stage list in (step, model index) order record for record, and the
// record the check reports first (the first mismatch) is the one-stage run's first, with and
// without a fault that breaks parity (scale_inv_gathered_bf16: current scaling's scale_inv =
// amax / 448 is not exact in bf16; amax_not_reduced: each shard quantized with its own amax).
TEST(PipelineChecks, AllGatherParityIsOneStages) {
  for (const char* fault : {"none", "scale_inv_gathered_bf16", "amax_not_reduced"}) {
    const auto with_fault = [&](RunOptions o) {
      o.allgather_parity = true;
      o.faults.scale_inv_gathered_bf16 = std::string(fault) == "scale_inv_gathered_bf16";
      o.faults.amax_not_reduced = std::string(fault) == "amax_not_reduced";
      return o;
    };
    const RunOptions one = with_fault(fp8_options(1, PpSchedule::kGpipe));
    const RunResult ref = run_training(one);
    ASSERT_FALSE(ref.parity.empty()) << fault;
    const std::vector<AllGatherParity> want = by_step_and_model_index(ref.parity, one.config);
    const AllGatherParity* ref_first = first_mismatch(ref.parity);
    if (std::string(fault) == "none") {
      EXPECT_EQ(ref_first, nullptr);
    } else {
      ASSERT_NE(ref_first, nullptr) << fault;  // the fault breaks parity with one stage
    }
    for (PpSchedule sched : {PpSchedule::kGpipe, PpSchedule::kOneFOneB}) {
      const RunOptions o = with_fault(fp8_options(2, sched));
      EXPECT_TRUE(check_run(o).empty()) << fault;
      const RunResult run = run_training(o);
      const std::string ctx = fmt::format("{} pp 2 {}", fault, pp_schedule_name(sched));
      ASSERT_EQ(run.parity.size(), want.size()) << ctx;
      for (size_t i = 0; i < want.size(); ++i) expect_same_record(run.parity[i], want[i], ctx);
      const AllGatherParity* first = first_mismatch(run.parity);
      ASSERT_EQ(first == nullptr, ref_first == nullptr) << ctx;
      if (first != nullptr) expect_same_record(*first, *ref_first, ctx + " first mismatch");
    }
  }
}

}  // namespace
}  // namespace meshproof::engine
