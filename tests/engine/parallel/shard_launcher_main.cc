// Runs a few training steps of a tiny GPT on one mesh with the local (threads) or mpi launcher
// and writes the per-step losses and grad norms as exact hex floats (rank 0), so CTest can
// compare the two launchers byte for byte.
//   shard_launcher --launcher local|mpi --mesh dp_shard=2,tp=2 --out FILE [--recipe fp32|bf16|...]
//                  [--sp 0|1]   (sequence parallelism, needs tp > 1)
#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "engine/session/session.h"
#include "kernels/core/error.h"
#include "mesh/core/device_mesh.h"

int main(int argc, char** argv) {
  using namespace meshproof;
  std::string launcher = "local", mesh_spec = "dp_shard=2", out, recipe = "fp32", sp = "0";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--launcher")
      launcher = v;
    else if (k == "--mesh")
      mesh_spec = v;
    else if (k == "--out")
      out = v;
    else if (k == "--recipe")
      recipe = v;
    else if (k == "--sp")
      sp = v;
    else {
      std::fprintf(stderr, "unknown argument %s\n", k.c_str());
      return 2;
    }
  }
  try {
    const mesh::DeviceMesh m = mesh::DeviceMesh::parse(mesh_spec);
    engine::RunOptions o;
    o.config.model.vocab = 32;
    o.config.model.hidden = 16;
    o.config.model.heads = 4;
    o.config.model.layers = 1;
    o.config.model.ffn = 32;
    o.config.model.max_positions = 8;
    o.config.training.batch = 8;
    o.config.training.seq_len = 8;
    o.config.training.lr = 1e-2;
    o.config.training.micro_batches = 2;
    o.config.recipe.kind = engine::parse_recipe(recipe, "--recipe");
    o.mesh = {m.size(mesh::MeshDim::kDpReplicate), m.size(mesh::MeshDim::kDpShard),
              m.size(mesh::MeshDim::kTp), sp == "1"};
    o.launcher = launcher;
    o.steps = 3;
    const engine::RunResult r = engine::run_training(o);
    const bool lead = r.ranks.size() > 1 || (r.ranks.size() == 1 && r.ranks[0].rank == 0);
    if (lead && !out.empty()) {
      std::FILE* f = std::fopen(out.c_str(), "w");
      if (!f) return 3;
      for (const engine::StepMetrics& s : r.metrics)
        std::fprintf(f, "step %lld loss %a grad_norm %a\n", static_cast<long long>(s.step), s.loss,
                     s.grad_norm);
      for (const auto& [name, t] : r.final_params) {
        uint64_t h = 1469598103934665603ull;
        const auto* b = static_cast<const unsigned char*>(t.raw_data());
        for (int64_t i = 0; i < t.nbytes().value; ++i) h = (h ^ b[i]) * 1099511628211ull;
        std::fprintf(f, "%s %016llx\n", name.c_str(), static_cast<unsigned long long>(h));
      }
      std::fclose(f);
    }
  } catch (const kernels::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return e.kind() == kernels::ErrorKind::kInput ? 2 : 3;
  }
  return 0;
}
