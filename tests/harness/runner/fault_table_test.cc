// The fault table (harness/faults/scenario_faults.h): every row injects its fault into
// engine::FaultInjection from its first step, claims only checks of the check table, is listed by
// `meshproof faults` with its requirements and parameters, and has a library scenario that meets
// its requirements and enables a check that catches it. Parameterised over the rows, so a failure
// names the fault.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "engine/faults/fault_hooks.h"
#include "engine/session/session.h"
#include "harness/checks/check_table.h"
#include "harness/faults/scenario_faults.h"
#include "harness/scenario/scenario_loader.h"
#include "harness/verbs/run_verb.h"
#include "kernels/core/error.h"
#include "tests/source_dir.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> fault_names() {
  std::vector<std::string> out;
  for (const FaultDescriptor& f : fault_table()) out.emplace_back(f.name);
  return out;
}

class FaultTableRow : public ::testing::TestWithParam<std::string> {
 protected:
  const FaultDescriptor& row() const {
    const FaultDescriptor* f = find_fault(GetParam());
    EXPECT_NE(f, nullptr);
    return *f;
  }
  // The fault as its library scenario writes it (a generic fault needs its glob parameters;
  // a built-in one has every parameter at its default there or a valid value).
  FaultSpec library_spec() const {
    const fs::path path =
        test_support::source_dir() / "scenarios" / "faults" / (GetParam() + ".yaml");
    const std::vector<Scenario> v = load_scenario_file(path.string());
    EXPECT_EQ(v.size(), 1u);
    EXPECT_EQ(v.at(0).faults.size(), 1u);
    return v.at(0).faults.at(0);
  }
};

// The row's inject switches the fault on, and from_step (1-based in the scenario) reaches the
// engine 0-based; without faults nothing is injected.
TEST_P(FaultTableRow, InjectsItsFaultFromItsFirstStep) {
  EXPECT_FALSE(to_fault_injection({}).any());
  FaultSpec spec = library_spec();
  spec.int_params["from_step"] = 3;
  const engine::FaultInjection f = to_fault_injection({spec});
  EXPECT_TRUE(f.any());
  EXPECT_EQ(f.from_step, 2);
  EXPECT_FALSE(f.active(1));
  EXPECT_TRUE(f.active(2));
}

// The engine faults a FaultInjection switches on (engine/faults/faults.h), one flag each.
std::array<bool, 37> switched_on(const engine::FaultInjection& f) {
  return {f.amax_not_reduced, f.tp_fsdp_left_to_right, f.fp8_state_dropped_from_checkpoint,
          f.scale_inv_saved_bf16, f.stale_columnwise_copy, f.data_cursor_not_restored,
          f.optimizer_state_not_restored, f.hsdp_replicas_not_reduced, f.uneven_shard_padding_leak,
          // generic faults (a non-empty glob)
          !f.drop_checkpoint_key.empty(), !f.checkpoint_key_dtype.empty(), !f.freeze_state.empty(),
          !f.perturb_tensor.empty(), !f.amax_group_linear.empty(),
          // built-in faults added with issue #20
          f.stale_fp8_weight_after_update,
          // Llama faults (issue #21)
          f.rope_positions_local_under_sp, f.swiglu_gate_up_swizzled_in_checkpoint,
          // NVFP4 faults (issue #22)
          f.nvfp4_rht_on_one_operand, f.nvfp4_block_scale_pow2,
          // state/reference faults (issue #20)
          f.amax_history_restored_from_init, f.optimizer_step_advanced_before_load,
          f.grad_accum_last_micro_batch_only,
          // catalog entries (issue #20)
          f.scale_inv_gathered_bf16, f.vocab_uneven_resume_rows, f.block_scale_padding_reshard,
          // MoE faults (issue #23)
          f.router_not_fp32,
          // NVFP4 all-gather (issue #22)
          f.nvfp4_global_amax_not_reduced,
          // collective faults (issue #20, the collectives check)
          f.tp_weight_amax_all_reduced, f.fp8_all_gather_in_bf16, !f.skip_collective_tensor.empty(),
          !f.collective_dtype_tensor.empty(),
          // expert-parallel faults (issue #23)
          f.expert_grad_scaled_by_ep, f.moe_final_backward_skips_experts,
          // grouped expert quantization (issue #23)
          f.expert_split_padding_too_small,
          // pipeline-parallel faults (issue #24)
          f.pp_last_backward_sync_skipped, f.pp_microbatch_grads_overwritten,
          f.pp_tied_embedding_grad_not_synced};
}

