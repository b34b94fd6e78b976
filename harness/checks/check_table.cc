#include "harness/checks/check_table.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "engine/parallel/collective_budget.h"
#include "harness/checks/checks.h"
#include "harness/checks/golden.h"
#include "harness/run/runner.h"
#include "kernels/core/error.h"
#include "mesh/core/library_info.h"

namespace meshproof::harness {
namespace fs = std::filesystem;
namespace {

// ---- golden: the main run's per-step metrics against the committed golden

reports::CheckResult run_golden(CheckContext& c) {
  const std::string platform = golden_platform(c.backend, c.env);
  const fs::path path = golden_path(c.opts.golden_dir, c.scenario.name, platform);
  reports::GoldenRecord g;
  // A run that starts from a checkpoint at step k compares the steps it ran, k+1..steps, with the
  // golden's (a golden shorter than k is left as is: the step count check fails).
  std::optional<GoldenData> golden = read_golden(path);
  // An imported golden names its steps: it is compared by step number, with nothing to shift.
  const bool dense = golden && golden->steps.empty();
  if (dense && c.start > 0) {
    for (auto& [name, values] : golden->metrics) {
      if (static_cast<int64_t>(values.size()) >= c.start)
        values.erase(values.begin(), values.begin() + c.start);
    }
  }
  auto r =
      check_golden(c.main.steps, golden, c.scenario.checks.golden, path.string(),
                   golden_update_command(c.scenario, c.opts, platform), &g, c.opts.trace, c.hash);
  if (dense) {
    for (reports::GoldenStep& gs : g.steps) gs.step += c.start;
  }
  if (!g.steps.empty()) c.record.golden = g;
  return r;
}

// ---- resume: save mid-run, load into a fresh engine (on the override mesh), train to the end

std::optional<std::string> resume_skip_reason(const Scenario& s, int64_t start) {
  // The check saves at_step steps after the run's start (step 0, or the checkpoint's); when that
  // is not before the last step there is nothing to resume.
  const ResumeCheck& r = s.checks.resume;
  if (start + r.at_step < s.train.steps) return std::nullopt;
  return fmt::format("the run starts from step {}: saving {} steps later leaves no step to resume",
                     start, r.at_step);
}

std::optional<std::string> skip_resume(const CheckContext& c) {
  return resume_skip_reason(c.scenario, c.start);
}

// The first half of the resume check is the main run's first at_step steps: the main run saves
// there, and the check trains only the second half (issue 26: checks share what they can).
void prepare_resume(const Scenario& s, const MainRunPlan& plan, TrainRequest& main) {
  if (resume_skip_reason(s, plan.start)) return;
  main.resume_save_at = plan.start + s.checks.resume.at_step;
  main.resume_root = plan.checkpoint_root;
}

reports::CheckResult run_resume(CheckContext& c) {
  const Scenario& s = c.scenario;
  ResumeRequest req;
  req.at_step = c.start + s.checks.resume.at_step;
  req.mesh = s.checks.resume.mesh;
  req.faults = c.faults;
  req.trace = c.opts.trace;
  req.scenario_hash = c.hash;
  req.from_checkpoint = c.opts.from_checkpoint;
  // The check saves into a folder it creates under the checkpoint root (resume_check_stepN, or
  // .2, .3, ... when a previous run left one): nothing of another run is deleted or overwritten.
  // Its own folder is removed when the check passes and kept when it fails, for `ckpt diff`/`ckpt
  // inspect`, so reruns into one --out do not pile up folders.
  req.checkpoint_root = checkpoint_root(s, c.opts.out_dir);
  req.on_step = c.phase("resume");
  req.first_half = &c.main;
  TrainOutcome resumed = resume_scenario(c.run, req);
  c.done();
  c.record.notes.insert(c.record.notes.end(), resumed.notes.begin(), resumed.notes.end());
  const RunView view{&resumed.steps, &resumed.final_params, &resumed.trace};
  const RunView straight{&c.main.steps, &c.main.final_params, &c.main.trace};
  reports::CheckResult result;
  if (!s.checks.resume.mesh || *s.checks.resume.mesh == s.mesh) {
    result = compare_bitwise("resume", "resume", view, straight,
                             fmt::format("resumed run (saved after step {})", req.at_step),
                             c.opts.trace);
  } else {
    // Another mesh reorders reductions: loss and grad_norm within the scenario's rtol.
    const std::map<Metric, double> rtol = {{Metric::kLoss, s.checks.resume.rtol},
                                           {Metric::kGradNorm, s.checks.resume.rtol}};
    // --trace on a fault scenario: the fault-free control of the same comparison (a clean
    // straight run and a clean cross-mesh resume) gives every tensor its noise floor.
    std::optional<NoiseFloors> floors;
    if (c.opts.trace && c.faults.any()) {
      const TrainOutcome& clean_straight = c.fault_free_control();
      Scenario clean = c.run;
      clean.faults.clear();
      ResumeRequest creq = req;
      creq.faults = {};
      creq.first_half = nullptr;  // the main run carries the faults: the control trains its own
      creq.on_step = c.phase("resume control");
      TrainOutcome clean_resumed = resume_scenario(clean, creq);
      c.done();
      floors = noise_floors(clean_resumed.trace, clean_straight.trace);
      // The control's folder is scratch of this run's own: removed whatever the verdict.
      if (mesh::launched_rank() == 0) {
        for (const fs::path& dir : clean_resumed.checkpoints) {
          std::error_code ec;
          fs::remove_all(dir, ec);
        }
      }
    }
    result = compare_tolerance("resume", "resume", view, straight, rtol,
                               fmt::format("run resumed on {} (saved after step {})",
                                           describe_mesh(*s.checks.resume.mesh), req.at_step),
                               c.opts.trace, floors ? &*floors : nullptr);
  }
  // Every process of an mpi launch reaches the same verdict; rank 0 alone touches the folder.
  if (mesh::launched_rank() == 0) {
    for (const fs::path& dir : resumed.checkpoints) {
      if (result.verdict != reports::Verdict::kPass) {
        c.record.notes.push_back(fmt::format("resume: kept {} for inspection", dir.string()));
        continue;
      }
      std::error_code ec;
      fs::remove_all(dir, ec);
      if (ec) {
        c.record.notes.push_back(
            fmt::format("resume: could not remove {}: {}", dir.string(), ec.message()));
      }
    }
  }
  return result;
}

// ---- reference: a fault-free run on another mesh and/or recipe, within rtol

std::optional<std::string> skip_reference(const CheckContext& c) {
  // A reference with another recipe has other FP8 state than the checkpoint holds: it cannot
  // start from it, and a reference from scratch compares other steps.
  const Scenario& s = c.scenario;
  // Likewise another fsdp.fp8_params: the FP8 primary weights are checkpoint keys of their own.
  const std::optional<engine::FsdpOptions>& fsdp = s.checks.reference.fsdp;
  if (c.start > 0 && fsdp && fsdp->fp8_params != s.fsdp.fp8_params) {
    return fmt::format(
        "a reference with fsdp.fp8_params {} cannot start from the checkpoint {} "
        "(saved with fp8_params {})",
        fsdp->fp8_params, c.opts.from_checkpoint.string(), s.fsdp.fp8_params);
  }
  if (c.start == 0 || !s.checks.reference.recipe ||
      s.checks.reference.recipe->kind == s.recipe.kind) {
    return std::nullopt;
  }
  return fmt::format("a reference with recipe {} cannot start from the {} checkpoint {}",
                     to_string(s.checks.reference.recipe->kind), to_string(s.recipe.kind),
                     c.opts.from_checkpoint.string());
}

reports::CheckResult run_reference(CheckContext& c) {
  const ReferenceCheck& cfg = c.scenario.checks.reference;
  Scenario ref = cfg.mesh ? on_mesh(c.run, *cfg.mesh) : c.run;
  ref.faults.clear();  // the reference is the clean run the faulty one must agree with
  if (cfg.recipe) ref.recipe = *cfg.recipe;
  if (cfg.fsdp) ref.fsdp = *cfg.fsdp;
  if (cfg.micro_batches) ref.train.micro_batches = *cfg.micro_batches;
  std::string what = fmt::format("run vs reference ({}, recipe {}", describe_mesh(ref.mesh),
                                 to_string(ref.recipe.kind));
  if (cfg.fsdp) {
    what += fmt::format(
        ", fsdp reshard_after_forward={} fp8_all_gather={} fp8_params={} "
        "sync_each_micro_batch={}",
        ref.fsdp.reshard_after_forward, ref.fsdp.fp8_all_gather, ref.fsdp.fp8_params,
        ref.fsdp.sync_each_micro_batch);
  }
  if (cfg.micro_batches) what += fmt::format(", micro_batches {}", ref.train.micro_batches);
  TrainRequest req;
  if (cfg.checkpoint) {
    ref.checkpoint.every = cfg.checkpoint->every;
    ref.checkpoint.keep_last = cfg.checkpoint->keep_last;
    what += ref.checkpoint.every > 0 ? fmt::format(", checkpoint every {} keeping {}",
                                                   ref.checkpoint.every, ref.checkpoint.keep_last)
                                     : ", no periodic checkpoints";
    if (ref.checkpoint.every > 0) {
      // A folder of its own next to the scenario's checkpoints, never one an earlier run wrote:
      // reference_checkpoints, else reference_checkpoints.<k> with the smallest free k >= 2.
      const std::filesystem::path root = checkpoint_root(c.scenario, c.opts.out_dir);
      std::filesystem::path dir = root / "reference_checkpoints";
      for (int k = 2; std::filesystem::exists(dir); ++k)
        dir = root / fmt::format("reference_checkpoints.{}", k);
      req.checkpoints = CheckpointPlan{dir, ref.checkpoint.every, ref.checkpoint.keep_last};
      req.scenario_hash = c.hash;
    }
  }
  what += ")";
  req.trace = c.opts.trace;
  req.from_checkpoint = c.opts.from_checkpoint;  // the same start (resharded onto its mesh)
  req.on_step = c.phase("reference");
  TrainOutcome r = train_scenario(ref, req);
  c.done();
  // --trace on a fault scenario: the fault-free main run against the same reference is the
  // control that gives every tensor its noise floor.
  std::optional<NoiseFloors> floors;
  if (c.opts.trace && c.faults.any()) floors = noise_floors(c.fault_free_control().trace, r.trace);
  return compare_tolerance("reference", "reference",
                           RunView{&c.main.steps, &c.main.final_params, &c.main.trace},
                           RunView{&r.steps, &r.final_params, &r.trace}, cfg.rtol, what,
                           c.opts.trace, floors ? &*floors : nullptr);
}

// ---- determinism: the same run again, bitwise

reports::CheckResult run_determinism(CheckContext& c) {
  TrainRequest req;
  req.faults = c.faults;
  req.trace = c.opts.trace;
  req.from_checkpoint = c.opts.from_checkpoint;
  req.on_step = c.phase("determinism");
  TrainOutcome again = train_scenario(c.run, req);
  c.done();
  return compare_bitwise(
      "determinism", "determinism", RunView{&again.steps, &again.final_params, &again.trace},
      RunView{&c.main.steps, &c.main.final_params, &c.main.trace}, "rerun", c.opts.trace);
}

// ---- state: save, load into a fresh engine (on the state mesh), save again; bitwise by key

std::optional<std::string> skip_state(const CheckContext& c) {
  const StateCheck& st = c.scenario.checks.state;
  if (c.start + st.at_step <= c.scenario.train.steps) return std::nullopt;
  return fmt::format("the run starts from step {}: saving {} steps later is past the last step",
                     c.start, st.at_step);
}

// The main run's recorded parameter collectives of every rank against the sharding plan's, for
// the steps it ran (from the start checkpoint on).
reports::CheckResult run_collectives(CheckContext& c) {
  const engine::RunOptions plan = engine_run_options(c.run);
  const auto steps = static_cast<int64_t>(c.main.steps.size());
  std::vector<RankCollectives> ranks;
  for (const auto& [rank, calls] : c.main.calls) {
    RankCollectives rc{.rank = rank, .expected = {}, .ran = calls};
    for (int64_t k = c.start; k < c.start + steps; ++k)
      for (mesh::CollectiveCall& e : engine::expected_collectives(plan, rank, k))
        rc.expected.push_back(std::move(e));
    ranks.push_back(std::move(rc));
  }
  return check_collectives(ranks);
}

reports::CheckResult run_state(CheckContext& c) {
  const Scenario& s = c.scenario;
  StateRequest req;
  req.at_step = c.start + s.checks.state.at_step;
  req.mesh = s.checks.state.mesh;
  req.faults = c.faults;
  req.scenario_hash = c.hash;
  req.from_checkpoint = c.opts.from_checkpoint;
  req.checkpoint_root = checkpoint_root(s, c.opts.out_dir);
  req.on_step = c.phase("state");
  StateOutcome o = state_roundtrip(c.run, req);
  c.done();
  c.record.notes.insert(c.record.notes.end(), o.notes.begin(), o.notes.end());
  const engine::MeshSpec& other = s.checks.state.mesh.value_or(s.mesh);
  const std::string what =
      fmt::format("state after step {} saved on {}, loaded and saved again on {}", req.at_step,
                  describe_mesh(s.mesh), describe_mesh(other));
  reports::CheckResult result =
      compare_checkpoint_state(o.after, o.saved, o.before, o.params, what);
  // Its folder is removed on a pass and kept for `ckpt diff` on a failure (rank 0 alone), once
  // every process of an mpi launch has compared the two checkpoints (each reads their files:
  // removed under a slower process, its rank files went missing and its check errored).
  wait_for_every_process(c.run);
  if (mesh::launched_rank() == 0) {
    if (result.verdict != reports::Verdict::kPass) {
      c.record.notes.push_back(fmt::format("state: kept {} for inspection (ckpt diff {} {})",
                                           o.folder.string(), o.before.string(), o.after.string()));
    } else {
      std::error_code ec;
      fs::remove_all(o.folder, ec);
      if (ec) {
        c.record.notes.push_back(
            fmt::format("state: could not remove {}: {}", o.folder.string(), ec.message()));
      }
    }
  }
  return result;
}

const std::vector<CheckDescriptor>& rows() {
  static const std::vector<CheckDescriptor> table = {
      {
          .id = CheckId::kGolden,
          .name = "golden",
          .doc = "the main run's per-step loss and grad_norm against the committed golden "
                 "(exact or a tolerance band)",
          .enabled = [](const Scenario& s) { return s.checks.golden.enabled; },
          .claim = [](const Scenario&) -> std::string_view { return "golden"; },
          .prepare_main = nullptr,
          .skip = nullptr,
          .run = run_golden,
          .judges_main_run = true,
      },
      {
          .id = CheckId::kResume,
          .name = "resume",
          .doc = "save after checks.resume.at_step, load into a fresh engine (on checks.resume."
                 "mesh), train to the end: bitwise on the same mesh, within rtol on another",
          .enabled = [](const Scenario& s) { return s.checks.resume.enabled; },
          .claim = [](const Scenario& s) -> std::string_view {
            return s.checks.resume.mesh ? "resume_cross_mesh" : "resume";
          },
          .prepare_main = prepare_resume,
          .skip = skip_resume,
          .run = run_resume,
          .judges_main_run = false,
      },
      {
          .id = CheckId::kReference,
          .name = "reference",
          .doc = "a fault-free run on the reference mesh and/or recipe, loss (and grad_norm) "
                 "within rtol",
          .enabled = [](const Scenario& s) { return s.checks.reference.enabled; },
          .claim = [](const Scenario&) -> std::string_view { return "reference"; },
          .prepare_main = nullptr,
          .skip = skip_reference,
          .run = run_reference,
          .judges_main_run = false,
      },
      {
          .id = CheckId::kAllgatherParity,
          .name = "allgather_parity",
          .doc = "every FP8 all-gathered weight of the main run bitwise equal to quantizing the "
                 "gathered weight",
          .enabled = [](const Scenario& s) { return s.checks.allgather_parity; },
          .claim = [](const Scenario&) -> std::string_view { return "allgather_parity"; },
          // The main run compares every FP8 all-gathered weight as it gathers it.
          .prepare_main = [](const Scenario&, const MainRunPlan&,
                             TrainRequest& main) { main.allgather_parity = true; },
          .skip = nullptr,
          .run = [](CheckContext& c) { return check_allgather_parity(c.main.parity); },
          .judges_main_run = true,
      },
      {
          .id = CheckId::kDeterminism,
          .name = "determinism",
          .doc = "the same run again, loss, grad_norm and final parameters bitwise equal",
          .enabled = [](const Scenario& s) { return s.checks.determinism; },
          .claim = [](const Scenario&) -> std::string_view { return "determinism"; },
          .prepare_main = nullptr,
          .skip = nullptr,
          .run = run_determinism,
          .judges_main_run = false,
      },
      {
          .id = CheckId::kState,
          .name = "state",
          .doc =
              "save after checks.state.at_step, load into a fresh engine (on checks.state.mesh), "
              "save again at once: every checkpoint key and scalar bitwise equal",
          .enabled = [](const Scenario& s) { return s.checks.state.enabled; },
          .claim = [](const Scenario&) -> std::string_view { return "state"; },
          .prepare_main = nullptr,
          .skip = skip_state,
          .run = run_state,
          .judges_main_run = false,
      },
      {
          .id = CheckId::kCollectives,
          .name = "collectives",
          .doc = "every step's parameter collectives (kind, group, tensor, dtype, bytes) of the "
                 "main run equal to the sharding plan's",
          .enabled = [](const Scenario& s) { return s.checks.collectives; },
          .claim = [](const Scenario&) -> std::string_view { return "collectives"; },
          // The main run records its collectives as it issues them.
          .prepare_main = [](const Scenario&, const MainRunPlan&,
                             TrainRequest& main) { main.record_collectives = true; },
          .skip = nullptr,
          .run = run_collectives,
          .judges_main_run = true,
      },
  };
  return table;
}

}  // namespace

std::span<const CheckDescriptor> check_table() { return rows(); }

const CheckDescriptor* find_check(std::string_view name) {
  for (const CheckDescriptor& c : check_table()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

const CheckDescriptor& check(CheckId id) {
  const CheckDescriptor& row = check_table()[static_cast<size_t>(id)];
  MP_CHECK(row.id == id, "check table row {} is {}: rows out of CheckId order",
           static_cast<int>(id), row.name);
  return row;
}

std::vector<std::string> enabled_checks(const Scenario& s) {
  std::vector<std::string> out;
  for (const CheckDescriptor& c : check_table()) {
    if (c.enabled(s)) out.emplace_back(c.name);
  }
  return out;
}

std::vector<std::string> enabled_claims(const Scenario& s) {
  std::vector<std::string> out;
  for (const CheckDescriptor& c : check_table()) {
    if (c.enabled(s)) out.emplace_back(c.claim(s));
  }
  return out;
}

std::string describe_claim(std::string_view claim) {
  // By the scenario key that enables it: what a user writes to turn it on.
  if (claim == "resume_cross_mesh") return "checks.resume.mesh";
  return fmt::format("checks.{}", claim);
}

const CheckDescriptor* check_of_claim(std::string_view claim) {
  if (claim == "resume_cross_mesh") return &check(CheckId::kResume);
  return find_check(claim);
}

}  // namespace meshproof::harness
