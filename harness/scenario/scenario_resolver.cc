// Reads one expanded scenario document into a Scenario (docs/design.md sections 7 and 18): the
// Resolver's reads of the document, each section by the key table
// (harness/scenario/scenario_keys.h), the mesh and recipe mappings (also those of the checks'
// overrides), and resolve(), which reads the sections in order, then the checks and faults
// (scenario_resolver_checks.cc, scenario_resolver_faults.cc) and applies the scenario-level rules
// (scenario_resolver_rules.cc), each problem at the key that wrote it. The Resolver is
// harness/scenario/scenario_resolver_internal.h.
#include "harness/scenario/scenario_resolver.h"

#include <fmt/format.h>

#include <cstdint>
#include <vector>

#include "harness/scenario/scenario_keys.h"
#include "harness/scenario/scenario_resolver_internal.h"

namespace meshproof::harness {

using yaml::Value;

namespace resolver_internal {

std::string Resolver::at(const std::string& path) const {
  // The nearest recorded location: the key itself or an enclosing mapping.
  std::string p = path;
  while (true) {
    auto it = locs.find(p);
    if (it != locs.end()) return it->second;
    const size_t dot = p.rfind('.');
    if (dot == std::string::npos) return root_where;
    p = p.substr(0, dot);
  }
}

void Resolver::bad(const std::string& path, const std::string& what) const {
  report(at(path), path, what);
}

engine::MeshSpec Resolver::read_mesh(const Value* v, const std::string& path,
                                     const std::string& absent_where) {
  Section s(v, path, absent_where, locs, section_keys(mesh_keys(), ""));
  engine::MeshSpec m;
  read_keys(s, mesh_keys(), "", m);
  if (s.has("world_size")) {
    const int64_t ws = std::get<int64_t>(read_key(s, key_at(mesh_keys(), "world_size"), m));
    if (ws != m.world_size()) {
      bad(s.child("world_size"),
          m.pp > 1 ? fmt::format("{} does not match pp x dp_replicate x dp_shard x tp = {} x {} "
                                 "x {} x {} = {}",
                                 ws, m.pp, m.dp_replicate, m.dp_shard, m.tp, m.world_size())
                   : fmt::format("{} does not match dp_replicate x dp_shard x tp = {} x {} x {} "
                                 "= {}",
                                 ws, m.dp_replicate, m.dp_shard, m.tp, m.world_size()));
    }
  }
  return m;
}

// The recipe keys; fp8_format and power_2_scale default by the recipe name (always set). The
// rules (mxfp8 takes only e4m3, ...) are engine::check_run's.
engine::RecipeConfig Resolver::read_recipe(const Value* raw, const std::string& path,
                                           const std::string& absent_where) {
  if (raw != nullptr && raw->kind == Value::kNull) {
    fail(raw->where, path, "expected a recipe name or a mapping, got nothing (null)");
  }
  Value shorthand;
  const Value* v = raw;
  if (raw != nullptr && raw->kind == Value::kScalar) {
    shorthand = recipe_shorthand(*raw);
    v = &shorthand;
  }
  Section s(v, path, absent_where, locs, section_keys(recipe_keys(), ""));
  engine::RecipeConfig r = default_recipe(RecipeKind::kBf16);
  read_keys(s, recipe_keys(), "", r);
  return r;
}

// A section of the key table, every key with a field read in table order.
Section Resolver::read_section(const Section& top, const std::string& name, Scenario& sc) {
  Section s(top.get(name), name, root_where, locs, section_keys(scenario_keys(), name));
  read_keys(s, scenario_keys(), name, sc);
  return s;
}

// One key of the key table (its full path) from `s`, the section that holds it.
void Resolver::read_one(Section& s, const std::string& path, Scenario& sc) {
  const Key<Scenario>& k = key_at(scenario_keys(), path);
  k.set(sc, read_key(s, k, sc));
}

Scenario Resolver::resolve(const std::string& default_name) {
  Section top(&root, "", root_where, locs, section_keys(scenario_keys(), ""));
  Scenario sc;
  sc.source = source;
  sc.base_name = top.string("name", default_name);
  sc.name_where = top.where("name");
  if (const std::string why = name_problem(sc.base_name); !why.empty()) bad("name", why);
  read_one(top, "description", sc);

  const Section ms = read_section(top, "model", sc);
  if (const Value* mv = ms.get("moe")) {  // model.moe (docs/design.md section 27)
    Section moe(mv, "model.moe", root_where, locs, section_keys(scenario_keys(), "model.moe"));
    read_keys(moe, scenario_keys(), "model.moe", sc);
    // A model.moe mapping without experts would be parsed and ignored.
    if (!sc.model.moe.enabled())
      bad(moe.has("experts") ? "model.moe.experts" : "model.moe",
          "model.moe needs experts >= 1 (leave model.moe out for the dense model)");
  }
  if (const Value* pv = ms.get("pp_layers")) {  // model.pp_layers (docs/design.md section 33)
    locs["model.pp_layers"] = pv->where;
    if (pv->kind != Value::kSeq || pv->seq.empty()) {
      bad("model.pp_layers",
          fmt::format("expected a non-empty list of integers (layers per pipeline stage), got {}",
                      describe(*pv)));
    } else {
      // Set only when every entry is an integer (the engine's rules then judge the split).
      std::vector<int64_t> split;
      bool integers = true;
      for (size_t i = 0; i < pv->seq.size(); ++i) {
        const Value& e = pv->seq[i];
        int64_t n = 0;
        if (e.kind != Value::kScalar || e.quoted || !yaml::parse_int(e.scalar, n)) {
          report(e.where, fmt::format("model.pp_layers[{}]", i),
                 fmt::format("expected an integer, got {}", describe(e)));
          integers = false;
        }
        split.push_back(n);
      }
      if (integers) sc.model.pp_layers = split;
    }
  }
  sc.mesh = read_mesh(top.get("mesh"), "mesh", root_where);
  sc.recipe = read_recipe(top.get("recipe"), "recipe", root_where);

  const Section fs = read_section(top, "fsdp", sc);
  // Scenario policy: the engine runs it with a note (a high-precision gather), which would make
  // the scenario mean something it does not do. (fsdp.fp8_params is the engine's rule.)
  if (sc.fsdp.fp8_all_gather && !engine::is_fp8(sc.recipe.kind)) {
    bad(fs.child("fp8_all_gather"),
        fmt::format(
            "needs an FP8 recipe with an FP8 all-gather (delayed, current, mxfp8 or nvfp4), got "
            "recipe {}",
            to_string(sc.recipe.kind)));
  }

  const Section ts = read_section(top, "train", sc);
  const engine::TrainingConfig& t = sc.train;
  // warmup_cosine: the peak step and at least one cosine step to min_lr (the key table bounds
  // warmup_steps by steps - 2).
  if (t.schedule == Schedule::kWarmupCosine && t.steps < 2) {
    fail(ts.where("schedule"), ts.child("schedule"),
         fmt::format("warmup_cosine needs train.steps >= 2 (a peak step and a step at min_lr), "
                     "got {}",
                     t.steps));
  }
  if (t.schedule == Schedule::kConstant) {
    for (const char* key : {"warmup_steps", "min_lr"}) {
      if (ts.has(key)) fail(ts.where(key), ts.child(key), "only applies to schedule warmup_cosine");
    }
  }

  read_section(top, "data", sc);
  read_one(top, "backend", sc);
  read_one(top, "launcher", sc);
  read_one(top, "requires_gpu", sc);
  if (sc.requires_gpu && sc.backend == Backend::kCpu) {
    bad("requires_gpu", "true contradicts backend: cpu");
  }

  const Section cks = read_section(top, "checkpoint", sc);

  read_checks(top.get("checks"), sc);
  read_faults(top.get("faults"), sc);

  no_effect_rules(sc, ms, fs, ts, cks);
  engine_rules(sc);
  read_one(top, "expect", sc);
  if (sc.expect == Expect::kCaught && sc.faults.empty()) {
    bad("expect", "caught needs at least one entry in faults");
  }
  if (sc.expect == Expect::kPass && !sc.faults.empty()) {
    bad("faults", "a scenario with injected faults must say expect: caught");
  }
  return sc;
}

}  // namespace resolver_internal

using resolver_internal::Resolver;

Value recipe_shorthand(const Value& v) {
  if (v.kind != Value::kScalar) return v;
  Value m;
  m.kind = Value::kMap;
  m.where = v.where;
  m.map.emplace_back("name", v);
  m.key_where.push_back(v.where);
  return m;
}

Value normalize_recipe(const std::string& path, Value v) {
  if (path == "recipe" || path == "checks.reference.recipe") return recipe_shorthand(v);
  return v;
}

Scenario resolve_scenario(const Value& doc, const std::string& source,
                          const std::string& default_name) {
  Resolver resolver{doc, source, fmt::format("{}:1:1", source), {}};
  return resolver.resolve(default_name);
}

}  // namespace meshproof::harness
