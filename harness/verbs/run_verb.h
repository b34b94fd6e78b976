// `meshproof run`, `meshproof golden update|import|export` and `meshproof faults` (docs/design.md
// sections 10 and 41).
//   run SCENARIO... [--backend cpu|cuda|auto] [--launcher local|mpi] [--out DIR] [--filter NAME]
//       [--set k=v]... [--golden-dir DIR] [--trace] [--quiet]
//     Loads and validates every scenario first (bad input: exit 2, nothing run or written), runs
//     each with its checks, writes report.json/.md/junit.xml/.html into --out (default
//     out/<UTC timestamp>). Exit 0 when every scenario met its expectation, 1 when one did not,
//     3 on runtime errors (a scenario or check that could not run).
//     Before any work: an explicit cuda backend without a GPU, an --out that is a file or not
//     writable, or local-launcher scenarios in every rank of an mpirun job are exit 2.
//   golden update SCENARIO... [--backend B] [--launcher L] [--platform P | --force-platform P]
//       [--filter NAME] [--set k=v]... [--golden-dir DIR]
//     Runs the scenarios and writes golden/<scenario>/<platform>.h5 atomically, the platform
//     derived from the device each run uses (--platform: a guard that it is P; --force-platform:
//     another name, [a-z0-9_-]+), printing the signed mean relative shift of each metric
//     against the previous golden.
//   golden import FILE --scenario NAME [--platform P] [--format auto|megatron|jsonl]
//     Another tool's loss curve (Megatron-LM golden values JSON, a JSON-lines log) as the golden
//     of NAME, with its steps and provenance; `run` compares it with the scenario's tolerance.
//   golden export GOLDEN --format megatron [--out FILE]
//     A golden as Megatron-LM golden values JSON.
//   faults
//     The fault catalog: each fault, the bug class it reproduces and the checks that catch it.
#pragma once

#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace meshproof::harness {

struct RunVerbOptions {
  std::vector<std::string> paths;
  std::vector<std::string> sets;
  std::string backend;   // "" (scenario's own), cpu, cuda, auto
  std::string launcher;  // "" (scenario's own), local, mpi
  std::string out_dir;   // "" -> out/<timestamp>
  std::string filter;
  std::string golden_dir = "golden";
  std::string from_checkpoint;  // "" or a step_NNNNNNN/ every scenario starts from
  bool trace = false;
  bool quiet = false;     // one line per scenario
  bool progress = false;  // live progress (the CLI sets it on a terminal outside CI)
  std::vector<std::string> command_line;  // argv as given (report.json command_line)
};

int run_verb(const RunVerbOptions& opts, std::ostream& out, std::ostream& err);

struct GoldenUpdateOptions {
  std::vector<std::string> paths;
  std::vector<std::string> sets;
  std::string filter;
  // The golden's platform is derived from the device each run uses (cpu or the GPU family).
  std::string platform;        // --platform: a guard, refuse (exit 2) unless it is the derived one
  std::string force_platform;  // --force-platform: the file name instead, [a-z0-9_-]+
  std::string backend;
  std::string launcher;  // "" (scenario's own), local, mpi
  std::string golden_dir = "golden";
  std::vector<std::string> command_line;  // argv as given (the golden's `command`, shell-quoted)
};

int golden_update_verb(const GoldenUpdateOptions& opts, std::ostream& out, std::ostream& err);

// `golden import FILE --scenario NAME [--platform P] [--format auto|megatron|jsonl]
// [--golden-dir DIR]`: another tool's loss curve as golden/<scenario>/<platform>.h5
// (harness/checks/golden_import.h), compared by `run` with the scenario's tolerance.
struct GoldenImportOptions {
  std::string file;
  std::string scenario;
  std::string platform = "cpu";
  std::string format = "auto";
  std::string golden_dir = "golden";
  std::vector<std::string> command_line;
};
int golden_import_verb(const GoldenImportOptions& opts, std::ostream& out);

// `golden export GOLDEN --format megatron [--out FILE]`: the golden as Megatron-LM golden values.
struct GoldenExportOptions {
  std::string golden;
  std::string format = "megatron";
  std::string out;  // empty: standard output
};
int golden_export_verb(const GoldenExportOptions& opts, std::ostream& out);

// `meshproof faults`: every row of the fault table (harness/faults/scenario_faults.h) with its
// bug class, the checks that catch it, what a scenario needs for it and each parameter's type,
// range and default.
void print_fault_catalog(std::ostream& out);
// The same table as a JSON array of {name, generic, bug_class, caught_by, needs, params}
// (`meshproof faults --json`): the fault CTests are listed from it at test time.
void print_fault_catalog_json(std::ostream& out);

// `args` is the whole argv as given (it must outlive parsing); the verbs record it.
void add_run_command(CLI::App& app, const std::vector<std::string>& args, std::ostream& out,
                     std::ostream& err, int& exit_code);
void add_golden_command(CLI::App& app, const std::vector<std::string>& args, std::ostream& out,
                        std::ostream& err, int& exit_code);

// argv joined into one line a POSIX shell reads back as the same words: words of only
// [A-Za-z0-9_@%+=:,./-] as they are, others in single quotes ('\'' for a quote inside).
std::string shell_join(const std::vector<std::string>& args);
void add_faults_command(CLI::App& app, std::ostream& out, int& exit_code);

}  // namespace meshproof::harness