// Each row switches on exactly one engine fault, and no other row switches on the same one.
TEST_P(FaultTableRow, SwitchesOnOneEngineFaultOfItsOwn) {
  engine::FaultInjection mine;
  row().inject(library_spec(), mine);
  const std::array<bool, 37> flags = switched_on(mine);
  EXPECT_EQ(std::count(flags.begin(), flags.end(), true), 1);
  for (const FaultDescriptor& other : fault_table()) {
    if (other.name == GetParam()) continue;
    engine::FaultInjection theirs;
    const fs::path path =
        test_support::source_dir() / "scenarios" / "faults" / (std::string(other.name) + ".yaml");
    other.inject(load_scenario_file(path.string()).at(0).faults.at(0), theirs);
    EXPECT_NE(switched_on(theirs), flags) << other.name;
  }
}

// caught_by names checks of the check table (resume_cross_mesh: the resume check), each once.
TEST_P(FaultTableRow, ClaimsOnlyChecksOfTheCheckTable) {
  ASSERT_FALSE(row().caught_by.empty());
  EXPECT_FALSE(row().bug_class.empty());
  std::set<std::string_view> seen;
  for (std::string_view claim : row().caught_by) {
    EXPECT_NE(check_of_claim(claim), nullptr) << claim;
    EXPECT_TRUE(seen.insert(claim).second) << claim << " claimed twice";
  }
}

// `meshproof faults` prints the row: bug class, catching checks, requirements, every parameter.
TEST_P(FaultTableRow, ListedByMeshproofFaults) {
  std::ostringstream out;
  print_fault_catalog(out);
  const std::string text = out.str();
  std::string claims;
  for (std::string_view c : row().caught_by) {
    if (!claims.empty()) claims += ", ";
    claims += c;
  }
  const std::string kind =
      row().generic ? "generic (user-defined: its parameters say what it corrupts)" : "built-in";
  const std::string head = GetParam() + "\n  kind:      " + kind +
                           "\n  bug class: " + std::string(row().bug_class) +
                           "\n  caught by: " + claims + "\n  needs:     ";
  const size_t at = text.find(head);
  ASSERT_NE(at, std::string::npos) << text;
  const size_t end = text.find("\n", at + head.size());
  const std::string needs = text.substr(at + head.size(), end - at - head.size());
  if (row().needs.empty()) {
    EXPECT_EQ(needs, "any scenario");
  }
  for (const FaultRequirement& r : row().needs) {
    EXPECT_NE(needs.find(r.what), std::string::npos) << r.what;
  }
  for (const FaultParam* p : all_params(row())) {
    EXPECT_NE(text.find("  param:     " + std::string(p->name) + " (" + p->describe() +
                            "): " + std::string(p->doc) + "\n",
                        at),
              std::string::npos)
        << p->name;
  }
}

