// Internal to the fault table (harness/faults/scenario_faults.cc and the fault_*.cc files beside
// it): what the rows are made of. The requirements a row's `needs` lists
// (fault_requirements.cc), the parameter checks a row's `check` points at (fault_param_checks.cc),
// and the row lists, each a run of consecutive rows of the table (fault_rows_*.cc), that
// scenario_faults.cc concatenates, in the order declared here, into fault_table(). Only those
// files include it.
#pragma once

#include <string>
#include <vector>

#include "harness/faults/scenario_faults.h"
#include "harness/scenario/scenario.h"

namespace meshproof::harness::faults_internal {

// ---- what a fault can need of its scenario (fault_requirements.cc; the loader's message is
// "NAME needs WHAT")
extern const FaultRequirement kFp8Recipe;
extern const FaultRequirement kPerTensorRecipe;
extern const FaultRequirement kDelayedRecipe;
extern const FaultRequirement kFp8AllGather;
extern const FaultRequirement kFp8Params;
extern const FaultRequirement kTwoShards;
extern const FaultRequirement kTwoReplicas;
extern const FaultRequirement kTwoTpRanks;
extern const FaultRequirement kRopeUnderSp;
extern const FaultRequirement kSwiGluUnderTp;
extern const FaultRequirement kTwoMicroBatches;
extern const FaultRequirement kMoe;
extern const FaultRequirement kTwoEpRanks;
extern const FaultRequirement kDeferredSync;
extern const FaultRequirement kTwoStages;
extern const FaultRequirement kUnevenVocabShards;
extern const FaultRequirement kTiedEmbeddings;
extern const FaultRequirement kNvfp4Recipe;
extern const FaultRequirement kCurrentRecipeNotPow2;
extern const FaultRequirement kUnevenVocabOnLoad;
extern const FaultRequirement kMxfp8Recipe;
extern const FaultRequirement kRecipeReducesWeightAmax;
extern const FaultRequirement kFp8Gather;
extern const FaultRequirement kTokenBlockRecipe;
extern const FaultRequirement kTwoExperts;

// ---- the parameter checks (fault_param_checks.cc): "" when the value is acceptable in `s`, else
// why not (FaultParam::check, FaultDescriptor::check)
std::string any_key(const Scenario& s, const std::string& glob);
std::string fp32_key(const Scenario& s, const std::string& glob);
std::string linear_name(const Scenario& s, const std::string& glob);
std::string dim_list(const Scenario&, const std::string& dims);
std::string one_perturbation(const Scenario&, const FaultSpec& spec);
std::string param_name(const Scenario& s, const std::string& glob);
std::string mesh_group(const Scenario& s, const std::string& dims);
std::string skip_names_a_collective(const Scenario& s, const FaultSpec& spec);
std::string dtype_names_a_collective(const Scenario& s, const FaultSpec& spec);
// The resolved value of string parameter `name` of `spec` (what the rows' `inject` read).
const std::string& string_param(const FaultSpec& spec, const char* name);

// ---- the rows, in table order: fault_table() is these lists back to back
std::vector<FaultDescriptor> core_fault_rows();                 // fault_rows_core.cc
std::vector<FaultDescriptor> generic_state_fault_rows();        // fault_rows_generic_state.cc
std::vector<FaultDescriptor> numerics_checkpoint_fault_rows();  // fault_rows_numerics_checkpoint.cc
std::vector<FaultDescriptor> collective_fault_rows();           // fault_rows_collective.cc
std::vector<FaultDescriptor> moe_pipeline_fault_rows();         // fault_rows_moe_pipeline.cc

}  // namespace meshproof::harness::faults_internal
