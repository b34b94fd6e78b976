// The runner (harness/run/runner.h): backend resolution, the golden update command, the intended
// checks and the expectation of a scenario, performance inputs, and run_scenario's live progress
// over the checks' own runs.
#include "harness/run/runner.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <string>

#include "kernels/core/error.h"
#include "reports/writers/report_writers.h"
#include "runner_test_builders.h"
#include "sample_record.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using reports::Verdict;
using namespace test;

// A machine whose GPU probe found no usable GPU, and the scenario x.yaml the backend tests resolve.
reports::EnvironmentRecord no_gpu_env() {
  reports::EnvironmentRecord env;
  env.cuda_usable = false;
  env.cuda_unusable_reason = "no CUDA driver is installed";
  return env;
}
Scenario scenario_x() {
  Scenario s;
  s.source = "x.yaml";
  s.name = "x";
  return s;
}

// Issue #17.3: an explicit cuda backend without a usable GPU is an input error with the probe's
// reason; requires_gpu scenarios are skipped (with that reason) under auto and cpu
// (ResolveBackend/ResolveBackendRequiresGpu).
TEST(ResolveBackend, ExplicitCudaWithoutGpuIsAnErrorRequiresGpuSkips) {
  reports::EnvironmentRecord env = no_gpu_env();
  Scenario s = scenario_x();
  RunnerOptions opts;
  std::string skip;
  EXPECT_EQ(resolve_backend(s, opts, env, &skip), "cpu");
  opts.backend = Backend::kCuda;
  try {
    (void)resolve_backend(s, opts, env, &skip);
    FAIL() << "--backend cuda accepted without a GPU";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(e.message().find("x.yaml: scenario x: backend cuda (--backend cuda) but no usable "
                               "GPU: no CUDA driver is installed"),
              std::string::npos)
        << e.message();
  }
  opts.backend.reset();
  s.backend = Backend::kCuda;
  EXPECT_THROW((void)resolve_backend(s, opts, env, &skip), kernels::Error);
  s.requires_gpu = true;
  env.cuda_usable = true;
  opts.backend = Backend::kCuda;
  EXPECT_EQ(resolve_backend(s, opts, env, &skip), "cuda:0");
}

class ResolveBackendRequiresGpu : public ::testing::TestWithParam<Backend> {};

// A requires_gpu scenario (its own backend cuda) under --backend auto or cpu on a machine without
// a usable GPU: skipped, with the probe's reason.
TEST_P(ResolveBackendRequiresGpu, SkippedWithTheReasonWithoutAGpu) {
  Scenario s = scenario_x();
  s.backend = Backend::kCuda;
  s.requires_gpu = true;
  RunnerOptions opts;
  opts.backend = GetParam();
  std::string skip;
  EXPECT_FALSE(resolve_backend(s, opts, no_gpu_env(), &skip).has_value());
  EXPECT_EQ(skip, "requires_gpu but no usable GPU: no CUDA driver is installed");
}