// `meshproof faults --json` (what the fault CTests are listed from) gives the row at its index
// with the same fields as the text.
TEST_P(FaultTableRow, ListedByMeshproofFaultsJson) {
  std::ostringstream out;
  print_fault_catalog_json(out);
  const nlohmann::json rows = nlohmann::json::parse(out.str());
  ASSERT_TRUE(rows.is_array());
  ASSERT_EQ(rows.size(), fault_table().size());
  const auto at = std::find_if(rows.begin(), rows.end(),
                               [&](const nlohmann::json& r) { return r.at("name") == GetParam(); });
  ASSERT_NE(at, rows.end()) << out.str();
  EXPECT_EQ(&fault_table()[static_cast<size_t>(at - rows.begin())], &row())
      << "listed out of order";
  const nlohmann::json& r = *at;
  EXPECT_EQ(r.at("generic").get<bool>(), row().generic);
  EXPECT_EQ(r.at("bug_class").get<std::string>(), row().bug_class);
  std::vector<std::string> claims(row().caught_by.begin(), row().caught_by.end());
  EXPECT_EQ(r.at("caught_by").get<std::vector<std::string>>(), claims);
  ASSERT_EQ(r.at("needs").size(), row().needs.size());
  for (size_t i = 0; i < row().needs.size(); ++i) {
    EXPECT_EQ(r.at("needs")[i].get<std::string>(), row().needs[i].what);
  }
  const std::vector<const FaultParam*> params = all_params(row());
  ASSERT_EQ(r.at("params").size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const nlohmann::json& p = r.at("params")[i];
    EXPECT_EQ(p.at("name").get<std::string>(), params[i]->name);
    EXPECT_EQ(p.at("describe").get<std::string>(), params[i]->describe());
    EXPECT_EQ(p.at("doc").get<std::string>(), params[i]->doc);
  }
}

// The library's scenario of the fault (scenarios/faults/NAME.yaml) meets every requirement of the
// row and enables a check the row claims.
TEST_P(FaultTableRow, LibraryScenarioMeetsTheRow) {
  const fs::path path =
      test_support::source_dir() / "scenarios" / "faults" / (GetParam() + ".yaml");
  ASSERT_TRUE(fs::exists(path)) << path;
  for (const Scenario& s : load_scenario_file(path.string())) {
    for (const FaultRequirement& r : row().needs) EXPECT_TRUE(r.met(s)) << s.name << ": " << r.what;
    const std::vector<std::string> claims = enabled_claims(s);
    EXPECT_TRUE(std::any_of(row().caught_by.begin(), row().caught_by.end(), [&](auto c) {
      return std::find(claims.begin(), claims.end(), c) != claims.end();
    })) << s.name;
  }
}

INSTANTIATE_TEST_SUITE_P(FaultTable, FaultTableRow, ::testing::ValuesIn(fault_names()),
                         [](const auto& info) { return info.param; });

TEST(FaultTable, UnknownNameIsAnInputError) {
  EXPECT_EQ(find_fault("no_such_fault"), nullptr);
  try {
    (void)to_fault_injection({FaultSpec{"no_such_fault", {}, {}, {}}});
    FAIL() << "an unknown fault was injected";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(e.message().find("fault no_such_fault: not in the fault table"), std::string::npos)
        << e.message();
  }
}

// Parameters reach the engine; with several faults the earliest from_step applies to all.
TEST(FaultTable, ParametersAndTheEarliestFirstStep) {
  const engine::FaultInjection f = to_fault_injection(
      {FaultSpec{"stale_columnwise_copy", {{"from_step", 4}, {"layer", 1}}, {}, {}},
       FaultSpec{
           "optimizer_state_not_restored", {{"from_step", 2}}, {{"state", "exp_avg_sq"}}, {}}});
  EXPECT_TRUE(f.stale_columnwise_copy);
  EXPECT_EQ(f.stale_columnwise_layer, 1);
  EXPECT_TRUE(f.optimizer_state_not_restored);
  EXPECT_EQ(f.optimizer_state_part, "exp_avg_sq");
  EXPECT_EQ(f.from_step, 1);
  // Without the parameters the engine's defaults stay: every layer, all of the state.
  const engine::FaultInjection d =
      to_fault_injection({FaultSpec{"stale_columnwise_copy", {}, {}, {}},
                          FaultSpec{"optimizer_state_not_restored", {}, {}, {}}});
  EXPECT_EQ(d.stale_columnwise_layer, -1);
  EXPECT_EQ(d.optimizer_state_part, "all");
  EXPECT_EQ(d.from_step, 0);
}

