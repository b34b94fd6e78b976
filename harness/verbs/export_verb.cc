#include "harness/verbs/export_verb.h"

#include <H5Cpp.h>
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <vector>

#include "engine/model/trainer.h"
#include "harness/run/runner.h"
#include "harness/run/train_run.h"
#include "harness/verbs/exit_codes.h"
#include "harness/verbs/output_guard.h"
#include "kernels/core/hdf5_check.h"
#include "reports/record/report_error.h"
#include "reports/writers/atomic_file.h"

namespace meshproof::harness {
namespace {

using engine::TensorMap;

void write_string_attr(H5::Group& g, const std::string& key, const std::string& value) {
  H5::StrType type(H5::PredType::C_S1, value.empty() ? 1 : value.size());
  H5::Attribute a = g.createAttribute(key, type, H5::DataSpace(H5S_SCALAR));
  a.write(type, value);
}

void write_double_attr(H5::Group& g, const std::string& key, double value) {
  H5::Attribute a = g.createAttribute(key, H5::PredType::NATIVE_DOUBLE, H5::DataSpace(H5S_SCALAR));
  a.write(H5::PredType::NATIVE_DOUBLE, &value);
}

template <typename T>
void write_dataset(H5::Group& g, const std::string& name, const std::vector<hsize_t>& dims,
                   const T* data, const H5::PredType& mem, const H5::PredType& file) {
  H5::DataSpace space(static_cast<int>(dims.size()), dims.data());
  H5::DataSet ds = g.createDataSet(name, file, space);
  ds.write(data, mem);
}

void write_tensors(H5::H5File& f, const std::string& group, const TensorMap& tensors) {
  H5::Group g = f.createGroup(group);
  for (const std::string& n : tensors.names()) {
    const kernels::Tensor& t = tensors.at(n);
    std::vector<hsize_t> dims(t.shape().dims().begin(), t.shape().dims().end());
    const std::vector<float> v = t.to_vector<float>();
    write_dataset(g, n, dims, v.data(), H5::PredType::NATIVE_FLOAT, H5::PredType::IEEE_F32LE);
  }
}

TensorMap copy_of(const TensorMap& m) {
  TensorMap out;
  for (const std::string& n : m.names()) out.insert(n, m.at(n).clone());
  return out;
}

}  // namespace

void export_trace(const engine::Config& config, const std::string& out_path, std::ostream& log,
                  std::span<const NamedPath> inputs) {
  engine::validate(config);
  // Issue #46, before any training: --out is a writable file path and not the scenario file.
  const NamedPath out_named{"--out", out_path, OutputKind::kFile};
  check_output_file("export", out_named);
  check_outputs_apart("export", inputs, std::span(&out_named, 1));
  const engine::TrainingConfig& t = config.training;

  engine::Trainer trainer(config);
  const TensorMap init = copy_of(trainer.params());
  std::vector<int32_t> tokens;
  std::vector<double> loss, grad_norm, lr;
  std::unique_ptr<TensorMap> grads0;
  for (int64_t s = 0; s < t.steps; ++s) {
    const std::vector<int32_t> batch = trainer.data().batch(s).to_vector<int32_t>();
    tokens.insert(tokens.end(), batch.begin(), batch.end());
    const engine::StepMetrics m = trainer.step([&](int64_t step, const TensorMap& g) {
      if (step == 0) grads0 = std::make_unique<TensorMap>(copy_of(g));
    });
    loss.push_back(m.loss);
    grad_norm.push_back(m.grad_norm);
    lr.push_back(m.lr);
    fmt::print(log, "step {:4d}  loss {:.6f}  grad_norm {:.6f}  lr {:.3e}\n", s, m.loss,
               m.grad_norm, m.lr);
  }
  fmt::print(log, "entropy floor {:.6f} nats/token\n", trainer.data().entropy_rate());

  // A fresh temporary beside --out, renamed over it when complete (reports/writers/atomic_file.h).
  auto write_trace = [&](const std::filesystem::path& tmp) {
    const std::string partial = tmp.string();
    MP_HDF5(
        kRuntime,
        [&] {
          H5::H5File f(partial, H5F_ACC_TRUNC);
          H5::Group cfg = f.createGroup("/config");
          for (const auto& [k, v] : engine::config_items(config)) write_string_attr(cfg, k, v);
          write_double_attr(cfg, "entropy_rate", trainer.data().entropy_rate());
          write_tensors(f, "/init", init);
          H5::Group data = f.createGroup("/data");
          write_dataset(data, "tokens",
                        {static_cast<hsize_t>(t.steps), static_cast<hsize_t>(t.batch),
                         static_cast<hsize_t>(t.seq_len + 1)},
                        tokens.data(), H5::PredType::NATIVE_INT32, H5::PredType::STD_I32LE);
          H5::Group metrics = f.createGroup("/metrics");
          const std::vector<hsize_t> n{static_cast<hsize_t>(t.steps)};
          write_dataset(metrics, "loss", n, loss.data(), H5::PredType::NATIVE_DOUBLE,
                        H5::PredType::IEEE_F64LE);
          write_dataset(metrics, "grad_norm", n, grad_norm.data(), H5::PredType::NATIVE_DOUBLE,
                        H5::PredType::IEEE_F64LE);
          write_dataset(metrics, "lr", n, lr.data(), H5::PredType::NATIVE_DOUBLE,
                        H5::PredType::IEEE_F64LE);
          write_tensors(f, "/grads0", *grads0);
          write_tensors(f, "/final", trainer.params());
          f.flush(H5F_SCOPE_GLOBAL);
          return 0;
        }(),
        "writing trace {}", partial);
  };
  try {
    reports::write_path_atomically(out_path, write_trace);
  } catch (const reports::ReportError& e) {
    MP_FAIL("export: writing --out {}: {}", out_path, e.what());
  }
  fmt::print(log, "wrote {}\n", out_path);
}

engine::Config scenario_export_config(const std::string& path, const std::string& filter,
                                      const std::vector<std::string>& sets) {
  const std::vector<Scenario> scenarios = load_scenarios({path}, sets, filter);
  if (scenarios.size() != 1) {
    std::string names;
    for (const Scenario& s : scenarios) names += (names.empty() ? "" : ", ") + s.name;
    MP_FAIL_INPUT(
        "export {}: a trace holds one run, the file expands to {} scenarios ({}); pick "
        "one with --filter NAME",
        path, scenarios.size(), names);
  }
  const Scenario& s = scenarios.front();
  MP_CHECK_INPUT(s.mesh.world_size() == 1,
                 "export {}: {} has mesh dp_replicate {} x dp_shard {} x tp {}; a trace is the "
                 "1-rank run of its model, so export needs a 1-rank mesh (e.g. --set "
                 "'mesh={{dp_replicate: 1, dp_shard: 1, tp: 1}}')",
                 path, s.name, s.mesh.dp_replicate, s.mesh.dp_shard, s.mesh.tp);
  MP_CHECK_INPUT(s.faults.empty(), "export {}: {} injects faults; a trace is a clean run", path,
                 s.name);
  MP_CHECK_INPUT(!s.fsdp.fp8_params,
                 "export {}: {} sets fsdp.fp8_params, a sharded-engine "
                 "option the 1-rank trace does not have",
                 path, s.name);
  return to_engine_config(s);
}

void add_export_command(CLI::App& app, std::ostream& out, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "export",
      "Train a model on one rank and write an HDF5 trace (init, data, metrics, step-0 "
      "gradients, final parameters) for reference checks");
  struct Options {
    engine::Config config;
    std::string out_path, norm = "layernorm", activation = "gelu", recipe = "fp32",
                          schedule = "constant", position = "learned";
    int64_t kv_heads = 0;  // 0: --heads
    bool no_bias = false;
    int64_t max_positions = 0;  // 0: equal to --seq-len
    std::string scenario, filter;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Options>();
  engine::Config& c = o->config;
  cmd->add_option("scenario", o->scenario,
                  "Scenario file (one 1-rank scenario after --filter/--set) instead of the model "
                  "and training flags");
  cmd->add_option("--filter", o->filter, "With a scenario: the matrix entry to export");
  cmd->add_option("--set", o->sets, "With a scenario: key.path=value override (repeatable)");
  cmd->add_option("--out", o->out_path, "Trace file to write (HDF5)")->required();
  cmd->add_option("--vocab", c.model.vocab, "Vocabulary size V")->capture_default_str();
  cmd->add_option("--hidden", c.model.hidden, "Hidden size H")->capture_default_str();
  cmd->add_option("--heads", c.model.heads, "Attention heads A")->capture_default_str();
  cmd->add_option("--layers", c.model.layers, "Transformer layers L")->capture_default_str();
  cmd->add_option("--ffn", c.model.ffn, "MLP hidden size F")->capture_default_str();
  cmd->add_option("--max-positions", o->max_positions, "Rows of embed.pos (default: --seq-len)");
  cmd->add_option("--norm", o->norm, "layernorm or rmsnorm")->capture_default_str();
  cmd->add_option("--activation", o->activation, "gelu, relu or swiglu")->capture_default_str();
  cmd->add_flag("--tied", c.model.tied_embeddings, "Tie lm_head to embed.tok");
  cmd->add_option("--kv-heads", o->kv_heads, "Key/value heads KV (grouped-query; default --heads)");
  cmd->add_option("--position", o->position, "learned or rope")->capture_default_str();
  cmd->add_option("--rope-theta", c.model.rope_theta, "RoPE base theta")->capture_default_str();
  cmd->add_flag("--no-bias", o->no_bias, "No biases on the linear layers");
  cmd->add_flag("--vocab-parallel", c.model.vocab_parallel,
                "Vocabulary-parallel embedding and LM head (recorded; one rank computes whole)");
  cmd->add_option("--dropout", c.model.dropout, "Hidden dropout probability")
      ->capture_default_str();
  cmd->add_option("--recipe", o->recipe, "Precision recipe")->capture_default_str();
  cmd->add_option("--seq-len", c.training.seq_len, "Sequence length S")->capture_default_str();
  cmd->add_option("--batch", c.training.batch, "Global batch B")->capture_default_str();
  cmd->add_option("--micro-batches", c.training.micro_batches, "Gradient accumulation steps")
      ->capture_default_str();
  cmd->add_option("--steps", c.training.steps, "Optimizer steps")->capture_default_str();
  cmd->add_option("--lr", c.training.lr, "Peak learning rate")->capture_default_str();
  cmd->add_option("--min-lr", c.training.min_lr, "Cosine floor")->capture_default_str();
  cmd->add_option("--warmup", c.training.warmup_steps, "Warmup steps")->capture_default_str();
  cmd->add_option("--schedule", o->schedule, "constant or warmup_cosine")->capture_default_str();
  cmd->add_option("--beta1", c.training.beta1, "AdamW beta1")->capture_default_str();
  cmd->add_option("--beta2", c.training.beta2, "AdamW beta2")->capture_default_str();
  cmd->add_option("--adam-eps", c.training.adam_eps, "AdamW eps")->capture_default_str();
  cmd->add_option("--weight-decay", c.training.weight_decay, "AdamW decoupled weight decay")
      ->capture_default_str();
  cmd->add_option("--clip", c.training.max_grad_norm, "Global-norm clip (<= 0: off)")
      ->capture_default_str();
  cmd->add_flag("--recompute", c.training.recompute, "Recompute activations per layer");
  cmd->add_option("--markov-order", c.data.markov_order, "Order k of the data Markov chain")
      ->capture_default_str();
  cmd->add_option("--data-decay", c.data.decay, "Next-token probability decay by rank")
      ->capture_default_str();
  cmd->add_option("--seed", c.seed, "Seed of init and dropout")->capture_default_str();
  cmd->add_option("--data-seed", c.data.seed, "Seed of the data stream")->capture_default_str();
  cmd->callback([&out, &exit_code, o, cmd] {
    if (!o->scenario.empty()) {
      // Only --out, --filter and --set go with a scenario file: it holds every other setting.
      for (const CLI::Option* opt : cmd->get_options()) {
        const std::string name = opt->get_name();
        if (opt->count() > 0 && name != "scenario" && name != "--out" && name != "--filter" &&
            name != "--set" && name != "--help") {
          MP_FAIL_INPUT(
              "export {}: {} cannot be combined with a scenario file (set it in the "
              "file or with --set)",
              o->scenario, name);
        }
      }
      const NamedPath scenario[] = {{"scenario", o->scenario}};
      export_trace(scenario_export_config(o->scenario, o->filter, o->sets), o->out_path, out,
                   scenario);
      exit_code = kExitOk;
      return;
    }
    if (!o->filter.empty() || !o->sets.empty()) {
      MP_FAIL_INPUT("export: --filter and --set need a scenario file");
    }
    engine::Config cfg = o->config;
    cfg.model.norm = engine::parse_norm(o->norm, "--norm");
    cfg.model.activation = engine::parse_activation(o->activation, "--activation");
    cfg.model.position = engine::parse_position(o->position, "--position");
    cfg.model.kv_heads = o->kv_heads > 0 ? o->kv_heads : cfg.model.heads;
    MP_CHECK_INPUT(o->kv_heads >= 0, "--kv-heads {} must be >= 1", o->kv_heads);
    cfg.model.bias = !o->no_bias;
    cfg.recipe.kind = engine::parse_recipe(o->recipe, "--recipe");
    cfg.training.schedule = engine::parse_schedule(o->schedule, "--schedule");
    cfg.model.max_positions = o->max_positions > 0 ? o->max_positions : cfg.training.seq_len;
    export_trace(cfg, o->out_path, out);
    exit_code = kExitOk;
  });
}

}  // namespace meshproof::harness
