// The scenario -> engine mapping (harness/train_run.h to_engine_config).
#include "harness/train_run.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "engine/config.h"
#include "runner_test_builders.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using reports::Verdict;
using namespace test;

TEST(ScenarioToEngine, DataSeedAndTrainSeedAreSeparateKeys) {
  Scenario s;
  s.data.seed = 99;
  s.seed = 5;
  const engine::Config c = to_engine_config(s);
  EXPECT_EQ(c.data.seed, 99u);
  EXPECT_EQ(c.seed, 5u);
}

// The recipe options reach the engine (issue #17.2): fp8_format, power_2_scale and eps, which
// was refused for every non-zero value before.
TEST(ScenarioToEngine, RecipeOptionsAreMapped) {
  Scenario s;
  s.recipe = default_recipe(engine::RecipeKind::kCurrent);
  s.recipe.fp8_format = Fp8Format::kE4M3;
  s.recipe.power_2_scale = true;
  s.recipe.eps = 1e-3;
  const engine::Config c = to_engine_config(s);
  EXPECT_EQ(engine::fp8_format_of(c.recipe), engine::Fp8Format::kE4M3);
  EXPECT_TRUE(engine::power_2_scale_of(c.recipe));
  EXPECT_EQ(c.recipe.eps, 1e-3);
  s.recipe = default_recipe(engine::RecipeKind::kBlock);
  s.recipe.power_2_scale = false;
  const engine::Config b = to_engine_config(s);
  EXPECT_FALSE(engine::power_2_scale_of(b.recipe));
  EXPECT_EQ(engine::fp8_format_of(b.recipe), engine::Fp8Format::kE4M3);  // block's default
}

}  // namespace
}  // namespace meshproof::harness
