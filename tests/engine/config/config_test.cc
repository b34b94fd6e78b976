#include "engine/config/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "engine/model/data.h"
#include "engine/model/params.h"
#include "engine/model/trainer.h"
#include "kernels/core/error.h"
#include "kernels/random/philox.h"
#include "mesh/core/layout.h"

namespace meshproof::engine {
namespace {

// Expects validate() to throw a kInput error whose message contains `needle`.
void expect_input_error(const Config& c, const std::string& needle) {
  try {
    validate(c);
    FAIL() << "expected an input error mentioning '" << needle << "'";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(e.message().find(needle), std::string::npos) << e.message();
  }
}

TEST(Config, DefaultsAreValid) { EXPECT_NO_THROW(validate(Config{})); }

TEST(Config, BadValuesNameTheField) {
  Config c;
  c.model.heads = 3;
  expect_input_error(c, "model.heads = 3 does not divide model.hidden = 32");
  c = Config{};
  c.training.seq_len = 17;
  expect_input_error(c, "training.seq_len = 17 exceeds model.max_positions = 16");
  c = Config{};
  c.training.micro_batches = 3;
  expect_input_error(c, "training.micro_batches");
  c = Config{};
  c.model.dropout = 1.0;
  expect_input_error(c, "model.dropout");
  c = Config{};
  c.model.ffn = 100;
  c.recipe.kind = RecipeKind::kMxfp8;
  expect_input_error(c, "recipe = mxfp8 needs model.ffn % 32 == 0, got 100");
  c.recipe.kind = RecipeKind::kBf16;
  EXPECT_NO_THROW(validate(c));
  c = Config{};
  c.data.markov_order = 5;
  expect_input_error(c, "data.markov_order");
  c = Config{};
  c.training.lr = -1;
  expect_input_error(c, "training.lr");
  EXPECT_THROW(parse_activation("silu", "model.activation"), kernels::Error);
  // Llama-style options (docs/design.md section 24).
  c = Config{};
  c.model.kv_heads = 3;
  expect_input_error(c, "model.kv_heads = 3 does not divide model.heads = 4");
  c = Config{};
  c.model.hidden = 24;
  c.model.heads = 8;  // head dim 3: RoPE pairs (2i, 2i+1) need an even one
  c.model.position = PositionKind::kRope;
  expect_input_error(c,
                     "model.position = rope needs an even head dim, got model.hidden / "
                     "model.heads = 24 / 8");
  c.model.position = PositionKind::kLearned;
  EXPECT_NO_THROW(validate(c));
  c = Config{};
  c.model.rope_theta = 1.0;
  expect_input_error(c, "model.rope_theta = 1 must be finite and > 1");
  EXPECT_THROW(parse_position("alibi", "model.position"), kernels::Error);
}

// Grouped-query attention, RoPE and model.bias change the parameter set (docs/design.md section
// 24); the defaults keep the section 3 set, shapes and canonical order.
TEST(Params, LlamaOptionsChangeTheParameterSet) {
  ModelConfig m;  // V 64, H 32, A 4, F 128, P 16
  const std::vector<ParamSpec> gpt = param_specs(m);
  EXPECT_EQ(gpt[1].name, "embed.pos");
  m.kv_heads = 4;  // == A: the same set
  const std::vector<ParamSpec> same = param_specs(m);
  ASSERT_EQ(same.size(), gpt.size());
  for (size_t i = 0; i < gpt.size(); ++i) {
    EXPECT_EQ(same[i].name, gpt[i].name);
    EXPECT_EQ(same[i].shape, gpt[i].shape) << gpt[i].name;
  }
  m.kv_heads = 1;
  m.position = PositionKind::kRope;
  m.bias = false;
  m.vocab_parallel = true;
  for (const ParamSpec& p : param_specs(m)) {
    EXPECT_FALSE(p.name.ends_with(".bias") && p.name.find("ln") == std::string::npos) << p.name;
    EXPECT_NE(p.name, "embed.pos");
    if (p.name == "layers.0.attn.qkv.weight") {
      EXPECT_EQ(p.shape, kernels::Shape({(4 + 2 * 1) * 8, 32}));  // (A + 2KV) d rows
    }
    if (p.vocab_rows) {
      EXPECT_EQ(p.tp, TpStyle::kColumn) << p.name;
    }
  }
}

TEST(Config, TrainerRejectsBadConfigBeforeWork) {
  Config c;
  c.model.heads = 5;
  EXPECT_THROW(Trainer{c}, kernels::Error);
}

TEST(Init, ShardsEqualRowsOfTheWholeTensor) {
  ModelConfig m;
  for (const ParamSpec& s : param_specs(m)) {
    const kernels::Tensor whole = init_param_rows(s, 99, 0, s.shape[0]);
    const int64_t mid = s.shape[0] / 3, end = 2 * s.shape[0] / 3 + 1;
    const kernels::Tensor part = init_param_rows(s, 99, mid, end);
    const auto w = whole.slice_rows(mid, end).to_vector<float>();
    EXPECT_EQ(part.to_vector<float>(), w) << s.name;
  }
}

// A box that is a proper part of every dim (columns too: a tp shard of a row-parallel weight)
// draws exactly the whole tensor's elements there, for 1-, 2- and 3-D parameters, and an element's
// value is the design's formula at its global flat index.
TEST(Init, BoxesEqualTheSameBoxOfTheWholeTensor) {
  ModelConfig m;
  std::vector<ParamSpec> specs = param_specs(m);
  ParamSpec cube;
  cube.name = "test.cube";
  cube.shape = kernels::Shape{5, 7, 9};
  cube.init = InitKind::kNormal;
  cube.std = 0.5;
  specs.push_back(cube);
  for (const ParamSpec& s : specs) {
    const mesh::Box whole_box = mesh::Box::whole(s.shape);
    const kernels::Tensor whole = init_param_box(s, 99, whole_box);
    mesh::Box part_box = whole_box;
    for (int d = 0; d < s.shape.rank(); ++d) {
      part_box.offset[static_cast<size_t>(d)] = kernels::Elements(s.shape[d] / 3);
      part_box.extent[static_cast<size_t>(d)] =
          kernels::Elements(std::max<int64_t>(1, s.shape[d] / 3));
    }
    const kernels::Tensor part = init_param_box(s, 99, part_box);
    ASSERT_EQ(part.shape(), part_box.shape()) << s.name;
    kernels::Tensor expect =
        kernels::Tensor::zeros(part_box.shape(), kernels::DType::kFloat32, kernels::Device::cpu());
    mesh::copy_region(whole, whole_box, expect, part_box, part_box);
    EXPECT_EQ(part.to_vector<float>(), expect.to_vector<float>()) << s.name;
  }
  // The cube's box [1:2, 2:4, 3:6]: its last element is global (1 * 7 + 3) * 9 + 5.
  mesh::Box b = mesh::Box::whole(cube.shape);
  b.offset = {kernels::Elements(1), kernels::Elements(2), kernels::Elements(3)};
  b.extent = {kernels::Elements(1), kernels::Elements(2), kernels::Elements(3)};
  const std::vector<float> v = init_param_box(cube, 7, b).to_vector<float>();
  ASSERT_EQ(v.size(), 6u);
  const uint64_t stream = kernels::philox_stream("test.cube");
  EXPECT_EQ(v[5], static_cast<float>(0.5 * kernels::philox_normal(7, stream, (1 * 7 + 3) * 9 + 5)));
  EXPECT_EQ(v[0], static_cast<float>(0.5 * kernels::philox_normal(7, stream, (1 * 7 + 2) * 9 + 3)));
  b.extent[2] = kernels::Elements(7);  // columns 3..10 of 9
  EXPECT_THROW((void)init_param_box(cube, 7, b), kernels::Error);
}

// Several drawing threads (a real-size model's boxes) give the bits of one: 2 to 8 shares and
// more shares than runs (28 of them), on a 3-D box cut in every dim (each share's first run
// starts mid-odometer) and on every parameter of the default model; every element of the one-
// thread draw equals the design's formula.
TEST(Init, ThreadedDrawsEqualOneThread) {
  ParamSpec cube;
  cube.name = "test.cube";
  cube.shape = kernels::Shape{6, 11, 13};
  cube.init = InitKind::kNormal;
  cube.std = 0.25;
  mesh::Box b = mesh::Box::whole(cube.shape);
  b.offset = {kernels::Elements(1), kernels::Elements(2), kernels::Elements(3)};
  b.extent = {kernels::Elements(4), kernels::Elements(7), kernels::Elements(9)};
  const std::vector<float> one = init_param_box(cube, 3, b, 1).to_vector<float>();
  const uint64_t stream = kernels::philox_stream("test.cube");
  for (int64_t i = 0, k = 0; i < 4; ++i)
    for (int64_t j = 0; j < 7; ++j)
      for (int64_t c = 0; c < 9; ++c, ++k)
        ASSERT_EQ(one[static_cast<size_t>(k)],
                  static_cast<float>(0.25 * kernels::philox_normal(
                                                3, stream, ((1 + i) * 11 + 2 + j) * 13 + 3 + c)))
            << i << "," << j << "," << c;
  for (int threads : {2, 3, 5, 8, 28, 40})
    EXPECT_EQ(init_param_box(cube, 3, b, threads).to_vector<float>(), one) << threads;
  ModelConfig m;
  for (const ParamSpec& s : param_specs(m)) {
    const mesh::Box whole = mesh::Box::whole(s.shape);
    EXPECT_EQ(init_param_box(s, 99, whole, 3).to_vector<float>(),
              init_param_box(s, 99, whole, 1).to_vector<float>())
        << s.name;
  }
  EXPECT_THROW((void)init_param_box(cube, 3, b, 0), kernels::Error);
}

TEST(Init, ThreadsPerBoxSize) {
  EXPECT_EQ(init_threads(1, 16), 1);
  EXPECT_EQ(init_threads((int64_t{1} << 23) - 1, 16), 1);  // the test models: one thread
  EXPECT_EQ(init_threads(int64_t{1} << 23, 16), 2);
  EXPECT_EQ(init_threads(int64_t{4096} * 14336, 16), 14);  // issue 16's fc1 weight
  EXPECT_EQ(init_threads(int64_t{4096} * 14336, 1), 1);    // a rank pinned to one CPU
  EXPECT_EQ(init_threads(int64_t{1} << 40, 512), 64);
}

TEST(Init, FollowsTheDesignTable) {
  ModelConfig m;
  m.layers = 4;
  const TensorMap p = init_params(m, 5);
  auto stddev = [](const kernels::Tensor& t) {
    double sq = 0;
    for (float v : t.to_vector<float>()) sq += double(v) * v;
    return std::sqrt(sq / static_cast<double>(t.numel().value));
  };
  // 0.02 and 0.02/sqrt(2L) = 0.00707 within sampling error (thousands of samples: < 5%).
  EXPECT_NEAR(stddev(p.at("layers.0.attn.qkv.weight")), 0.02, 0.001);
  EXPECT_NEAR(stddev(p.at("layers.3.mlp.fc2.weight")), 0.02 / std::sqrt(8.0), 0.00035);
  EXPECT_EQ(p.at("layers.1.ln2.weight").to_vector<float>(), std::vector<float>(32, 1.0f));
  EXPECT_EQ(p.at("final_ln.bias").to_vector<float>(), std::vector<float>(32, 0.0f));
  EXPECT_TRUE(p.contains("lm_head.weight"));
  m.tied_embeddings = true;
  m.activation = Activation::kSwiGlu;
  m.norm = NormKind::kRmsNorm;
  const TensorMap q = init_params(m, 5);
  EXPECT_FALSE(q.contains("lm_head.weight"));
  EXPECT_FALSE(q.contains("layers.0.ln1.bias"));
  EXPECT_EQ(q.at("layers.0.mlp.fc1_up.weight").shape(), (kernels::Shape{128, 32}));
}

TEST(Data, RowsAreGlobalAndDeterministic) {
  DataConfig d;
  d.markov_order = 2;
  d.seed = 3;
  MarkovSource src(16, d, 8, 10);
  const kernels::Tensor all = src.batch(4);
  const kernels::Tensor part = src.rows(4, 2, 6);  // data-parallel rank 1 of 2... of 4
  EXPECT_EQ(part.to_vector<int32_t>(), all.slice_rows(2, 6).to_vector<int32_t>());
  EXPECT_NE(src.batch(5).to_vector<int32_t>(), all.to_vector<int32_t>());
  // Data-parallel rank 2 of 4 takes rows [4, 6).
  EXPECT_EQ(src.rank_rows(4, 2, 4).to_vector<int32_t>(), all.slice_rows(4, 6).to_vector<int32_t>());
  EXPECT_THROW(src.rank_rows(4, 0, 3), kernels::Error);
  for (int32_t t : all.to_vector<int32_t>()) ASSERT_TRUE(t >= 0 && t < 16);
}

// The host tables are built once per process per (vocab, order, decay, seed) and shared by every
// source (the virtual ranks of a run are threads): the shared copy equals a freshly built one, a
// different key gets its own tables, and sources made by concurrent threads (as the ranks of a
// local run make them) share one copy and make the same rows as a source made alone.
TEST(Data, TablesAreSharedPerKeyAndEqualFreshlyBuiltOnes) {
  DataConfig d;
  d.markov_order = 2;
  d.seed = 5;
  const auto shared = MarkovSource::shared_tables(16, d);
  const auto fresh = MarkovSource::build_tables(16, d);
  ASSERT_NE(shared.get(), fresh.get());
  EXPECT_EQ(shared->cdf, fresh->cdf);
  EXPECT_EQ(shared->ranked, fresh->ranked);
  EXPECT_EQ(shared->ranked.size(), size_t{16 * 16 * 16});
  EXPECT_EQ(MarkovSource::shared_tables(16, d).get(), shared.get());
  // Every part of the key selects other tables (negative controls: a cache keyed on less would
  // hand these the tables above).
  DataConfig other_seed = d, other_decay = d, other_order = d;
  other_seed.seed = 6;
  other_decay.decay = 0.75;
  other_order.markov_order = 1;
  const auto s2 = MarkovSource::shared_tables(16, other_seed);
  const auto s3 = MarkovSource::shared_tables(16, other_decay);
  const auto s4 = MarkovSource::shared_tables(16, other_order);
  const auto s5 = MarkovSource::shared_tables(8, d);
  for (const auto& t : {s2, s3, s4, s5}) EXPECT_NE(t.get(), shared.get());
  EXPECT_NE(s2->ranked, shared->ranked);
  EXPECT_EQ(s2->cdf, shared->cdf);
  EXPECT_NE(s3->cdf, shared->cdf);
  EXPECT_EQ(s4->ranked.size(), size_t{16 * 16});
  EXPECT_EQ(s5->ranked.size(), size_t{8 * 8 * 8});

  const MarkovSource alone(16, d, 8, 10);
  std::vector<std::unique_ptr<MarkovSource>> sources(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < sources.size(); ++i)
    threads.emplace_back(
        [&sources, &d, i] { sources[i] = std::make_unique<MarkovSource>(16, d, 8, 10); });
  for (std::thread& t : threads) t.join();
  for (const auto& s : sources) {
    EXPECT_EQ(&s->tables(), shared.get());
    EXPECT_EQ(s->batch(3).to_vector<int32_t>(), alone.batch(3).to_vector<int32_t>());
  }
}

TEST(Data, StreamIsKeyedByDataSeedNotTheModelSeed) {
  Config c;
  c.data.seed = 7;
  Config other_model = c;
  other_model.seed = c.seed + 1;  // re-initialises the model, same tokens
  Config other_data = c;
  other_data.data.seed = 8;  // same model, other tokens
  const Trainer a(c), b(other_model), d(other_data);
  EXPECT_EQ(a.data().batch(0).to_vector<int32_t>(), b.data().batch(0).to_vector<int32_t>());
  EXPECT_NE(a.data().batch(0).to_vector<int32_t>(), d.data().batch(0).to_vector<int32_t>());
  EXPECT_NE(a.params().at("embed.tok").to_vector<float>(),
            b.params().at("embed.tok").to_vector<float>());
  EXPECT_EQ(a.params().at("embed.tok").to_vector<float>(),
            d.params().at("embed.tok").to_vector<float>());
  const auto items = config_items(c);
  EXPECT_NE(std::find(items.begin(), items.end(),
                      std::make_pair(std::string("data.seed"), std::string("7"))),
            items.end());
}

TEST(Data, EmpiricalConditionalEntropyMatchesTheFloor) {
  // Order 1 over V = 8: estimate H(next | previous) from counts over many tokens.
  DataConfig d;
  d.decay = 0.6;
  const int64_t v = 8, b = 64, s = 64;
  d.seed = 11;  // the stream the bound below was checked on
  MarkovSource src(v, d, b, s);
  std::vector<double> counts(v * v, 0.0);
  for (int64_t step = 0; step < 8; ++step) {
    const auto t = src.batch(step).to_vector<int32_t>();
    for (int64_t r = 0; r < b; ++r)
      for (int64_t j = 0; j < s; ++j) counts[t[r * (s + 1) + j] * v + t[r * (s + 1) + j + 1]] += 1;
  }
  double h = 0, total = 0;
  for (int64_t c = 0; c < v; ++c) {
    double row = 0;
    for (int64_t n = 0; n < v; ++n) row += counts[c * v + n];
    for (int64_t n = 0; n < v; ++n)
      if (counts[c * v + n] > 0) h -= counts[c * v + n] * std::log(counts[c * v + n] / row);
    total += row;
  }
  // 32768 transitions: the plug-in estimate is biased low by ~(V-1)V/(2N) = 0.001 and has
  // standard error ~0.005; 0.02 is 4 standard errors.
  EXPECT_NEAR(h / total, src.entropy_rate(), 0.02);
  MarkovSource uniform(8, DataConfig{1, 1.0, 1}, 1, 4);
  EXPECT_NEAR(uniform.entropy_rate(), std::log(8.0), 1e-12);
}

// The free function the reports use is the source's own entropy rate, bit for bit, and matches
// the closed forms.
TEST(Data, EntropyRateWithoutASource) {
  DataConfig d;  // decay 0.5
  EXPECT_EQ(markov_entropy_rate(64, d.decay), MarkovSource(64, d, 2, 4).entropy_rate());
  // V = 4, decay 1/2: p = (8, 4, 2, 1) / 15. Summed in another order: a few ulps apart (1e-15).
  const double h4 = -(8 * std::log(8.0 / 15) + 4 * std::log(4.0 / 15) + 2 * std::log(2.0 / 15) +
                      std::log(1.0 / 15)) /
                    15;
  EXPECT_NEAR(markov_entropy_rate(4, 0.5), h4, 1e-15);
  // V = 256, decay 1/2: a geometric distribution truncated at 2^-256, H = 2 ln 2 to double
  // precision (the sum of 256 terms rounds at ~1e-16 relative; 1e-14 leaves room for that).
  EXPECT_NEAR(markov_entropy_rate(256, 0.5), 2 * std::log(2.0), 1e-14);
}

}  // namespace
}  // namespace meshproof::engine
