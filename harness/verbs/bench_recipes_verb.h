// `meshproof bench recipes`: per recipe (every row of the engine's recipe table) and per GEMM of
// a model's linear layers (qkv, proj, fc1, fc2 x fprop, dgrad, wgrad): BF16 time at the same
// shape, the recipe's GEMM time, its quantization time and the autocast and pre-quantized
// speedups over BF16; a forward M sweep; the grouped expert GEMM over an uneven split of the
// tokens (one expert with none); one layer's step time, tokens/s, MFU (GPU only) and peak
// memory; optionally the loss after N training steps against BF16 and fp32. Emulated figures
// (every CPU figure, MXFP8 below sm_100, block scaling) carry their reason in every report.
// Measurement: engine/bench/bench_recipes.h; the contract: docs/design.md section 26.
// Writes report.json/.md/junit.xml/.html (one scenario per recipe plus "recipes.ceilings", the
// figures in each scenario's `benchmarks` table, every repetition kept), optionally a results
// file pair <prefix>.json + <prefix>.md, and prints a table.
#pragma once

#include <ostream>
#include <string>

#include "engine/bench/bench_recipes.h"
#include "reports/record/run_record.h"

namespace CLI {
class App;
}

namespace meshproof::harness {

struct BenchRecipesOptions {
  std::string backend = "cpu";  // cpu | cuda | auto
  // A model preset (model.preset's names) or hidden,ffn,heads,kv_heads,seq,micro_batch.
  std::string model = "256,1024,4,4,128,4";
  // gelu | relu | swiglu (fc1 or fc1_gate + fc1_up); "" for the preset's, gelu for the explicit
  // form. With a preset, a different activation is an input error.
  std::string activation;
  std::string shapes;   // extra MxNxK GEMMs ("custom"), "" for none
  std::string m_sweep;  // tokens of the forward M sweep, "" for none
  std::string recipes;  // comma-separated recipe names, "" for all
  int iters = 20;
  int warmup = 3;
  int64_t steps = 0;  // convergence: training steps per recipe, 0 for none
  std::string out_dir = "bench-recipes";
  std::string results;  // path prefix P: also write P.json and P.md ("" for none)
};

// The run record of a finished measurement: scenario "recipes.ceilings" (copy bandwidth, bf16
// GEMMs) and "recipes.<recipe>" per recipe, each with one check "measured" that fails when a
// figure is not a positive finite number. `gpu_name` selects the peak table row ("" on the CPU:
// no MFU, every figure labelled "CPU emulation").
reports::RunRecord bench_recipes_record(const engine::RecipeBenchReport& rep,
                                        const engine::RecipeBenchOptions& options,
                                        const std::string& backend, const std::string& gpu_name);

// The block `--model` names: a model preset is the scenario key table's defaults under
// model.preset = NAME (the same sizes and architecture a scenario gets), measured at the bench's
// default seq and micro-batch (BenchModel{}); else the explicit form. Input error for an unknown
// name, a bad explicit form, or an --activation that contradicts the preset.
engine::BenchModel resolve_bench_model(const std::string& model, const std::string& activation);

// Parses the options, measures, writes the reports into out_dir and prints the table. Returns 0
// when every figure was measured (run verdict pass), 1 otherwise.
int bench_recipes(const BenchRecipesOptions& options, std::ostream& out);

// Registers `bench recipes` (creating the `bench` verb if no other bench registered it first).
void add_bench_recipes_command(CLI::App& app, std::ostream& out, int& exit_code);

}  // namespace meshproof::harness
