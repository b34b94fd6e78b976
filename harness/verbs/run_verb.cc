#include "harness/verbs/run_verb.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string_view>

#include "harness/checks/golden.h"
#include "harness/checks/golden_import.h"
#include "harness/faults/scenario_faults.h"
#include "harness/run/runner.h"
#include "harness/verbs/env_verb.h"
#include "harness/verbs/exit_codes.h"
#include "harness/verbs/output_guard.h"
#include "kernels/core/device.h"
#include "kernels/core/error.h"
#include "mesh/core/communicator.h"
#include "mesh/core/library_info.h"
#include "mesh/local/rank_fibers.h"
#include "reports/record/report_error.h"
#include "reports/writers/atomic_file.h"
#include "reports/writers/report_writers.h"

namespace meshproof::harness {
namespace fs = std::filesystem;
namespace {

std::optional<Backend> parse_backend(const std::string& s) {
  if (s.empty()) return std::nullopt;
  if (s == "cpu") return Backend::kCpu;
  if (s == "cuda") return Backend::kCuda;
  if (s == "auto") return Backend::kAuto;
  MP_FAIL_INPUT("--backend {}: expected cpu, cuda or auto", s);
}

std::optional<Launcher> parse_launcher(const std::string& s) {
  if (s.empty()) return std::nullopt;
  if (s == "local") return Launcher::kLocal;
  if (s == "mpi") return Launcher::kMpi;
  MP_FAIL_INPUT("--launcher {}: expected local or mpi", s);
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// "2026-11-22T04:18:19Z" -> "20261122T041819Z" (a folder name without colons).
std::string compact_timestamp(const std::string& iso) {
  std::string out;
  for (char c : iso)
    if (c != '-' && c != ':') out += c;
  return out;
}

// Issue #17.6: under mpirun/srun every process runs the verb. That is right for scenarios on the
// mpi launcher (one rank each); a local-launcher scenario would run whole in every process, all
// racing on one output folder. Refused before any work.
void check_not_several_local_runs(const std::vector<Scenario>& scenarios,
                                  const std::optional<Launcher>& launcher, std::string_view verb) {
  std::string source;
  const int world = mesh::launched_world_size(&source);
  if (world <= 1) return;
  for (const Scenario& s : scenarios) {
    if (launcher.value_or(s.launcher) == Launcher::kMpi) continue;
    MP_FAIL_INPUT(
        "{}: scenario {}: this process is one of {} MPI ranks ({}) but the scenario runs on the "
        "local launcher, so every rank would run all of it and write the same output; pass "
        "--launcher mpi to `meshproof {}` (the mesh must have {} ranks), or run it without "
        "mpirun",
        s.source, s.name, world, source, verb, world);
  }
}

// A --launcher given on the command line replaces each scenario's own after loading; the
// loader's rules for that launcher (launcher mpi runs every check in the scenario's processes,
// so a check mesh of another rank count is refused at its key, e.g. the smaller pp = 1
// reference of a pipelined scenario) are applied here, before any work: loaded again with the
// launcher set, for the problems only (the scenarios run are the ones loaded without it).
void check_launcher_rules(const std::vector<std::string>& paths, std::vector<std::string> sets,
                          const std::string& filter, const std::optional<Launcher>& launcher) {
  if (!launcher) return;
  sets.push_back(fmt::format("launcher={}", to_string(*launcher)));
  (void)load_scenarios(paths, sets, filter);
}

// Issues #17.5, #18.11, #46: before any training (a run that trains for an hour and then cannot
// write its reports lost the hour), the paths the run writes are kept apart from what it reads:
// --out and its four reports, each scenario's checkpoint folder (owned, so it must not hold an
// input, when checkpoint.every prunes there; otherwise the checks only add fresh folders to it)
// against the scenario files and --from-checkpoint (harness/verbs/output_guard.h).
void check_run_outputs(std::string_view verb, const std::vector<std::string>& paths,
                       const std::vector<Scenario>& scenarios, const fs::path& out_dir,
                       const std::string& from_checkpoint) {
  std::vector<NamedPath> inputs, outputs;
  for (const std::string& p : paths) inputs.push_back({"scenario", p});
  if (!from_checkpoint.empty()) inputs.push_back({"--from-checkpoint", from_checkpoint});
  outputs.push_back({"--out", out_dir, OutputKind::kSharedFolder});
  for (const std::string& name : reports::report_file_names())
    outputs.push_back({fmt::format("--out's {}", name), out_dir / name, OutputKind::kFile});
  for (const Scenario& s : scenarios) {
    const fs::path root = checkpoint_root(s, out_dir);
    const bool prunes = s.checkpoint.every > 0;
    outputs.push_back({fmt::format("the checkpoint folder of scenario {}{}", s.name,
                                   s.checkpoint.dir.empty() ? "" : " (checkpoint.dir)"),
                       root, prunes ? OutputKind::kOwnedFolder : OutputKind::kSharedFolder});
  }
  // Two scenarios of one run share a default folder name only when they share a name, and
  // check_run_inputs already refuses two periodic savers in one folder: compare each output
  // with the inputs, and the owned ones with each other.
  std::vector<NamedPath> distinct;
  for (const NamedPath& o : outputs) {
    bool seen = false;
    for (const NamedPath& d : distinct) seen = seen || d.path == o.path;
    if (!seen) distinct.push_back(o);
  }
  check_outputs_apart(verb, inputs, distinct);
}

std::string check_summary(const reports::ScenarioRecord& r) {
  std::string s;
  for (const auto& c : r.checks)
    s += fmt::format("{}{} {}", s.empty() ? "" : ", ", c.name, reports::verdict_name(c.verdict));
  return s.empty() ? "no checks" : s;
}

}  // namespace

int run_verb(const RunVerbOptions& o, std::ostream& out_given, std::ostream& err) {
  const auto t0 = std::chrono::steady_clock::now();
  // Under mpirun/srun every process runs every scenario (the mpi launcher's ranks, which all end
  // with the full results); only rank 0 prints and writes the reports, which the others would
  // repeat line for line and file for file.
  const bool lead = mesh::launched_rank() == 0;
  std::ostream discard(nullptr);
  std::ostream& out = lead ? out_given : discard;
  RunnerOptions opts;
  opts.backend = parse_backend(o.backend);
  opts.launcher = parse_launcher(o.launcher);
  opts.golden_dir = o.golden_dir;
  opts.trace = o.trace;
  opts.progress = lead && o.progress && !o.quiet;
  opts.sets = o.sets;
  // Everything is loaded and validated before anything runs or is written (a malformed
  // MESHPROOF_VIRTUAL_RANKS first: the run rules read it).
  (void)mesh::rank_threading_from_env();
  const std::vector<Scenario> scenarios = load_scenarios(o.paths, o.sets, o.filter);
  check_launcher_rules(o.paths, o.sets, o.filter, opts.launcher);
  check_not_several_local_runs(scenarios, opts.launcher, "run");
  (void)mesh::collective_timeout();  // a malformed MESHPROOF_COLLECTIVE_TIMEOUT is bad input now

  reports::RunRecord record;
  record.environment = collect_environment(kernels::cuda_status().usable);
  record.command_line = o.command_line;
  record.start_time = reports::format_utc(unix_now());
  // An explicit cuda backend without a GPU fails here, before anything runs (runner.h).
  for (const Scenario& s : scenarios) {
    std::string skip;
    (void)resolve_backend(s, opts, record.environment, &skip);
  }
  const fs::path out_dir = o.out_dir.empty()
                               ? fs::path("out") / compact_timestamp(record.start_time)
                               : fs::path(o.out_dir);
  opts.out_dir = out_dir;
  opts.from_checkpoint = o.from_checkpoint;
  // Every input check first (it only derives paths under out_dir), then the folder is created
  // and probed: bad input leaves nothing behind, not even an empty --out folder.
  check_run_outputs("run", o.paths, scenarios, out_dir, o.from_checkpoint);
  check_run_inputs(scenarios, opts);
  if (lead) {
    prepare_output_folder("run", {"--out", out_dir, OutputKind::kSharedFolder},
                          reports::report_file_names());
  } else {
    // The other processes of an mpi launch only wait for rank 0's folder (they write nothing
    // there; orphans are rank 0's to remove).
    prepare_output_folder("run", {"--out", out_dir, OutputKind::kSharedFolder}, {});
  }
  bool any_error = false, any_missed = false;
  for (const Scenario& s : scenarios) {
    if (!o.quiet && !opts.progress) {
      // Non-terminal, non-quiet: announce before the (possibly long) run.
      fmt::print(out, "run   {}  {}\n", s.name, summary_line(s));
      out.flush();
    }
    reports::ScenarioRecord r = run_scenario(s, opts, record.environment, out);
    std::string why;
    const bool met = expectation_met(r, &why);
    bool errored = !r.error.empty();
    for (const auto& c : r.checks) errored = errored || c.verdict == reports::Verdict::kError;
    const bool skipped =
        reports::scenario_verdict(r) == reports::Verdict::kSkipped && r.error.empty();
    any_error = any_error || errored;
    any_missed = any_missed || !met;
    const char* tag = errored ? "ERROR" : !met ? "FAIL " : skipped ? "SKIP " : "OK   ";
    fmt::print(out, "{} {}  expect {}  ({:.1f}s)  {}\n", tag, s.name, to_string(s.expect),
               r.duration_s, check_summary(r));
    // Failing checks print themselves below; say why only for what they do not show.
    if (!met && (s.expect == Expect::kCaught || !r.error.empty())) {
      fmt::print(out, "      {}\n", why);
    }
    for (const auto& c : r.checks) {
      if (c.verdict == reports::Verdict::kFail || c.verdict == reports::Verdict::kError)
        fmt::print(out, "      {}: {}\n", c.name, c.message);
      if (c.verdict == reports::Verdict::kSkipped && &c == &r.checks.front())
        fmt::print(out, "      skipped: {}\n", c.message);
    }
    out.flush();
    record.scenarios.push_back(std::move(r));
  }
  record.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!lead) return any_error ? kExitRuntimeError : any_missed ? kExitCheckFailed : kExitOk;
  // The reports are small: they are written whatever failed above (a checkpoint save on a full
  // disk is a scenario or check error inside them). When they cannot be written either, the
  // summary below still prints and says exactly why (issue #18.11).
  reports::ReportPaths paths;
  std::string not_written;
  try {
    paths = reports::write_reports(record, out_dir);
  } catch (const reports::ReportError& e) {
    if (e.kind() != reports::ReportError::Kind::kIo) throw;
    not_written = e.what();
  }

