// Checkpoints across pipeline stages (docs/design.md section 33): each stage's ranks hold only
// their stage's entries, and a checkpoint keeps global keys, so a save with pp = 2 loads with
// pp = 1 or 4 and with any split of the layers. The pipelined fp32 step is bitwise the one-stage
// step on the same inner mesh, so every resume below must be bitwise the uninterrupted run on the
// target mesh. Tied embeddings (a copy of embed.tok on both end stages: the first saves it, both
// load it) and delayed scaling (each stage's linears' amax histories) resume bitwise too. The
// negative controls: a checkpoint without one stage's entries, a chunk in another stage's file, a
// key saved by two stages, a checkpoint key no stage of the live state holds, a tied embed.tok
// loaded into the first stage's copy only.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/state_keys.h"
#include "engine/session/session.h"
#include "kernels/core/error.h"
#include "mesh/local/local_comm.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

using testing::error_of;

namespace fs = std::filesystem;
using kernels::Tensor;

// A fresh folder per test under the build's temporary directory.
fs::path fresh_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() /
                     fmt::format("meshproof_pp_ckpt_{}_{}", static_cast<int>(getpid()), name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// Key `key`'s global tensor in checkpoint `two` (index b) is the one in `one` (index a), bit for
// bit.
void expect_same_global(const fs::path& one, const CheckpointIndex& a, const fs::path& two,
                        const CheckpointIndex& b, const std::string& key) {
  const Tensor ta = read_global(one, a, a.keys.at(key));
  const Tensor tb = read_global(two, b, b.keys.at(key));
  ASSERT_EQ(ta.nbytes().value, tb.nbytes().value) << key;
  EXPECT_EQ(std::memcmp(ta.raw_data(), tb.raw_data(), static_cast<size_t>(ta.nbytes().value)), 0)
      << key;
}

// fp32, 4 layers (pp 1, 2 and 4 all split them), 2 micro-batches, 4 steps, AdamW with decay and
// a warmup-cosine LR (the optimizer step and LR position are resumed state too).
constexpr int64_t kRunSteps = 4;
constexpr int64_t kSaveAt = 2;

RunOptions options(int pp, std::vector<int64_t> split = {},
                   PpSchedule schedule = PpSchedule::kGpipe) {
  testing::TestModel tm;
  tm.layers = 4;
  Config c = testing::make_config(tm);
  c.training.micro_batches = 2;
  c.training.steps = kRunSteps;
  c.training.schedule = LrSchedule::kWarmupCosine;
  c.training.warmup_steps = 1;
  c.training.pp_schedule = schedule;
  c.model.pp_layers = std::move(split);
  MeshSpec m;
  m.dp_shard = 2;  // FSDP inside every stage
  m.pp = pp;
  return testing::run_options(c, m, kRunSteps);
}

std::string describe(const RunOptions& o) {
  return fmt::format("pp {} [{}] {}{}{}", o.mesh.pp, fmt::join(o.config.model.pp_layers, ","),
                     pp_schedule_name(o.config.training.pp_schedule),
                     o.config.model.tied_embeddings ? " tied" : "",
                     o.config.recipe.kind == RecipeKind::kDelayed ? " delayed" : "");
}

// options() with tied embeddings (embed.tok held by both end stages under pp).
RunOptions tied(RunOptions o) {
  o.config.model.tied_embeddings = true;
  return o;
}

// options() with recipe delayed (every stage holds its own linears' amax histories and scales).
RunOptions delayed(RunOptions o) {
  o.config.recipe.kind = RecipeKind::kDelayed;
  return o;
}

// Trains kSaveAt steps on `o` and saves under `root`: the checkpoint directory.
fs::path train_and_save(const RunOptions& o, const fs::path& root) {
  fs::path dir;
  run_on_ranks(o, [&](mesh::RankComms& comms) {
    TrainingSession s(o, comms);
    for (int64_t i = 0; i < kSaveAt; ++i) s.step();
    const fs::path d = save_checkpoint(root, kSaveAt, s.state(), comms);
    if (comms.rank() == 0) dir = d;
  });
  return dir;
}

// A fresh session on `o` loads `dir` and trains to kRunSteps: the metrics of those steps and the
// final parameters, as a RunResult. `skip_replicas` (a negative control) loads the state without
// its replicas (StateEntry::replica: the last stage's copy of a tied embed.tok and its moments),
// which keep their initial values.
RunResult resume(const RunOptions& o, const fs::path& dir, bool skip_replicas = false) {
  RunResult r;
  std::map<std::string, Tensor> params;
  run_on_ranks(
      o,
      [&](mesh::RankComms& comms) {
        TrainingSession s(o, comms);
        ShardedState loaded = s.state();  // the entries' tensors are the live ones
        if (skip_replicas)
          std::erase_if(loaded.entries, [](const StateEntry& e) { return e.replica; });
        load_checkpoint(dir, loaded, comms);
        s.state().scalars = loaded.scalars;
        s.load_scalars();
        std::vector<StepMetrics> m;
        while (s.steps_done() < kRunSteps) m.push_back(s.step());
        std::map<std::string, Tensor> p = s.gather_params();
        if (comms.rank() == 0) {
          r.metrics = m;
          params = p;
        }
      },
      [&] {
        for (auto& [name, t] : params) r.final_params[name] = t.clone();
        params.clear();
      });
  return r;
}

// The uninterrupted run's last kRunSteps - kSaveAt steps and its final parameters.
RunResult straight_tail(const RunOptions& o) {
  RunResult r = run_training(o);
  r.metrics.erase(r.metrics.begin(), r.metrics.begin() + kSaveAt);
  return r;
}

// A run saved after kSaveAt steps on `from` and resumed on `to` (in `dir`): bitwise `to`'s
// uninterrupted run, loss, grad norm and every final parameter.
struct ResumePair {
  RunOptions from, to;
};
void expect_resumes_bitwise(const std::vector<ResumePair>& pairs, const fs::path& root) {
  for (size_t i = 0; i < pairs.size(); ++i) {
    const ResumePair& p = pairs[i];
    const std::string ctx = describe(p.from) + " -> " + describe(p.to);
    const fs::path dir = train_and_save(p.from, root / std::to_string(i));
    const RunResult got = resume(p.to, dir);
    const RunResult want = straight_tail(p.to);
    ASSERT_EQ(got.final_params.size(), want.final_params.size()) << ctx;
    testing::expect_same_run(want, got, ctx);
  }
}

TEST(PipelineCheckpoint, SameMeshResumeIsBitwiseForBothSchedules) {
  const fs::path root = fresh_dir("same_mesh");
  for (PpSchedule sched : {PpSchedule::kGpipe, PpSchedule::kOneFOneB}) {
    const RunOptions o = options(2, {}, sched);
    const fs::path dir = train_and_save(o, root / std::string(pp_schedule_name(sched)));
    const RunResult got = resume(o, dir);
    const RunResult want = straight_tail(o);
    ASSERT_EQ(got.final_params.size(), want.final_params.size());
    testing::expect_same_run(want, got, describe(o) + " resumed on itself");
  }
  fs::remove_all(root);
}

// pp 2 -> pp 1, pp 1 -> pp 4, and one uneven split onto the mirrored one: each resumed run is
// bitwise the target mesh's uninterrupted run (which is bitwise the source's: the step does not
// depend on pp or the split).
TEST(PipelineCheckpoint, ResumeAcrossStageCountsAndSplitsIsBitwise) {
  const fs::path root = fresh_dir("cross");
  expect_resumes_bitwise(
      {
          {options(2), options(1)},
          {options(1), options(4, {}, PpSchedule::kOneFOneB)},
          {options(2, {3, 1}, PpSchedule::kOneFOneB), options(2, {1, 3})},
      },
      root);
  fs::remove_all(root);
}

// Tied embeddings (docs/design.md section 33): both end stages hold model/embed.tok and its
// moments; the save writes the reported copy only (the first stage's, stage_reports) and the load
// fills both from the one global key, on any pp. Same-mesh resume for both schedules, pp 2 -> 1
// and pp 1 -> 4: each bitwise the target's uninterrupted run (whose losses use the first stage's
// embedding and the last stage's head, so both copies must have been loaded). The index holds
// embed.tok's keys once, in the first stage's files (rank_00000/1), bitwise the pp 1 save's.
TEST(PipelineCheckpoint, TiedEmbeddingsResumeBitwiseOnAnyStageCount) {
  const fs::path root = fresh_dir("tied");
  expect_resumes_bitwise(
      {
          {tied(options(2)), tied(options(2))},
          {tied(options(2, {}, PpSchedule::kOneFOneB)),
           tied(options(2, {}, PpSchedule::kOneFOneB))},
          {tied(options(2)), tied(options(1))},
          {tied(options(1)), tied(options(4, {}, PpSchedule::kOneFOneB))},
      },
      root);
  const fs::path one = train_and_save(tied(options(1)), root / "pp1");
  const fs::path two = train_and_save(tied(options(2)), root / "pp2");
  const CheckpointIndex a = read_checkpoint_index(one);
  const CheckpointIndex b = read_checkpoint_index(two);
  ASSERT_EQ(a.keys.size(), b.keys.size());
  for (const std::string& key :
       {keys::model("embed.tok"), keys::exp_avg("embed.tok"), keys::exp_avg_sq("embed.tok")}) {
    const KeyRecord& k = b.keys.at(key);
    ASSERT_FALSE(k.chunks.empty()) << key;
    for (const ChunkRecord& c : k.chunks) EXPECT_LT(c.file, "rank_00002.h5") << key;
    expect_same_global(one, a, two, b, key);
  }
  EXPECT_EQ(b.keys.count(keys::model("lm_head.weight")), 0U);
  EXPECT_TRUE(verify_checkpoint(two).ok());
  fs::remove_all(root);
}

// Negative control: a load that fills only the saved copy (the last stage's replica keeps its
// initial weights and moments) diverges from the uninterrupted run at its first step, on the same
// mesh and from pp 1; with the replicas loaded (above) it does not.
TEST(PipelineCheckpoint, TiedEmbeddingLoadedOnOneStageOnlyDiverges) {
  const fs::path root = fresh_dir("tied_one_copy");
  for (int from : {2, 1}) {
    const RunOptions to = tied(options(2, {}, PpSchedule::kOneFOneB));
    const fs::path dir = train_and_save(tied(options(from)), root / std::to_string(from));
    const RunResult got = resume(to, dir, true);
    const RunResult want = straight_tail(to);
    ASSERT_EQ(got.metrics.size(), want.metrics.size());
    EXPECT_NE(got.metrics.at(0).loss, want.metrics.at(0).loss) << "from pp " << from;
    EXPECT_NE(got.final_params.at("embed.tok").to_vector<float>(),
              want.final_params.at("embed.tok").to_vector<float>())
        << "from pp " << from;
  }
  fs::remove_all(root);
}

// Recipe delayed: every stage saves its own linears' amax histories and scales under their global
// keys (fp8/<linear>/<role>/...), and a load on any pp fills them from whichever stage wrote
// them. Same-mesh resume for both schedules and pp 2 -> 1: each bitwise the target's
// uninterrupted run (loss, grad norm, parameters; the FP8 scales decide every quantized GEMM).
// The index holds every layer's scaling state, bitwise the pp 1 save's.
TEST(PipelineCheckpoint, DelayedScalingStateResumesBitwise) {
  const fs::path root = fresh_dir("delayed");
  expect_resumes_bitwise(
      {
          {delayed(options(2)), delayed(options(2))},
          {delayed(options(2, {}, PpSchedule::kOneFOneB)),
           delayed(options(2, {}, PpSchedule::kOneFOneB))},
          {delayed(options(2, {}, PpSchedule::kOneFOneB)), delayed(options(1))},
      },
      root);
  const fs::path one = train_and_save(delayed(options(1)), root / "pp1");
  const fs::path two = train_and_save(delayed(options(2)), root / "pp2");
  const CheckpointIndex a = read_checkpoint_index(one);
  const CheckpointIndex b = read_checkpoint_index(two);
  ASSERT_EQ(a.keys.size(), b.keys.size());
  int scaling = 0;
  for (const auto& [name, k] : b.keys) {
    if (!name.starts_with("fp8/")) continue;
    ++scaling;
    expect_same_global(one, a, two, b, name);
  }
  EXPECT_EQ(scaling, 96);  // 4 layers x 4 linears x 3 roles x (scale, amax_history)
  fs::remove_all(root);
}

// The pp 2 checkpoint holds every global key exactly once, each written by the ranks of the stage
// that holds it, and every key's global tensor is the pp 1 checkpoint's bit for bit.
TEST(PipelineCheckpoint, IndexHoldsEveryKeyOnceWrittenByItsStage) {
  const fs::path root = fresh_dir("index");
  const fs::path one = train_and_save(options(1), root / "pp1");
  const fs::path two = train_and_save(options(2), root / "pp2");
  const CheckpointIndex a = read_checkpoint_index(one);
  const CheckpointIndex b = read_checkpoint_index(two);
  EXPECT_EQ(b.mesh.size(mesh::MeshDim::kPp), 2);
  EXPECT_EQ(b.files.size(), 4U);
  EXPECT_EQ(b.scalars, a.scalars);
  std::set<std::string> ka, kb;
  for (const auto& [name, k] : a.keys) ka.insert(name);
  for (const auto& [name, k] : b.keys) kb.insert(name);
  ASSERT_EQ(ka, kb);
  // Stage 0 (layers 0-1, embeddings) writes rank_00000/1, stage 1 (layers 2-3, final norm, head)
  // rank_00002/3.
  const auto stage_of_file = [](const std::string& f) { return f < "rank_00002.h5" ? 0 : 1; };
  for (const auto& [name, k] : b.keys) {
    const bool last =
        name.find("lm_head") != std::string::npos || name.find("final_ln") != std::string::npos ||
        name.find("layers.2.") != std::string::npos || name.find("layers.3.") != std::string::npos;
    ASSERT_FALSE(k.chunks.empty()) << name;
    for (const ChunkRecord& c : k.chunks) EXPECT_EQ(stage_of_file(c.file), last ? 1 : 0) << name;
    expect_same_global(one, a, two, b, name);
  }
  EXPECT_TRUE(kb.count(keys::model("lm_head.weight")) && kb.count(keys::model("embed.tok")));
  EXPECT_TRUE(verify_checkpoint(two).ok());
  fs::remove_all(root);
}

// A checkpoint without the last stage's entries (its index rewritten without them, checksum
// recomputed) is refused on every mesh, naming a missing key, before any state changes; a chunk
// recorded in another stage's rank file is refused by the index reader.
TEST(PipelineCheckpoint, MissingStageEntriesAndForeignStageChunksAreRefused) {
  const fs::path root = fresh_dir("missing_stage");
  const fs::path dir = train_and_save(options(2), root / "pp2");
  CheckpointIndex index = read_checkpoint_index(dir);
  const std::string head = keys::model("lm_head.weight");
  ASSERT_TRUE(index.keys.count(head));
  // The chunk of a last-stage key moved to a first-stage file: no stage writes it there.
  CheckpointIndex foreign = index;
  foreign.keys.at(head).chunks.at(0).file = "rank_00000.h5";
  const std::string bad_file =
      error_of([&] { parse_checkpoint_index(index_json_text(foreign), "test index"); },
               kernels::ErrorKind::kInput);
  EXPECT_NE(bad_file.find("its writer in pipeline stage 0"), std::string::npos) << bad_file;
  // The index's mesh names pp only for several stages: "pp": 1 is not a form the saver writes.
  std::string one_stage = index_json_text(index);
  const size_t pp_at = one_stage.find("\"pp\"");
  ASSERT_NE(pp_at, std::string::npos);
  const size_t digit = one_stage.find('2', pp_at);
  ASSERT_NE(digit, std::string::npos);
  one_stage[digit] = '1';
  const std::string bad_pp = error_of([&] { parse_checkpoint_index(one_stage, "test index"); },
                                      kernels::ErrorKind::kInput);
  EXPECT_NE(bad_pp.find("mesh.pp"), std::string::npos) << bad_pp;

  for (auto it = index.keys.begin(); it != index.keys.end();) {
    const bool last_stage = it->second.chunks.at(0).file >= "rank_00002.h5";
    it = last_stage ? index.keys.erase(it) : std::next(it);
  }
  {
    std::ofstream out(dir / "index.json", std::ios::trunc);
    out << index_json_text(index);
  }
  for (int pp : {1, 2}) {
    const RunOptions o = options(pp);
    const std::string msg = error_of(
        [&] {
          run_on_ranks(o, [&](mesh::RankComms& comms) {
            TrainingSession s(o, comms);
            load_checkpoint(dir, s.state(), comms);
          });
        },
        kernels::ErrorKind::kInput);
    EXPECT_NE(msg.find("of the live state is missing from the checkpoint"), std::string::npos)
        << "pp " << pp << ": " << msg;
  }
  fs::remove_all(root);
}

// One-element states on a pp 2 mesh of one rank per stage, for the save's and the load's rules.
ShardedState tiny_state(const mesh::DeviceMesh& m, const std::vector<std::string>& keys,
                        float value) {
  ShardedState s;
  for (const std::string& k : keys) {
    mesh::Layout layout(m, kernels::Shape{2},
                        std::vector<mesh::Placement>(3, mesh::Placement::replicate()));
    s.entries.push_back({k, layout, Tensor::from_vector<float>(kernels::Shape{2}, {value, value})});
  }
  s.scalars[keys::kOptimStep] = 1;
  return s;
}

TEST(PipelineCheckpoint, KeysHeldByTwoStagesOrByNoneAreRefused) {
  const fs::path root = fresh_dir("stage_keys");
  const mesh::DeviceMesh pp2(1, 1, 1, 2);
  // Both stages hold model/a: the save refuses it and leaves nothing behind.
  {
    mesh::LocalWorld world(pp2);
    const std::string msg = error_of(
        [&] {
          world.run([&](mesh::RankComms& comms) {
            const ShardedState s = tiny_state(comms.mesh(), {"model/a"}, 1.0f);
            save_checkpoint(root / "twice", 1, s, comms);
          });
        },
        kernels::ErrorKind::kInput);
    EXPECT_NE(msg.find("key 'model/a' is held by pipeline stages 0 and 1"), std::string::npos)
        << msg;
    EXPECT_TRUE(list_checkpoints(root / "twice").empty());
    EXPECT_FALSE(fs::exists(root / "twice" / "step_0000001.partial"));
  }
  // Stage 0 holds model/a, stage 1 model/b: saved once each, loaded back by their stages.
  fs::path dir;
  {
    mesh::LocalWorld world(pp2);
    world.run([&](mesh::RankComms& comms) {
      const ShardedState s =
          tiny_state(comms.mesh(), {comms.rank() == 0 ? "model/a" : "model/b"}, 3.0f);
      const fs::path d = save_checkpoint(root / "split", 1, s, comms);
      if (comms.rank() == 0) dir = d;
    });
    const CheckpointIndex index = read_checkpoint_index(dir);
    ASSERT_EQ(index.keys.size(), 2U);
    EXPECT_EQ(index.keys.at("model/a").chunks.at(0).file, "rank_00000.h5");
    EXPECT_EQ(index.keys.at("model/b").chunks.at(0).file, "rank_00001.h5");
  }
  // A live state where no stage holds model/b, or both hold model/a: refused, nothing loaded.
  for (bool both : {false, true}) {
    mesh::LocalWorld world(pp2);
    std::vector<float> kept(2, 0.0f);
    const std::string msg = error_of(
        [&] {
          world.run([&](mesh::RankComms& comms) {
            std::vector<std::string> held = {"model/a"};
            if (both && comms.rank() == 1) held = {"model/a", "model/b"};
            if (!both && comms.rank() == 1) held = {};
            ShardedState s = tiny_state(comms.mesh(), held, 7.0f);
            try {
              load_checkpoint(dir, s, comms);
            } catch (...) {
              if (comms.rank() == 0) kept = s.entries.at(0).local.to_vector<float>();
              throw;
            }
          });
        },
        kernels::ErrorKind::kInput);
    EXPECT_NE(
        msg.find(both ? "key 'model/a' is held by 2 pipeline stages"
                      : "key 'model/b' has no tensor in the live state of any pipeline stage"),
        std::string::npos)
        << msg;
    EXPECT_EQ(kept, (std::vector<float>{7.0f, 7.0f})) << "a failed load changed the live state";
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace meshproof::engine
