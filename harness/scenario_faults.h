// The fault catalog as data: each injectable fault, the real bug class it reproduces, what a
// scenario needs for the fault to be meaningful, which checks catch it, and its parameters.
// The scenario loader validates `faults:` entries against this table; the runner (another
// module) implements the injections by name.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshproof::harness {

struct FaultParamInfo {
  std::string name;
  // Integer parameters use default_int/min/max; `max_is_last_layer` bounds by model.layers - 1
  // and `max_is_last_step` by train.steps. String parameters use choices/default_string.
  bool is_int = true;
  int64_t default_int = 0;
  int64_t min = 0;
  bool max_is_last_layer = false;
  bool max_is_last_step = false;
  std::vector<std::string> choices;
  std::string default_string;
  std::string doc;
};

struct FaultRequires {
  bool fp8_recipe = false;         // delayed, current, mxfp8 or block
  bool per_tensor_recipe = false;  // delayed or current (a per-tensor scale and amax)
  bool delayed_recipe = false;     // delayed (an amax history)
  bool fp8_all_gather = false;     // fsdp.fp8_all_gather
  bool fp8_params = false;         // fsdp.fp8_params
  int64_t min_dp_shard = 1;
  int64_t min_dp_replicate = 1;
  int64_t min_tp = 1;
  bool uneven_vocab_shards = false;  // model.vocab is not divisible by dp_shard
};

struct FaultInfo {
  std::string name;
  std::string bug_class;  // the real bug this reproduces, one sentence
  FaultRequires requires_;
  // Checks that catch it; a fault scenario must enable at least one. "resume_cross_mesh" means
  // the resume check with a mesh override.
  std::vector<std::string> caught_by;
  std::vector<FaultParamInfo> params;
};

const std::vector<FaultInfo>& fault_catalog();
const FaultInfo* find_fault(const std::string& name);  // nullptr when unknown

}  // namespace meshproof::harness
