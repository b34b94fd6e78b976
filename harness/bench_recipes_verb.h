// `meshproof bench recipes`: per recipe (fp32 reference, bf16, delayed, current, mxfp8, block)
// the quantizer throughput, GEMM TFLOP/s per role and the step time of one transformer layer,
// each beside its ceiling (measured copy bandwidth; dense GEMM peak from the perf_metrics table,
// or the measured bf16 GEMM where the device is not in it). Measurement: engine/bench_recipes.h.
// Writes report.json/.md/junit.xml/.html (one scenario per recipe plus "recipes.ceilings", the
// figures in each scenario's `benchmarks` table) and prints a table.
#pragma once

#include <ostream>
#include <string>

#include "engine/bench_recipes.h"
#include "reports/run_record.h"

namespace CLI {
class App;
}

namespace meshproof::harness {

struct BenchRecipesOptions {
  std::string backend = "cpu";  // cpu | cuda | auto
  std::string shapes = "256x256x256";
  std::string layer = "256,1024,4,128,4";  // hidden,ffn,heads,seq,batch
  int iters = 20;
  int warmup = 3;
  std::string out_dir = "bench-recipes";
};

// The run record of a finished measurement: scenario "recipes.ceilings" (copy bandwidth, bf16
// GEMMs) and "recipes.<recipe>" per recipe, each with one check "measured" that fails when a
// figure is not a positive finite number. `gpu_name` selects the peak table row ("" on the CPU).
reports::RunRecord bench_recipes_record(const engine::RecipeBenchReport& rep,
                                        const engine::RecipeBenchOptions& options,
                                        const std::string& backend, const std::string& gpu_name);

// Parses the options, measures, writes the reports into out_dir and prints the table. Returns 0
// when every figure was measured (run verdict pass), 1 otherwise.
int bench_recipes(const BenchRecipesOptions& options, std::ostream& out);

// Registers `bench recipes` (creating the `bench` verb if no other bench registered it first).
void add_bench_recipes_command(CLI::App& app, std::ostream& out, int& exit_code);

}  // namespace meshproof::harness