INSTANTIATE_TEST_SUITE_P(ResolveBackend, ResolveBackendRequiresGpu,
                         ::testing::Values(Backend::kAuto, Backend::kCpu),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// The printed fix-up command keeps every flag that decides which golden the run read.
TEST(GoldenPlatform, UpdateCommandKeepsGoldenDirAndFlags) {
  Scenario s;
  s.source = "scenarios/tp.yaml";
  s.name = "tp[recipe=bf16]";
  RunnerOptions opts;
  opts.sets = {"train.lr=2e-3", "description=it's"};
  opts.backend = Backend::kCpu;
  opts.launcher = Launcher::kMpi;
  opts.golden_dir = "/tmp/my goldens";
  EXPECT_EQ(golden_update_command(s, opts, "cpu"),
            "meshproof golden update scenarios/tp.yaml --filter 'tp[recipe=bf16]' "
            "--set=train.lr=2e-3 '--set=description=it'\\''s' --backend=cpu --launcher=mpi "
            "'--golden-dir=/tmp/my goldens' --platform=cpu");
}

// The intended checks of a fault scenario: the catalog's caught_by restricted to enabled checks,
// with resume_cross_mesh meaning the resume check with a mesh override.
TEST(IntendedChecks, CatalogRestrictedToEnabledChecks) {
  Scenario s;
  s.expect = Expect::kCaught;
  s.faults = {FaultSpec{"amax_not_reduced", {}, {}, {}}};  // caught by allgather_parity, reference
  s.checks.allgather_parity = true;
  s.checks.golden.enabled = true;
  EXPECT_EQ(intended_checks(s), std::vector<std::string>{"allgather_parity"});
  s.checks.reference.enabled = true;
  EXPECT_EQ(intended_checks(s), (std::vector<std::string>{"allgather_parity", "reference"}));

  Scenario t;
  t.expect = Expect::kCaught;
  t.faults = {FaultSpec{"tp_fsdp_left_to_right", {}, {}, {}}};  // caught by resume_cross_mesh only
  t.checks.resume.enabled = true;
  EXPECT_TRUE(intended_checks(t).empty());  // a same-mesh resume does not count
  t.checks.resume.mesh = engine::MeshSpec{};
  EXPECT_EQ(intended_checks(t), std::vector<std::string>{"resume"});
  t.expect = Expect::kPass;
  EXPECT_TRUE(intended_checks(t).empty());
}

// The exit code of `meshproof run` follows expectation_met, which must agree with the verdict
// the four reports show: a fault caught only by a check outside caught_by is a miss.
TEST(ExpectationMet, AgreesWithTheReportVerdict) {
  std::string why;
  const reports::RunRecord ok = reports::testing::sample_record();
  EXPECT_TRUE(expectation_met(ok.scenarios[0], &why));
  EXPECT_TRUE(expectation_met(ok.scenarios[2], &why)) << why;  // caught by allgather_parity
  EXPECT_FALSE(expectation_met(ok.scenarios[1], &why));        // golden failed
  EXPECT_EQ(why.rfind("check golden failed: ", 0), 0u) << why;

  const reports::RunRecord wrong = reports::testing::wrong_check_record();
  const reports::ScenarioRecord& s = wrong.scenarios[2];
  EXPECT_FALSE(expectation_met(s, &why));
  EXPECT_EQ(why,
            "fault not caught: none of the intended checks (allgather_parity, reference) failed; "
            "determinism failed instead");
  EXPECT_EQ(reports::scenario_verdict(s), Verdict::kFail);
  const nlohmann::json j = nlohmann::json::parse(reports::render_json(wrong));
  EXPECT_EQ(j["scenarios"][2]["verdict"], "fail");
  EXPECT_NE(reports::render_junit(wrong).find("<failure message=\"" + why), std::string::npos);
  EXPECT_NE(reports::render_markdown(wrong).find("| 1 pass, 1 fail | fail |"), std::string::npos);
}

// MFU of a `meshproof run` scenario on a (fake) H100: the GPU name comes from the probed
// environment, eight virtual ranks on cuda:0 are one device, and MXFP8 on Hopper (cc 9.0) is
// emulated with bf16 GEMMs, so the bf16 peak applies.
TEST(PerformanceInputs, H100PeakAndMfu) {
  reports::EnvironmentRecord env;
  env.gpus.push_back(reports::GpuRecord{0, "NVIDIA H100 80GB HBM3", "9.0", 85899345920, 132});
  Scenario s;  // default model: L=2, H=64, F=256, V=256, S=32, GELU
  s.mesh.dp_replicate = 2;
  s.mesh.dp_shard = 2;
  s.mesh.tp = 2;
  s.recipe = default_recipe(RecipeKind::kMxfp8);
  std::string note;
  reports::PerformanceInputs in = performance_inputs(s, "cuda:0", env, &note);
  EXPECT_EQ(in.gpu_name, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(in.num_devices, 1);
  EXPECT_EQ(in.gemm_dtype, "bf16");
  EXPECT_EQ(note, "");

  // Five steps of 0.5 s, 8 sequences of 32 tokens each.
  std::vector<reports::StepMetrics> steps(5);
  for (size_t i = 0; i < steps.size(); ++i) {
    steps[i].step = static_cast<int64_t>(i) + 1;
    steps[i].tokens = 256;
    steps[i].time.total_s = 0.5;
  }
  const reports::PerformanceFigures p = reports::compute_performance(steps, in);
  // P_matmul = 2*(3*64*64 + 64*64 + 2*64*256) + 256*64 = 114688; flops = 6*256*114688 +
  // 12*2*32*64*256 = 188743680 per step; / 0.5 s / 1 device = 3.7748736e-4 TFLOP/s.
  EXPECT_EQ(p.model_flops_per_step, 188743680.0);
  EXPECT_EQ(p.num_devices, 1);
  ASSERT_TRUE(p.peak_tflops.has_value());
  EXPECT_EQ(*p.peak_tflops, 989.0);
  EXPECT_EQ(p.peak_source, "table:H100 bf16");
  ASSERT_TRUE(p.mfu.has_value());
  // One division apart from the hand value: 3.7748736e-4 / 989.
  EXPECT_DOUBLE_EQ(*p.mfu, 188743680.0 / 0.5 / 1e12 / 989.0);

  // Per-tensor FP8 runs fp8 GEMMs on Hopper; MXFP8 does on Blackwell (cc 10.0).
  s.recipe = default_recipe(RecipeKind::kDelayed);
  EXPECT_EQ(performance_inputs(s, "cuda:0", env, &note).gemm_dtype, "fp8");
  env.gpus[0] = reports::GpuRecord{0, "NVIDIA B200", "10.0", 0, 148};
  s.recipe = default_recipe(RecipeKind::kMxfp8);
  in = performance_inputs(s, "cuda:0", env, &note);
  EXPECT_EQ(in.gemm_dtype, "fp8");
  EXPECT_EQ(reports::compute_performance(steps, in).peak_tflops, 4500.0);

  // The mpi launcher puts one process on each GPU of the host (two here, for eight ranks).
  env.gpus.push_back(reports::GpuRecord{1, "NVIDIA B200", "10.0", 0, 148});
  s.launcher = Launcher::kMpi;
  EXPECT_EQ(performance_inputs(s, "cuda:0", env, &note).num_devices, 2);

  // A GPU outside the table and the CPU: no MFU, and a note saying why.
  env.gpus = {reports::GpuRecord{0, "NVIDIA GeForce RTX 4090", "8.9", 0, 128}};
  s.launcher = Launcher::kLocal;
  in = performance_inputs(s, "cuda:0", env, &note);
  EXPECT_FALSE(reports::compute_performance(steps, in).mfu.has_value());
  EXPECT_NE(note.find("no dense bf16 peak for NVIDIA GeForce RTX 4090"), std::string::npos);
  // With a calibration (meshproof run measures a bf16 GEMM on such a GPU) the MFU is against it.
  int calibrated = -1;
  in = performance_inputs(s, "cuda:0", env, &note, [&](int device) {
    calibrated = device;
    return std::optional<double>(150.0);
  });
  EXPECT_EQ(calibrated, 0);
  const reports::PerformanceFigures cal = reports::compute_performance(steps, in);
  ASSERT_TRUE(cal.mfu.has_value());
  EXPECT_EQ(cal.peak_source, "calibration");
  EXPECT_DOUBLE_EQ(*cal.mfu, 188743680.0 / 0.5 / 1e12 / 150.0);
  EXPECT_NE(note.find("MFU against a measured bf16 GEMM (150.0 TFLOP/s"), std::string::npos);
  in = performance_inputs(s, "cpu", env, &note);
  EXPECT_EQ(in.num_devices, 1);
  EXPECT_EQ(in.gpu_name, "");
  EXPECT_FALSE(reports::compute_performance(steps, in).mfu.has_value());
  EXPECT_EQ(note, "MFU n/a: the CPU backend has no dense tensor-core peak");

  // The golden's `device` provenance names the GPU.
  EXPECT_EQ(device_description("cuda:0", env), "NVIDIA GeForce RTX 4090 (cuda:0)");
  EXPECT_EQ(device_description("cuda:1", env), "cuda:1");
  EXPECT_EQ(device_description("cpu", env), "cpu");
}

// Live progress covers the checks' own training runs too: the resume check's two halves and the
// determinism rerun each print their steps, labelled, after the main run.
TEST(RunScenarioProgress, ReRunsOfChecksShowTheirSteps) {
  Scenario s;  // the default model (L=2, H=64), 4 steps of 8 sequences on dp_shard=2
  s.name = "progress_probe";
  s.mesh.dp_shard = 2;
  s.train.steps = 4;
  s.train.batch = 8;
  s.checks.resume.enabled = true;
  s.checks.resume.at_step = 2;
  s.checks.determinism = true;
  RunnerOptions opts;
  opts.backend = Backend::kCpu;
  opts.progress = true;
  opts.out_dir = fs::temp_directory_path() / ("meshproof_progress_" + std::to_string(::getpid()));
  std::ostringstream log;
  const reports::ScenarioRecord r = run_scenario(s, opts, reports::EnvironmentRecord{}, log);
  fs::remove_all(opts.out_dir);
  ASSERT_EQ(r.error, "");
  EXPECT_EQ(reports::scenario_verdict(r), Verdict::kPass);
  const std::string text = log.str();
  const size_t main_run = text.find("progress_probe  step 4/4  loss ");
  const size_t resume = text.find("progress_probe [resume]  step 4/4  loss ");
  const size_t again = text.find("progress_probe [determinism]  step 4/4  loss ");
  ASSERT_NE(main_run, std::string::npos) << text;
  ASSERT_NE(resume, std::string::npos) << text;
  ASSERT_NE(again, std::string::npos) << text;
  EXPECT_LT(main_run, resume);
  EXPECT_LT(resume, again);
  // The resume check's first half is the main run's (it saved after step 2): the check shows the
  // steps it trains, 3 and 4, and no step before the save.
  EXPECT_NE(text.find("progress_probe [resume]  step 3/4"), std::string::npos) << text;
  EXPECT_EQ(text.find("progress_probe [resume]  step 1/4"), std::string::npos) << text;
  // Each run ends by clearing its line, so the next output starts on a clean line.
  EXPECT_EQ(text.substr(text.size() - 4), "\r\033[K");
}

}  // namespace
}  // namespace meshproof::harness