  // The one-screen summary: one row per scenario.
  size_t width = 8;
  for (const Scenario& s : scenarios) width = std::max(width, s.name.size());
  fmt::print(out, "\n{:<{}}  {:<6}  {:<7}  {:>10}  {}\n", "scenario", width, "expect", "result",
             "final loss", "checks");
  int met_count = 0;
  for (size_t i = 0; i < scenarios.size(); ++i) {
    std::string why;
    const reports::ScenarioRecord& r = record.scenarios[i];
    const bool met = expectation_met(r, &why);
    met_count += met ? 1 : 0;
    const reports::Verdict v = reports::scenario_verdict(r);
    const char* result = !met ? (v == reports::Verdict::kError ? "ERROR" : "FAIL")
                              : (v == reports::Verdict::kSkipped ? "skipped" : "ok");
    const std::string loss = r.steps.empty() ? "-" : fmt::format("{:.6f}", r.steps.back().loss);
    fmt::print(out, "{:<{}}  {:<6}  {:<7}  {:>10}  {}\n", scenarios[i].name, width,
               to_string(scenarios[i].expect), result, loss, check_summary(r));
  }
  fmt::print(out, "\n{} of {} scenario(s) met their expectation in {:.1f}s\n", met_count,
             scenarios.size(), record.duration_s);
  if (!not_written.empty()) {
    fmt::print(err, "meshproof: runtime error: the reports were not written to {}: {}\n",
               out_dir.string(), not_written);
    return kExitRuntimeError;
  }
  fmt::print(out, "reports: {}\n         {}\n         {}\n         {}\n", paths.markdown.string(),
             paths.html.string(), paths.json.string(), paths.junit.string());
  if (any_error) return kExitRuntimeError;
  return any_missed ? kExitCheckFailed : kExitOk;
}

int golden_update_verb(const GoldenUpdateOptions& o, std::ostream& out, std::ostream& err) {
  RunnerOptions opts;
  opts.backend = parse_backend(o.backend);
  opts.launcher = parse_launcher(o.launcher);
  MP_CHECK_INPUT(o.force_platform.empty() || valid_platform_name(o.force_platform),
                 "--force-platform '{}': expected a name of [a-z0-9_-] characters (cpu, h100, ...)",
                 o.force_platform);
  (void)mesh::rank_threading_from_env();
  const std::vector<Scenario> scenarios = load_scenarios(o.paths, o.sets, o.filter);
  check_launcher_rules(o.paths, o.sets, o.filter, opts.launcher);
  check_not_several_local_runs(scenarios, opts.launcher, "golden update");
  (void)mesh::collective_timeout();
  const reports::EnvironmentRecord env = collect_environment(kernels::cuda_status().usable);

  // Plan every scenario before training any: the backend each runs on, the platform that
  // backend's device gives and so the golden it writes. Bad input (an explicit cuda backend
  // without a GPU, --platform naming another platform) ends the verb here with nothing written.
  struct Plan {
    const Scenario* scenario;
    std::string backend;               // "cpu" or "cuda:0"
    std::string platform;              // the golden file's platform
    fs::path path;                     // golden/<scenario>/<platform>.h5
    std::optional<GoldenData> before;  // the golden it replaces, if any
  };
  std::vector<Plan> plans;
  for (const Scenario& s : scenarios) {
    std::string skip;
    const std::optional<std::string> backend = resolve_backend(s, opts, env, &skip);
    if (!backend) {
      fmt::print(out, "skip  {}: {}\n", s.name, skip);
      continue;
    }
    const std::string derived = golden_platform(*backend, env);
    MP_CHECK_INPUT(o.platform.empty() || o.platform == derived,
                   "--platform {}: scenario {} runs on {} here, whose golden platform is {}; a "
                   "golden holds the numbers of the device that produced them (--force-platform "
                   "NAME overrides the file name, knowingly)",
                   o.platform, s.name, device_description(*backend, env), derived);
    const std::string platform = o.force_platform.empty() ? derived : o.force_platform;
    const fs::path path = golden_path(o.golden_dir, s.name, platform);
    plans.push_back({&s, *backend, platform, path, std::nullopt});
  }
  // Issue #46: the goldens written are files of their own, apart from the scenario files (a
  // scenario kept at golden/<name>/cpu.h5 would be replaced), and their folders writable.
  std::vector<NamedPath> inputs, outputs;
  for (const std::string& p : o.paths) inputs.push_back({"scenario", p});
  for (const Plan& plan : plans) {
    NamedPath golden{fmt::format("the golden of scenario {}", plan.scenario->name), plan.path,
                     OutputKind::kFile};
    check_output_file("golden update", golden, /*folders_created=*/true);
    outputs.push_back(std::move(golden));
  }
  check_outputs_apart("golden update", inputs, outputs);
  // The goldens they replace are read now, not after the training: a malformed one is bad input
  // before any work.
  for (Plan& plan : plans) plan.before = read_golden(plan.path);

  for (const Plan& plan : plans) {
    const Scenario& s = *plan.scenario;
    // A golden is the clean run: injected faults are left out so that fault scenarios compare
    // their faulty run against what the run should have produced.
    Scenario clean = s;
    clean.faults.clear();
    clean.backend = plan.backend == "cpu" ? Backend::kCpu : Backend::kCuda;
    if (opts.launcher) clean.launcher = *opts.launcher;
    const TrainOutcome run = train_scenario(clean, TrainRequest{});
    // The platform comes from the device the run used, not from a flag.
    MP_CHECK(golden_platform(run.device, env) == golden_platform(plan.backend, env),
             "scenario {} ran on {} but was planned on {}", s.name, run.device, plan.backend);
    GoldenData g;
    std::vector<double> loss, grad_norm, lr;
    for (const auto& m : run.steps) {
      loss.push_back(m.loss);
      grad_norm.push_back(m.grad_norm);
      lr.push_back(m.lr);
    }
    g.metrics = {{"loss", loss}, {"grad_norm", grad_norm}, {"lr", lr}};
    g.provenance = {{"scenario", s.name},
                    {"scenario_hash", scenario_hash_hex(s)},
                    {"meshproof_version", env.meshproof_version},
                    {"git_commit", env.git_commit},
                    {"backend", plan.backend},
                    {"device", device_description(run.device, env)},
                    {"cuda_runtime", env.cuda_runtime},
                    {"cublaslt", env.cublaslt},
                    {"nccl", env.nccl},
                    {"date", reports::format_utc(unix_now())},
                    {"command", shell_join(o.command_line)}};
    const fs::path& path = plan.path;
    // Under mpirun every process trained the same run; rank 0 alone writes the golden.
    if (mesh::launched_rank() != 0) continue;
    const std::optional<GoldenData>& before = plan.before;
    write_golden(path, g);
    fmt::print(out, "wrote {}  ({} steps)\n", path.string(), loss.size());
    for (const auto& [name, now] : g.metrics) {
      if (name == "lr") continue;
      if (!before || before->metrics.count(name) == 0) {
        fmt::print(out, "      {}: new (no previous golden)\n", name);
        continue;
      }
      const auto shift = mean_relative_shift(before->metrics.at(name), now);
      if (shift) {
        fmt::print(out, "      {}: mean relative shift {:+.3e} vs previous golden\n", name, *shift);
      } else {
        fmt::print(out, "      {}: nothing comparable in the previous golden\n", name);
      }
    }
  }
  return kExitOk;
}

void print_fault_catalog(std::ostream& out) {
  for (const FaultDescriptor& f : fault_table()) {
    fmt::print(
        out, "{}\n  kind:      {}\n  bug class: {}\n  caught by: {}\n", f.name,
        f.generic ? "generic (user-defined: its parameters say what it corrupts)" : "built-in",
        f.bug_class, fmt::join(f.caught_by, ", "));
    std::vector<std::string_view> needs;
    for (const FaultRequirement& r : f.needs) needs.push_back(r.what);
    fmt::print(out, "  needs:     {}\n",
               needs.empty() ? "any scenario" : fmt::format("{}", fmt::join(needs, "; ")));
    for (const FaultParam* p : all_params(f)) {
      fmt::print(out, "  param:     {} ({}): {}\n", p->name, p->describe(), p->doc);
    }
  }
}

void print_fault_catalog_json(std::ostream& out) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const FaultDescriptor& f : fault_table()) {
    nlohmann::ordered_json row;
    row["name"] = f.name;
    row["generic"] = f.generic;
    row["bug_class"] = f.bug_class;
    row["caught_by"] = f.caught_by;
    nlohmann::ordered_json needs = nlohmann::ordered_json::array();
    for (const FaultRequirement& r : f.needs) needs.push_back(r.what);
    row["needs"] = std::move(needs);
    nlohmann::ordered_json params = nlohmann::ordered_json::array();
    for (const FaultParam* p : all_params(f)) {
      params.push_back({{"name", p->name}, {"describe", p->describe()}, {"doc", p->doc}});
    }
    row["params"] = std::move(params);
    rows.push_back(std::move(row));
  }
  out << rows.dump(2) << '\n';
}

