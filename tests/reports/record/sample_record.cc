#include "sample_record.h"

#include <cmath>

#include "reports/record/perf_metrics.h"

namespace meshproof::reports::testing {
namespace {

constexpr int64_t kMiB = 1024 * 1024;

// The tiny GPT of the scenario library: L=4, H=512, F=2048, V=32000, S=1024, batch 8.
ModelShape tiny_gpt() { return {4, 512, 2048, 32000, 1024, false}; }

// Loss curve of a model learning an order-2 Markov source with a floor of ~2.1 nats, plus a
// deterministic wiggle so that lines are not perfectly smooth.
double golden_loss(int64_t step) {
  return 2.1 + 8.3 * std::exp(-0.18 * static_cast<double>(step)) +
         0.02 * std::sin(1.7 * static_cast<double>(step));
}

std::vector<StepMetrics> steps(int n, double drift_after, double drift_rate, double compute_s,
                               bool tp) {
  std::vector<StepMetrics> out;
  for (int i = 1; i <= n; ++i) {
    StepMetrics m;
    m.step = i;
    const double g = golden_loss(i);
    // Mesh reordering noise ~1e-4 relative; a drift grows linearly after `drift_after`.
    double rel = 1e-4 * std::sin(3.1 * i);
    if (i > drift_after) rel += drift_rate * (i - drift_after);
    m.loss = g * (1 + rel);
    m.grad_norm = 1.5 * std::exp(-0.1 * i) + 0.3;
    m.lr = 3e-4 * std::min(1.0, i / 5.0);
    m.tokens = 8 * 1024;
    m.time.compute_s = compute_s * (i == 1 ? 6.0 : 1.0 + 0.01 * std::sin(i));
    m.time.collectives = {{CollectiveKind::kAllGather, 0.0042 + 0.0001 * std::cos(i)},
                          {CollectiveKind::kReduceScatter, 0.0031}};
    if (tp) {
      m.time.collectives.push_back({CollectiveKind::kAllReduce, 0.0024});
    }
    m.time.optimizer_s = 0.0018;
    m.time.checkpoint_s = i == 10 ? 0.041 : 0.0;
    double total = m.time.compute_s + m.time.optimizer_s + m.time.checkpoint_s + 0.0009;
    for (const CollectiveTime& c : m.time.collectives) total += c.seconds;
    m.time.total_s = total;
    out.push_back(m);
  }
  return out;
}

GoldenRecord golden(const std::string& source, int n) {
  GoldenRecord g;
  g.source = source;
  for (int i = 1; i <= n; ++i)
    g.steps.push_back({i, golden_loss(i), 1.5 * std::exp(-0.1 * i) + 0.3});
  // bf16/FP8 runs on another mesh: rel 1e-2 per docs/design.md section 8.
  g.tolerance = {"tolerance", 1e-2, 1e-5, 0};
  return g;
}

std::vector<RankMemory> memory(int ranks, int64_t params, int64_t act) {
  std::vector<RankMemory> out;
  for (int r = 0; r < ranks; ++r) {
    RankMemory m;
    m.rank = r;
    m.params_bytes = params;
    m.grads_bytes = params;
    m.optimizer_bytes = 2 * params;
    m.gathered_weights_bytes = 3 * params / 2;
    m.activations_bytes = act + (r % 2) * 8 * kMiB;
    m.peak_bytes = m.params_bytes + m.grads_bytes + m.optimizer_bytes + m.gathered_weights_bytes +
                   m.activations_bytes + 96 * kMiB;
    out.push_back(m);
  }
  return out;
}

CollectiveStats coll(CollectiveKind k, const std::string& group, int n, int64_t count,
                     int64_t bytes, double time_s) {
  CollectiveStats c;
  c.kind = k;
  c.group = group;
  c.group_size = n;
  c.count = count;
  c.bytes = bytes;
  c.time_s = time_s;
  fill_bandwidths(c);
  return c;
}

PerformanceFigures perf(const std::vector<StepMetrics>& s, int devices, const std::string& dtype) {
  PerformanceInputs in;
  in.model = tiny_gpt();
  in.num_devices = devices;
  in.gpu_name = "NVIDIA H100 80GB HBM3";
  in.gemm_dtype = dtype;
  return compute_performance(s, in);
}

}  // namespace

RunRecord sample_record() {
  RunRecord r;
  r.environment.meshproof_version = "0.1.0";
  r.environment.git_commit = "39be77c";
  r.environment.build_type = "Release";
  r.environment.host = "gpu-node-07";
  r.environment.backends_compiled = {"cpu", "cuda"};
  r.environment.cpus = 16;
  r.environment.virtual_ranks = "threads";
  r.environment.active_backend = "cuda:0";
  r.environment.cuda_compiled = true;
  r.environment.cuda_usable = true;
  r.environment.cuda_architectures = "90,100";
  r.environment.cuda_runtime = "12.8";
  r.environment.cuda_driver = "12.8";
  r.environment.cublaslt = "12.8.4";
  r.environment.nccl = "2.26.2";
  r.environment.hdf5 = "1.10.8";
  r.environment.mpi_compiled = true;
  r.environment.mpi_version = "3.1";
  r.environment.mpi_library = "Open MPI v4.1.4";
  r.environment.gpus = {{0, "NVIDIA H100 80GB HBM3", "9.0", 85045051392, 132}};
  r.command_line = {"meshproof",
                    "run",
                    "scenarios/gpt_tiny_fsdp4_mxfp8.yaml",
                    "scenarios/gpt_tiny_hsdp_tp_delayed.yaml",
                    "scenarios/faults/amax_not_reduced.yaml",
                    "--out",
                    "out/"};
  r.start_time = "2026-11-22T04:18:19Z";

  {
    ScenarioRecord s;
    s.name = "gpt_tiny_fsdp4_mxfp8";
    s.config = {{"model", {{"layers", 4}, {"hidden", 512}, {"ffn", 2048}, {"vocab", 32000}}},
                {"mesh", {{"dp_replicate", 1}, {"dp_shard", 4}, {"tp", 1}}},
                {"recipe", "mxfp8"},
                {"train", {{"steps", 20}, {"batch", 8}, {"seq_len", 1024}}}};
    s.mesh = "dp_replicate=1 dp_shard=4 tp=1";
    s.recipe = "mxfp8";
    s.backend = "cuda:0";
    s.steps = steps(20, 1e9, 0, 0.0305, false);
    s.entropy_floor = 2 * std::log(2.0);  // V = 256, decay 0.5
    s.golden = golden("golden/gpt_tiny_fsdp4_mxfp8/h100.h5", 20);
    s.checks = {
        {"golden", "golden", Verdict::kPass, "20 steps within rtol 0.01, atol 1e-05", 0.002,
         std::nullopt},
        {"resume@step10", "resume", Verdict::kPass,
         "resumed run bitwise equal to the straight run (steps 11..20, final state)", 1.4,
         std::nullopt},
        {"allgather_parity", "allgather_parity", Verdict::kPass,
         "gather(quantize(shard)) == quantize(gather(shard)) for 24 weights", 0.31, std::nullopt}};
    s.performance = perf(s.steps, 4, "bf16");  // MXFP8 on Hopper runs emulated bf16 GEMMs
    s.memory = memory(4, 7 * kMiB, 180 * kMiB);
    s.collectives = {
        coll(CollectiveKind::kAllGather, "dp_shard", 4, 640, 20 * 8 * 28 * kMiB, 0.085),
        coll(CollectiveKind::kReduceScatter, "dp_shard", 4, 320, 20 * 28 * kMiB * 4, 0.062)};
    s.notes = {
        "MXFP8 columnwise all-gather fell back to high precision for "
        "layers.0.mlp.fc2.weight (shard rows 96 not a multiple of 32 after padding)"};
    s.duration_s = 3.2;
    r.scenarios.push_back(s);
  }
  {
    ScenarioRecord s;
    s.name = "gpt_tiny_hsdp2x2_tp2_delayed";
    s.config = {{"model", {{"layers", 4}, {"hidden", 512}, {"ffn", 2048}, {"vocab", 32000}}},
                {"mesh", {{"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}}},
                {"recipe", "delayed"},
                {"train", {{"steps", 20}, {"batch", 8}, {"seq_len", 1024}}}};
    s.mesh = "dp_replicate=2 dp_shard=2 tp=2";
    s.recipe = "delayed";
    s.backend = "cuda:0";
    s.steps = steps(20, 6, 4e-3, 0.0182, true);
    s.entropy_floor = 2 * std::log(2.0);
    s.golden = golden("golden/gpt_tiny_hsdp2x2_tp2_delayed/h100.h5", 20);
    Evidence e;
    e.first_diverging_step = 9;
    e.metric = "loss";
    e.tensor = "layers.2.attn.qkv.weight";
    e.expected = golden_loss(9);
    e.actual = s.steps[8].loss;
    e.max_abs_err = std::abs(s.steps[19].loss - golden_loss(20));
    e.max_rel_err = e.max_abs_err.value() / golden_loss(20);
    e.ulp_distance = 5767;
    e.failing_steps = 12;
    s.checks = {{"golden", "golden", Verdict::kFail,
                 "loss left the band |x - g| <= atol + rtol*|g| & stayed out: 12 steps > 0 allowed",
                 0.002, e},
                {"resume@step10", "resume", Verdict::kPass,
                 "resumed run bitwise equal to the straight run", 1.9, std::nullopt},
                {"determinism", "determinism", Verdict::kSkipped,
                 "skipped: --fast runs each scenario once", 0, std::nullopt}};
    s.performance = perf(s.steps, 8, "fp8");
    s.memory = memory(8, 3 * kMiB + kMiB / 2, 120 * kMiB);
    // Its 8 ranks as 2 pipeline stages of 4 (the per-stage table; mean ms per step, the bubble
    // = p2p wait / step: 40 / 200 and 25 / 200; GPipe, 4 micro-batches, 2 stages in unit time
    // with forward 1, backward 2: makespan 15, busy 12, 3 / 15 = 0.2).
    for (int st = 0; st < 2; ++st) {
      PipelineStageRecord p;
      p.stage = st;
      p.ranks = {4 * st, 4 * st + 1, 4 * st + 2, 4 * st + 3};
      p.first_layer = 6 * st;
      p.layers = 6;
      p.warmup_steps = 4;
      p.steady_steps = 16;
      p.mean = {0.040, 0.080, st == 0 ? 0.040 : 0.025, 0.012, 0.020, 0.200};
      p.bubble_fraction = p.mean.p2p_wait_s / p.mean.step_s;
      p.predicted_bubble_fraction = 0.2;
      for (int r : p.ranks) p.peak_bytes.push_back(s.memory[static_cast<size_t>(r)].peak_bytes);
      s.pipeline.push_back(p);
    }
    s.collectives = {
        coll(CollectiveKind::kAllGather, "dp_shard", 2, 640, 20 * 8 * 14 * kMiB, 0.051),
        coll(CollectiveKind::kReduceScatter, "dp_shard", 2, 320, 20 * 14 * kMiB * 4, 0.044),
        coll(CollectiveKind::kAllReduce, "dp_replicate", 2, 320, 20 * 7 * kMiB * 4, 0.040),
        coll(CollectiveKind::kAllReduce, "tp", 2, 1280, 20 * 64 * 2 * kMiB, 0.048)};
    s.duration_s = 4.7;
    r.scenarios.push_back(s);
  }
  {
    ScenarioRecord s;
    s.name = "fault_amax_not_reduced";
    s.config = {{"recipe", "current"},
                {"mesh", {{"dp_replicate", 1}, {"dp_shard", 4}, {"tp", 1}}},
                {"faults", {"amax_not_reduced"}},
                {"expect", "caught"}};
    s.mesh = "dp_replicate=1 dp_shard=4 tp=1";
    s.recipe = "current";
    s.backend = "cuda:0";
    s.expectation = Expectation::kCaught;
    s.caught_by = {"allgather_parity", "reference"};
    s.steps = steps(6, 1e9, 0, 0.0301, false);
    Evidence e;
    e.first_diverging_step = 1;
    e.metric = "params";
    e.tensor = "layers.0.attn.proj.weight";
    e.max_abs_err = 0.03125;
    e.max_rel_err = 0.0625;
    e.ulp_distance = 1;
    s.checks = {{"allgather_parity", "allgather_parity", Verdict::kFail,
                 "FP8 all-gathered weight differs from quantize(gather(shard))", 0.12, e}};
    s.performance = perf(s.steps, 4, "fp8");
    s.memory = memory(4, 7 * kMiB, 180 * kMiB);
    s.duration_s = 1.1;
    r.scenarios.push_back(s);
  }
  r.duration_s = 9.4;
  return r;
}

RunRecord hostile_record() {
  RunRecord r = sample_record();
  const std::string nasty = "a<b>&c\"d'e|f\x01g\xff]]> <script>x</script> http://x";
  r.environment.host = "host" + nasty;
  r.command_line.push_back("--set=name=" + nasty);
  ScenarioRecord& s = r.scenarios[1];
  s.name = "hsdp" + nasty;
  s.mesh = "mesh|" + nasty;
  s.notes.push_back("note " + nasty + "\nsecond line");
  s.checks[0].name = "golden" + nasty;
  s.checks[0].message = "msg " + nasty + "\nline two";
  s.checks[0].evidence->tensor = "layers.0." + nasty;
  s.config["comment"] = "</code>" + nasty;
  // Also exercise the error paths: a scenario that stopped and a check that errored.
  r.scenarios[0].error = "CUDA error: out of memory " + nasty;
  s.checks[1].verdict = Verdict::kError;
  s.checks[1].message = "resume: cannot open checkpoint " + nasty;
  return r;
}

RunRecord wrong_check_record() {
  RunRecord r = sample_record();
  ScenarioRecord& s = r.scenarios[2];
  s.checks[0].verdict = Verdict::kPass;
  s.checks[0].message = "FP8 all-gathered weights equal quantize(gather(shard))";
  s.checks[0].evidence.reset();
  Evidence e;
  e.first_diverging_step = 3;
  e.metric = "loss";
  e.expected = 3.25;
  e.actual = 3.2578125;
  e.max_abs_err = 0.0078125;
  s.checks.push_back({"determinism", "determinism", Verdict::kFail,
                      "rerun differs from the run at step 3", 0.4, e});
  return r;
}

}  // namespace meshproof::reports::testing
