// The mesh and recipe key tables (docs/design.md section 18): the keys of a mesh mapping (mesh,
// checks.resume.mesh, checks.state.mesh, checks.reference.mesh) with the engine::MeshSpec field
// each sets, and of a recipe mapping (recipe, checks.reference.recipe) with its
// engine::RecipeConfig field, fp8_format and power_2_scale defaulting by the recipe name; and
// mesh_keys() and recipe_keys(), each table built once.
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "engine/config/mesh_spec.h"
#include "harness/scenario/scenario_keys.h"
#include "harness/scenario/scenario_keys_internal.h"
#include "kernels/quantize/quantize.h"

namespace meshproof::harness {

namespace {

using engine::MeshSpec;
using engine::RecipeConfig;
using keys_internal::bool_key;
using keys_internal::enum_key;
using keys_internal::int_key;
using keys_internal::names_of;
using keys_internal::number_key;
using keys_internal::own_key;

// A recipe of `kind` with every option at its default (what the resolved defaults derive from).
RecipeConfig defaults_of(engine::RecipeKind kind) {
  RecipeConfig r;
  r.kind = kind;
  return r;
}

std::vector<Key<MeshSpec>> make_mesh_keys() {
  using M = MeshSpec;
  std::vector<Key<M>> k;
  k.push_back(int_key<M>(
      "dp_replicate", 1, 1, 4096, [](M & m) -> auto& { return m.dp_replicate; }, "HSDP replicas"));
  k.push_back(int_key<M>(
      "dp_shard", 1, 1, 4096, [](M & m) -> auto& { return m.dp_shard; }, "FSDP shards"));
  k.push_back(int_key<M>(
      "tp", 1, 1, 4096, [](M & m) -> auto& { return m.tp; }, "tensor-parallel ranks"));
  k.push_back(bool_key<M>(
      "sequence_parallel", false, [](M & m) -> auto& { return m.sequence_parallel; },
      "norms on sequence shards"));
  // Compared with the product, never stored.
  Key<M> world = own_key<M>("world_size", KeyType::kInt, "the product",
                            "optional cross-check: pp x dp_replicate x dp_shard x tp");
  world.imin = 1;
  world.imax = int64_t{1} << 24;
  world.def = int64_t{1};
  k.push_back(world);
  // Expert parallelism (docs/design.md "Expert parallelism"): hashed only when > 1, so the hashes
  // of every scenario without it stay what they were.
  Key<M> ep = int_key<M>(
      "ep", 1, 1, 4096, [](M & m) -> auto& { return m.ep; },
      "expert-parallel ranks (model.moe): borrowed from dp_shard, which it divides; divides "
      "model.moe.experts");
  ep.hash_if = [](const M& m) { return m.ep != 1; };
  k.push_back(ep);
  // Pipeline stages (docs/design.md section 33), the outermost mesh dim: hashed only when > 1,
  // so the hashes of every scenario without stages stay what they were.
  Key<M> pp = int_key<M>(
      "pp", 1, 1, 4096, [](M & m) -> auto& { return m.pp; },
      "pipeline stages (outermost dim): each runs a contiguous share of model.layers "
      "(model.pp_layers, else as even as possible, earlier stages taking the extra layers); at "
      "most model.layers");
  pp.hash_if = [](const M& m) { return m.pp != 1; };
  k.push_back(pp);
  return k;
}

std::vector<Key<RecipeConfig>> make_recipe_keys() {
  using R = RecipeConfig;
  std::vector<std::string> names;
  for (const engine::RecipeName& r : engine::kRecipeNames) names.emplace_back(r.name);
  std::vector<Key<R>> k;
  k.push_back(enum_key<R>(
      "name", RecipeKind::kBf16, names, [](R & r) -> auto& { return r.kind; }, "the recipe"));
  // TE: MXFP8BlockScaling and Float8BlockScaling default to E4M3 for all tensors, the
  // per-tensor recipes to HYBRID (engine::fp8_format_of).
  Key<R> format = enum_key<R>(
      "fp8_format", Fp8Format::kHybrid, names_of<Fp8Format>(engine::fp8_format_name, 2),
      [](R & r) -> auto& { return *r.fp8_format; },
      "delayed, current, block; mxfp8 allows only e4m3");
  // The engine holds an optional (unset: the recipe's default); the scenario always sets it, and
  // reads the resolved value.
  format.get = [](const R& r) {
    return KeyValue{std::string(engine::fp8_format_name(engine::fp8_format_of(r)))};
  };
  format.set = [](R& r, const KeyValue& v) {
    r.fp8_format = std::get<std::string>(v) == "e4m3" ? Fp8Format::kE4M3 : Fp8Format::kHybrid;
  };
  format.default_text = "e4m3 for mxfp8 and block, else hybrid";
  format.default_of = [](const R& r) {
    return KeyValue{
        std::string(engine::fp8_format_name(engine::fp8_format_of(defaults_of(r.kind))))};
  };
  k.push_back(format);
  k.push_back(int_key<R>(
      "margin", 0, 0, 64, [](R & r) -> auto& { return r.margin; },
      "delayed: scale = (fp8_max / amax) / 2^margin"));
  k.push_back(int_key<R>(
      "amax_history_len", 1024, 1, 1 << 16, [](R & r) -> auto& { return r.amax_history_len; },
      "delayed: amax history window length"));
  k.push_back(enum_key<R>(
      "amax_compute_algo", kernels::AmaxAlgo::kMax,
      names_of<kernels::AmaxAlgo>(kernels::amax_algo_name, 2),
      [](R & r) -> auto& { return r.amax_compute_algo; },
      "delayed: max of the history or its newest entry"));
  // TE's amax_epsilon (docs/design.md section 15).
  k.push_back(number_key<R>(
      "eps", 0.0, 0.0, 1.0, false, false, [](R & r) -> auto& { return r.eps; },
      "current, block: amax clamped below by eps"));
  // Float8BlockScaling uses power-of-2 scales (docs/design.md section 4); current scaling does not.
  Key<R> pow2 = bool_key<R>(
      "power_2_scale", false, [](R & r) -> auto& { return *r.power_2_scale; },
      "current, block: scales rounded down to a power of two");
  pow2.get = [](const R& r) { return KeyValue{engine::power_2_scale_of(r)}; };  // as fp8_format
  pow2.set = [](R& r, const KeyValue& v) { r.power_2_scale = std::get<bool>(v); };
  pow2.default_text = "true for block, else false";
  pow2.default_of = [](const R& r) {
    return KeyValue{engine::power_2_scale_of(defaults_of(r.kind))};
  };
  k.push_back(pow2);
  return k;
}

}  // namespace

const std::vector<Key<MeshSpec>>& mesh_keys() {
  static const std::vector<Key<MeshSpec>> keys = make_mesh_keys();
  return keys;
}

const std::vector<Key<RecipeConfig>>& recipe_keys() {
  static const std::vector<Key<RecipeConfig>> keys = make_recipe_keys();
  return keys;
}

}  // namespace meshproof::harness