std::string shell_join(const std::vector<std::string>& args) {
  std::string out;
  for (const std::string& a : args) {
    if (!out.empty()) out += ' ';
    const bool plain = !a.empty() && std::all_of(a.begin(), a.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) ||
             std::string_view("_@%+=:,./-").find(c) != std::string_view::npos;
    });
    if (plain) {
      out += a;
      continue;
    }
    out += '\'';
    for (char c : a) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += '\'';
  }
  return out;
}

void add_run_command(CLI::App& app, const std::vector<std::string>& args, std::ostream& out,
                     std::ostream& err, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "run", "Run scenarios with their checks and write report.json/.md/.html and junit.xml");
  auto o = std::make_shared<RunVerbOptions>();
  cmd->add_option("SCENARIO", o->paths, "Scenario YAML files or folders")->required();
  cmd->add_option("--backend", o->backend, "cpu, cuda or auto (default: each scenario's own)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  cmd->add_option("--launcher", o->launcher, "local or mpi (default: each scenario's own)")
      ->check(CLI::IsMember({"local", "mpi"}));
  cmd->add_option("--out", o->out_dir, "Report folder (default out/<UTC timestamp>)");
  cmd->add_option("--filter", o->filter, "Run only the scenario with this (expanded or base) name");
  cmd->add_option("--set", o->sets, "Override a field: --set key.path=value (repeatable)")
      ->allow_extra_args(false);
  cmd->add_option("--golden-dir", o->golden_dir, "Golden store root (default golden)");
  cmd->add_option("--from-checkpoint", o->from_checkpoint,
                  "Start from this checkpoint (DIR/step_NNNNNNN, any mesh of the same model) and "
                  "train the remaining steps");
  cmd->add_flag("--trace", o->trace, "Locate the first diverging tensor on check failures");
  cmd->add_flag("--quiet", o->quiet, "One line per scenario, no live progress");
  cmd->callback([&out, &err, &exit_code, &args, o] {
    const char* ci = std::getenv("CI");
    o->progress = isatty(STDOUT_FILENO) && (ci == nullptr || *ci == '\0');
    o->command_line = args;
    exit_code = run_verb(*o, out, err);
  });
}

void add_golden_command(CLI::App& app, const std::vector<std::string>& args, std::ostream& out,
                        std::ostream& err, int& exit_code) {
  auto* golden = app.add_subcommand("golden", "Manage golden references (golden/<scenario>/*.h5)");
  golden->require_subcommand(1);
  auto* cmd = golden->add_subcommand(
      "update", "Run scenarios and (re)write their goldens, printing the shift per metric");
  auto o = std::make_shared<GoldenUpdateOptions>();
  cmd->add_option("SCENARIO", o->paths, "Scenario YAML files or folders")->required();
  cmd->add_option("--platform", o->platform,
                  "Expected golden platform: refuse unless the device the run uses gives it");
  cmd->add_option("--force-platform", o->force_platform,
                  "Write the golden under this platform name ([a-z0-9_-]+) instead of the "
                  "device's (cpu or the GPU family)");
  cmd->add_option("--backend", o->backend, "cpu, cuda or auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  cmd->add_option("--launcher", o->launcher, "local or mpi (default: each scenario's own)")
      ->check(CLI::IsMember({"local", "mpi"}));
  cmd->add_option("--filter", o->filter, "Only the scenario with this (expanded or base) name");
  cmd->add_option("--set", o->sets, "Override a field: --set key.path=value (repeatable)")
      ->allow_extra_args(false);
  cmd->add_option("--golden-dir", o->golden_dir, "Golden store root (default golden)");
  cmd->callback([&out, &err, &exit_code, &args, o] {
    o->command_line = args;
    exit_code = golden_update_verb(*o, out, err);
  });
  auto* imp = golden->add_subcommand(
      "import", "Make another tool's loss curve (Megatron golden JSON or JSON lines) a golden");
  auto io = std::make_shared<GoldenImportOptions>();
  imp->add_option("FILE", io->file, "Megatron-LM golden values JSON, or a JSON-lines loss log")
      ->required();
  imp->add_option("--scenario", io->scenario, "The scenario whose golden it becomes")->required();
  imp->add_option("--platform", io->platform, "Golden platform (default cpu)");
  imp->add_option("--format", io->format, "auto (default), megatron or jsonl")
      ->check(CLI::IsMember({"auto", "megatron", "jsonl"}));
  imp->add_option("--golden-dir", io->golden_dir, "Golden store root (default golden)");
  imp->callback([&out, &exit_code, &args, io] {
    io->command_line = args;
    exit_code = golden_import_verb(*io, out);
  });
  auto* exp = golden->add_subcommand("export", "Write a golden as Megatron-LM golden values JSON");
  auto eo = std::make_shared<GoldenExportOptions>();
  exp->add_option("GOLDEN", eo->golden, "The golden file (golden/<scenario>/<platform>.h5)")
      ->required();
  exp->add_option("--format", eo->format, "megatron (Megatron-LM functional-test golden values)")
      ->required()
      ->check(CLI::IsMember({"megatron"}));
  exp->add_option("--out", eo->out, "Output file (default: standard output)");
  exp->callback([&out, &exit_code, eo] { exit_code = golden_export_verb(*eo, out); });
}

int golden_import_verb(const GoldenImportOptions& o, std::ostream& out) {
  const fs::path target = golden_path(o.golden_dir, o.scenario, o.platform);
  const NamedPath inputs[] = {{"FILE", o.file}};
  const NamedPath outputs[] = {{"the golden of --scenario", target}};
  check_outputs_apart("golden import", inputs, outputs);
  ImportedGolden g = read_golden_source(o.file, o.format);
  check_output_file("golden import", outputs[0], /*folders_created=*/true);
  const reports::EnvironmentRecord env = collect_environment(false);
  g.data.provenance.insert({{"scenario", o.scenario},
                            {"meshproof_version", env.meshproof_version},
                            {"git_commit", env.git_commit},
                            {"date", reports::format_utc(unix_now())},
                            {"command", shell_join(o.command_line)}});
  write_golden(target, g.data);
  std::vector<std::string> names;
  for (const auto& [name, v] : g.data.metrics) names.push_back(name);
  fmt::print(out, "wrote {}  ({} steps, {}..{}; {} from {} {})\n", target.string(),
             g.data.steps.size(), g.data.steps.front(), g.data.steps.back(), fmt::join(names, ", "),
             g.data.provenance.at("source_format"), o.file);
  if (!g.ignored.empty()) fmt::print(out, "      not imported: {}\n", fmt::join(g.ignored, ", "));
  fmt::print(out,
             "      compared by `run` with checks.golden.mode: tolerance (an imported curve is "
             "never compared bitwise)\n");
  return kExitOk;
}

int golden_export_verb(const GoldenExportOptions& o, std::ostream& out) {
  if (!o.out.empty()) {
    const NamedPath inputs[] = {{"GOLDEN", o.golden}};
    const NamedPath outputs[] = {{"--out", o.out}};
    check_outputs_apart("golden export", inputs, outputs);
    check_output_file("golden export", outputs[0]);
  }
  const std::optional<GoldenData> g = read_golden(o.golden);
  MP_CHECK_INPUT(g.has_value(), "golden export: {} does not exist", o.golden);
  const std::string text = golden_as_megatron_json(*g);
  if (o.out.empty()) {
    out << text;
  } else {
    reports::write_file_atomically(o.out, text);
    fmt::print(out, "wrote {}\n", o.out);
  }
  return kExitOk;
}

void add_faults_command(CLI::App& app, std::ostream& out, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "faults", "List the injectable faults, the bug class each reproduces and its checks");
  auto json = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json,
                "Print the table as JSON (name, generic, bug_class, caught_by, needs, params): "
                "what tools and the test suite read instead of the text");
  cmd->callback([&out, &exit_code, json] {
    if (*json) {
      print_fault_catalog_json(out);
    } else {
      print_fault_catalog(out);
    }
    exit_code = kExitOk;
  });
}

}  // namespace meshproof::harness
