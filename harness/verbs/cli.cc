#include "harness/verbs/cli.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "harness/verbs/bench_comm_verb.h"
#include "harness/verbs/bench_recipes_verb.h"
#include "harness/verbs/ckpt_verb.h"
#include "harness/verbs/env_verb.h"
#include "harness/verbs/exit_codes.h"
#include "harness/verbs/export_verb.h"
#include "harness/verbs/quantize_verb.h"
#include "harness/verbs/report_verb.h"
#include "harness/verbs/run_verb.h"
#include "harness/verbs/validate_verb.h"
#include "kernels/core/build_info.h"
#include "kernels/core/error.h"
#include "kernels/core/hdf5_check.h"
#include "reports/record/environment.h"

namespace meshproof::harness {
namespace {

// Each verb registers its subcommand and sets `exit_code` from its callback.
void add_env_command(CLI::App& app, std::ostream& out, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "env", "Show compiled backends, CUDA/cuBLASLt/NCCL/MPI versions and the GPUs found");
  auto json = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json, "Print the environment as JSON");
  cmd->callback([&out, &exit_code, json] {
    const reports::EnvironmentRecord env = collect_environment(/*open_cublaslt=*/true);
    if (*json) {
      out << reports::to_json(env).dump(2) << "\n";
    } else {
      print_environment(env, out);
    }
    exit_code = kExitOk;
  });
}

}  // namespace

int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  kernels::silence_hdf5_errors();
  CLI::App app{
      "meshproof: run FP8/MXFP8 sharded transformer training scenarios under FSDP, HSDP and TP "
      "meshes, check resume parity and loss against golden references, and report performance.",
      "meshproof"};
  app.set_version_flag("--version", fmt::format("meshproof {} (commit {})", kernels::version(),
                                                kernels::git_commit()));
  // Not require_subcommand(): CLI11 checks requirements before unknown arguments, and a user who
  // typed a wrong flag should be told about that flag first.
  app.require_subcommand(0, 1);
  app.fallthrough(false);

  int exit_code = kExitOk;
  // The invocation as given, for the report's command_line and the golden's provenance.
  const std::vector<std::string> args(argv, argv + argc);
  // One line per verb; each verb's options and callback live with its harness function.
  add_env_command(app, out, exit_code);
  add_validate_command(app, out, err, exit_code);
  add_run_command(app, args, out, err, exit_code);
  add_golden_command(app, args, out, err, exit_code);
  add_faults_command(app, out, exit_code);
  add_export_command(app, out, exit_code);
  add_quantize_command(app, out, exit_code);
  add_bench_comm_command(app, out, exit_code);
  add_bench_recipes_command(app, out, exit_code);
  add_report_command(app, out, exit_code);
  add_ckpt_command(app, out, exit_code);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    out << app.help();
    return kExitOk;
  } catch (const CLI::CallForAllHelp& e) {
    out << app.help("", CLI::AppFormatMode::All);
    return kExitOk;
  } catch (const CLI::CallForVersion& e) {
    out << e.what() << "\n";
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    fmt::print(err, "meshproof: {}\n\n{}", e.what(), app.help());
    return kExitBadInput;
  } catch (const kernels::Error& e) {
    if (e.kind() == kernels::ErrorKind::kInput) {
      fmt::print(err, "meshproof: error: {}\n", e.message());
      return kExitBadInput;
    }
    if (e.kind() == kernels::ErrorKind::kIntegrity) {
      fmt::print(err, "meshproof: integrity check failed: {}\n", e.message());
      return kExitCheckFailed;
    }
    fmt::print(err, "meshproof: runtime error: {}\n", e.what());
    return kExitRuntimeError;
  } catch (const std::exception& e) {
    fmt::print(err, "meshproof: runtime error: {}\n", e.what());
    return kExitRuntimeError;
  }
  if (app.get_subcommands().empty()) {
    fmt::print(err, "meshproof: a verb is required\n\n{}", app.help());
    return kExitBadInput;
  }
  return exit_code;
}

}  // namespace meshproof::harness