// Parameter ranges as the loader applies them and `meshproof faults` describes them.
TEST(FaultTable, ParameterRangesFollowTheScenario) {
  Scenario s;
  s.model.layers = 3;
  s.train.steps = 7;
  EXPECT_EQ(from_step_param().max_for(s), 7);
  EXPECT_EQ(from_step_param().describe(), "int in [1, train.steps], default 1");
  const FaultDescriptor* stale = find_fault("stale_columnwise_copy");
  ASSERT_NE(stale, nullptr);
  ASSERT_EQ(stale->params.size(), 1u);
  EXPECT_EQ(stale->params[0].max_for(s), 2);
  EXPECT_EQ(stale->params[0].describe(), "int in [0, model.layers - 1], default 0");
  const FaultDescriptor* opt = find_fault("optimizer_state_not_restored");
  ASSERT_NE(opt, nullptr);
  ASSERT_EQ(opt->params.size(), 1u);
  EXPECT_EQ(opt->params[0].describe(), "one of all, exp_avg, exp_avg_sq, step; default all");
}

// The generic faults' globs (those of ckpt inspect --key): `*` spans '/' and '.', `?` one
// character, `[...]` a set, the rest literal.
TEST(FaultTable, GlobMatching) {
  EXPECT_TRUE(
      engine::match_glob("optim/*/exp_avg_sq", "optim/layers.0.attn.qkv.weight/exp_avg_sq"));
  EXPECT_FALSE(engine::match_glob("optim/*/exp_avg_sq", "optim/embed.tok/exp_avg"));
  EXPECT_TRUE(engine::match_glob("fp8/*", "fp8/params/x/scale_inv"));
  EXPECT_TRUE(engine::match_glob("layers.?.attn.qkv", "layers.1.attn.qkv"));
  EXPECT_FALSE(engine::match_glob("layers.?.attn.qkv", "layers.10.attn.qkv"));
  EXPECT_TRUE(engine::match_glob("*", ""));
  EXPECT_FALSE(engine::match_glob("model/embed.tok", "model/embed.tok2"));
  EXPECT_TRUE(engine::match_glob("*a*b*", "xxaxxbxx"));
  EXPECT_TRUE(engine::match_glob("layers.[01].mlp.fc1", "layers.1.mlp.fc1"));
  EXPECT_FALSE(engine::match_glob("layers.[01].mlp.fc1", "layers.2.mlp.fc1"));
}

// The keys the generic faults' globs are checked against up front are exactly the keys a run's
// state holds (the engine's sessions build them; here one rank of a delayed FP8-params run and
// of an mxfp8 one).
TEST(FaultTable, FaultKeyNamesAreTheStateKeys) {
  for (const char* recipe : {"delayed", "mxfp8"}) {
    Scenario s;
    s.model.vocab = 64;
    s.model.hidden = 32;
    s.model.heads = 2;
    s.model.kv_heads = 2;  // Scenario() set it from the default heads (4)
    s.model.layers = 1;
    s.model.ffn = 64;
    s.recipe = default_recipe(std::string(recipe) == "delayed" ? RecipeKind::kDelayed
                                                               : RecipeKind::kMxfp8);
    s.fsdp.fp8_params = true;
    engine::RunOptions o;
    o.config = s.config();
    o.fsdp.fp8_params = true;
    o.fsdp.fp8_all_gather = true;
    std::set<std::string> live;
    o.before_start = [&](engine::ShardedState& st, mesh::RankComms&) {
      for (const engine::StateEntry& e : st.entries) live.insert(e.key);
      for (const auto& [k, v] : st.scalars) live.insert(k);
    };
    o.config.training.steps = 1;
    (void)engine::run_training(o);
    std::set<std::string> listed;
    for (const engine::FaultKey& k : engine::fault_key_names(s.config(), true))
      listed.insert(k.key);
    EXPECT_EQ(listed, live) << recipe;
  }
}

}  // namespace
}  // namespace meshproof::harness
