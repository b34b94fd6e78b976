// The recipe bench's problem descriptions (docs/design.md section 26): the --shapes, --m-sweep and
// explicit --model parsers with their input rules, the engine model a BenchModel stands for, and
// each GEMM role's dimensions. Kept apart from the measurements (engine/bench/bench_*.cc) so that
// the rules read in one place and the measuring file stays about timing.
#include <fmt/format.h>

#include <cctype>
#include <charconv>

#include "engine/bench/bench_recipes.h"
#include "kernels/core/error.h"

namespace meshproof::engine {

using kernels::GemmRole;

namespace {

// Splits "a<sep>b<sep>c" into positive integers; input error naming `what` and the item.
std::vector<int64_t> parse_ints(std::string_view spec, char sep, std::string_view what) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (true) {
    const size_t end = spec.find(sep, pos);
    const std::string_view item =
        spec.substr(pos, end == std::string_view::npos ? std::string_view::npos : end - pos);
    int64_t v = 0;
    const auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    MP_CHECK_INPUT(!item.empty() && ec == std::errc() && p == item.data() + item.size() && v > 0,
                   "{} '{}': '{}' is not a positive integer", what, spec, item);
    out.push_back(v);
    if (end == std::string_view::npos) break;
    pos = end + 1;
  }
  return out;
}

}  // namespace

std::string GemmShape::str() const { return fmt::format("{}x{}x{}", m, n, k); }

std::vector<GemmShape> parse_gemm_shapes(std::string_view spec) {
  MP_CHECK_INPUT(!spec.empty(), "--shapes is empty (expected e.g. 256x256x256,1024x4096x1024)");
  std::vector<GemmShape> out;
  size_t pos = 0;
  while (true) {
    const size_t end = spec.find(',', pos);
    const std::string_view item =
        spec.substr(pos, end == std::string_view::npos ? std::string_view::npos : end - pos);
    const std::vector<int64_t> d = parse_ints(item, 'x', "--shapes item");
    MP_CHECK_INPUT(d.size() == 3, "--shapes '{}': '{}' is not MxNxK", spec, item);
    for (int64_t v : d) {
      MP_CHECK_INPUT(
          v % 32 == 0,
          "--shapes '{}': {} in '{}' is not a multiple of 32 (MXFP8 quantizes 32-element "
          "blocks along M, N and K)",
          spec, v, item);
    }
    out.push_back({d[0], d[1], d[2]});
    if (end == std::string_view::npos) break;
    pos = end + 1;
  }
  return out;
}

std::vector<int64_t> parse_m_sweep(std::string_view spec) {
  const std::vector<int64_t> ms = parse_ints(spec, ',', "--m-sweep");
  for (int64_t m : ms) {
    MP_CHECK_INPUT(m % 16 == 0,
                   "--m-sweep '{}': {} is not a multiple of 16 (per-tensor FP8 GEMMs need M % 16 "
                   "== 0)",
                   spec, m);
  }
  return ms;
}

ModelConfig BenchModel::model_config(int64_t layers) const {
  ModelConfig m;
  m.hidden = hidden;
  m.ffn = ffn;
  m.heads = heads;
  m.kv_heads = kv_heads;
  m.layers = layers;
  m.max_positions = seq;
  m.activation = activation;
  m.norm = norm;
  m.position = position;
  m.rope_theta = rope_theta;
  m.bias = bias;
  return m;
}

void check_bench_model(const BenchModel& b, std::string_view what) {
  MP_CHECK_INPUT(
      b.hidden > 0 && b.ffn > 0 && b.heads > 0 && b.kv_heads > 0 && b.seq > 0 && b.micro_batch > 0,
      "--model '{}': every dimension must be positive", what);
  MP_CHECK_INPUT(b.hidden % b.heads == 0, "--model '{}': heads {} does not divide hidden {}", what,
                 b.heads, b.hidden);
  MP_CHECK_INPUT(b.heads % b.kv_heads == 0,
                 "--model '{}': kv_heads {} does not divide heads {} (grouped-query attention)",
                 what, b.kv_heads, b.heads);
  MP_CHECK_INPUT(b.hidden % 32 == 0 && b.ffn % 32 == 0 && b.tokens() % 32 == 0,
                 "--model '{}': hidden ({}), ffn ({}) and micro_batch*seq ({}) must be multiples "
                 "of 32 (MXFP8 blocks)",
                 what, b.hidden, b.ffn, b.tokens());
}

BenchModel parse_bench_model(std::string_view spec, Activation activation) {
  MP_CHECK_INPUT(!spec.empty(),
                 "--model is empty (a preset or hidden,ffn,heads,kv_heads,seq,"
                 "micro_batch)");
  MP_CHECK_INPUT(std::isdigit(static_cast<unsigned char>(spec.front())),
                 "--model '{}': expected hidden,ffn,heads,kv_heads,seq,micro_batch (model "
                 "presets are resolved by the bench verb)",
                 spec);
  const std::vector<int64_t> d = parse_ints(spec, ',', "--model");
  MP_CHECK_INPUT(d.size() == 6,
                 "--model '{}': expected hidden,ffn,heads,kv_heads,seq,micro_batch (6 integers)",
                 spec);
  BenchModel b{d[0], d[1], d[2], d[3], d[4], d[5], activation};
  check_bench_model(b, spec);
  return b;
}

GemmShape gemm_dims(const LinearGemm& g) {
  const GemmShape& s = g.shape;
  switch (g.role) {
    case GemmRole::kFprop:
      return {s.m, s.n, s.k};
    case GemmRole::kDgrad:
      return {s.m, s.k, s.n};
    case GemmRole::kWgrad:
      return {s.n, s.k, s.m};
  }
  return s;
}

}  // namespace meshproof::engine
