#include "harness/ckpt_verb.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <set>

#include "engine/checkpoint.h"
#include "harness/exit_codes.h"
#include "kernels/error.h"
#include "kernels/formats.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using kernels::DType;

std::string placements_str(const std::vector<mesh::Placement>& ps) {
  std::string s = "(";
  for (size_t i = 0; i < ps.size(); ++i) s += (i ? ", " : "") + ps[i].str();
  return s + ")";
}

// Element i of a host tensor as a double and as an integer whose distance is the ULP distance
// (sign-magnitude floats mapped onto a monotone integer line; integers as themselves).
struct Element {
  double value;
  int64_t ordered;
};

int64_t sign_magnitude_order(uint64_t bits, int width) {
  const uint64_t sign = uint64_t{1} << (width - 1);
  const auto mag = static_cast<int64_t>(bits & (sign - 1));
  return (bits & sign) ? -mag : mag;
}

Element element(const kernels::Tensor& t, int64_t i) {
  namespace f8 = kernels::fmt8;
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  switch (t.dtype()) {
    case DType::kFloat32: {
      uint32_t b;
      std::memcpy(&b, p + 4 * i, 4);
      return {f8::bits_float(b), sign_magnitude_order(b, 32)};
    }
    case DType::kFloat64: {
      uint64_t b;
      double v;
      std::memcpy(&b, p + 8 * i, 8);
      std::memcpy(&v, &b, 8);
      return {v, sign_magnitude_order(b, 64)};
    }
    case DType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return {f8::bf16_to_float(b), sign_magnitude_order(b, 16)};
    }
    case DType::kFloat16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return {f8::fp16_to_float(b), sign_magnitude_order(b, 16)};
    }
    case DType::kE4M3:
      return {f8::e4m3_to_float(p[i]), sign_magnitude_order(p[i], 8)};
    case DType::kE5M2:
      return {f8::e5m2_to_float(p[i]), sign_magnitude_order(p[i], 8)};
    case DType::kE8M0:
      return {f8::e8m0_to_float(p[i]), p[i]};
    case DType::kUInt8:
      return {static_cast<double>(p[i]), p[i]};
    case DType::kInt32: {
      int32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      return {static_cast<double>(v), v};
    }
    case DType::kInt64: {
      int64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      return {static_cast<double>(v), v};
    }
    case DType::kE2M1:
      break;
  }
  MP_FAIL_INPUT("ckpt diff: dtype {} is not supported", kernels::dtype_name(t.dtype()));
}

struct DiffStats {
  int64_t differing = 0;  // elements whose bytes differ
  double max_abs = 0;
  double max_rel = 0;
  uint64_t max_ulp = 0;  // unsigned: two int64 values can be more than INT64_MAX apart
};

DiffStats diff_tensors(const kernels::Tensor& a, const kernels::Tensor& b) {
  DiffStats s;
  const int64_t n = a.numel().value;
  const int64_t width = kernels::dtype_bits(a.dtype()) / 8;
  const auto* pa = static_cast<const uint8_t*>(a.raw_data());
  const auto* pb = static_cast<const uint8_t*>(b.raw_data());
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(pa + i * width, pb + i * width, static_cast<size_t>(width)) == 0) continue;
    ++s.differing;
    const Element x = element(a, i);
    const Element y = element(b, i);
    double abs = std::fabs(x.value - y.value);
    double rel = abs / std::max(std::fabs(x.value), std::fabs(y.value));
    if (std::isnan(x.value) || std::isnan(y.value)) {
      abs = rel = std::numeric_limits<double>::infinity();
    }
    if (std::isnan(rel)) rel = 0;  // +0 vs -0
    s.max_abs = std::max(s.max_abs, abs);
    s.max_rel = std::max(s.max_rel, rel);
    // In uint64_t: the difference of two ordered 64-bit values overflows int64_t (found by
    // UBSan in `make test-sanitize` on the int64 RNG state).
    const uint64_t ulp = x.ordered > y.ordered
                             ? static_cast<uint64_t>(x.ordered) - static_cast<uint64_t>(y.ordered)
                             : static_cast<uint64_t>(y.ordered) - static_cast<uint64_t>(x.ordered);
    s.max_ulp = std::max(s.max_ulp, ulp);
  }
  return s;
}

}  // namespace

int ckpt_inspect(const std::string& dir, std::ostream& out) {
  const engine::CheckpointIndex index = engine::read_checkpoint_index(dir, false);
  fmt::print(out, "checkpoint {}\n", dir);
  fmt::print(out, "  step {}  mesh {} ({} ranks)\n", index.step, index.mesh.str(),
             index.mesh.world_size());
  fmt::print(out, "  meshproof {} (commit {})  scenario hash {}\n", index.meshproof_version,
             index.git_commit, index.scenario_hash.empty() ? "-" : index.scenario_hash);
  fmt::print(out, "  files ({}):\n", index.files.size());
  for (size_t i = 0; i < index.files.size(); ++i) {
    fmt::print(out, "    {}  {} bytes\n", index.files[i], index.file_bytes[i]);
  }
  fmt::print(out, "  scalars ({}):\n", index.scalars.size());
  for (const auto& [name, v] : index.scalars) fmt::print(out, "    {} = {}\n", name, v);
  fmt::print(out, "  keys ({}):\n", index.keys.size());
  for (const auto& [name, k] : index.keys) {
    fmt::print(out, "    {}  {} {}  {}  {} chunk(s)\n", name, kernels::dtype_name(k.dtype),
               k.shape.str(), placements_str(k.placements), k.chunks.size());
    for (const auto& c : k.chunks) {
      fmt::print(out, "      {}:{}  {}  xxh64 {:016x}\n", c.file, c.dataset, c.box.str(), c.xxh64);
    }
  }
  return kExitOk;
}

int ckpt_verify(const std::string& dir, std::ostream& out) {
  const engine::CheckpointIndex index = engine::read_checkpoint_index(dir, false);
  int64_t chunks = 0;
  int64_t failures = 0;
  std::set<std::string> bad_files;
  for (size_t i = 0; i < index.files.size(); ++i) {
    const fs::path p = fs::path(dir) / index.files[i];
    if (!fs::exists(p)) {
      fmt::print(out, "FAIL {}: rank file missing\n", p.string());
      bad_files.insert(index.files[i]);
      ++failures;
    } else if (static_cast<int64_t>(fs::file_size(p)) != index.file_bytes[i]) {
      fmt::print(out, "FAIL {}: {} bytes, the index records {} (truncated or overwritten)\n",
                 p.string(), fs::file_size(p), index.file_bytes[i]);
      bad_files.insert(index.files[i]);
      ++failures;
    }
  }
  for (const auto& [name, k] : index.keys) {
    for (const auto& c : k.chunks) {
      ++chunks;
      if (bad_files.count(c.file)) {
        fmt::print(out, "FAIL {}: chunk {} {} in bad file {}\n", name, c.dataset, c.box.str(),
                   c.file);
        ++failures;
        continue;
      }
      try {
        engine::read_chunk(dir, k, c, /*verify=*/true);
      } catch (const kernels::Error& e) {
        if (e.kind() != kernels::ErrorKind::kInput) throw;
        fmt::print(out, "FAIL {}: {}\n", name, e.message());
        ++failures;
      }
    }
  }
  if (failures > 0) {
    fmt::print(out, "checkpoint {}: {} problem(s) in {} chunk(s) of {} key(s)\n", dir, failures,
               chunks, index.keys.size());
    return kExitCheckFailed;
  }
  fmt::print(out, "checkpoint {}: OK, {} chunk(s) of {} key(s) match their checksums\n", dir,
             chunks, index.keys.size());
  return kExitOk;
}

int ckpt_diff(const std::string& a_dir, const std::string& b_dir, std::ostream& out) {
  const engine::CheckpointIndex a = engine::read_checkpoint_index(a_dir);
  const engine::CheckpointIndex b = engine::read_checkpoint_index(b_dir);
  int differing = 0;
  fmt::print(out, "A {} (step {}, mesh {})\nB {} (step {}, mesh {})\n", a_dir, a.step, a.mesh.str(),
             b_dir, b.step, b.mesh.str());
  std::set<std::string> scalar_names;
  for (const auto& [n, v] : a.scalars) scalar_names.insert(n);
  for (const auto& [n, v] : b.scalars) scalar_names.insert(n);
  for (const std::string& n : scalar_names) {
    auto ia = a.scalars.find(n);
    auto ib = b.scalars.find(n);
    if (ia == a.scalars.end() || ib == b.scalars.end()) {
      fmt::print(out, "scalar {}: only in {}\n", n, ia == a.scalars.end() ? "B" : "A");
      ++differing;
    } else if (ia->second != ib->second) {
      fmt::print(out, "scalar {}: {} vs {}\n", n, ia->second, ib->second);
      ++differing;
    } else {
      fmt::print(out, "scalar {}: equal ({})\n", n, ia->second);
    }
  }
  std::set<std::string> names;
  for (const auto& [n, k] : a.keys) names.insert(n);
  for (const auto& [n, k] : b.keys) names.insert(n);
  for (const std::string& n : names) {
    auto ia = a.keys.find(n);
    auto ib = b.keys.find(n);
    if (ia == a.keys.end() || ib == b.keys.end()) {
      fmt::print(out, "{}: only in {}\n", n, ia == a.keys.end() ? "B" : "A");
      ++differing;
      continue;
    }
    const engine::KeyRecord& ka = ia->second;
    const engine::KeyRecord& kb = ib->second;
    if (ka.shape != kb.shape || ka.dtype != kb.dtype) {
      fmt::print(out, "{}: {} {} vs {} {}\n", n, kernels::dtype_name(ka.dtype), ka.shape.str(),
                 kernels::dtype_name(kb.dtype), kb.shape.str());
      ++differing;
      continue;
    }
    const kernels::Tensor ta = engine::read_global(a_dir, ka);
    const kernels::Tensor tb = engine::read_global(b_dir, kb);
    const DiffStats s = diff_tensors(ta, tb);
    if (s.differing == 0) {
      fmt::print(out, "{}: equal\n", n);
    } else {
      fmt::print(out, "{}: {} of {} elements differ, max abs {:.6g}, max rel {:.6g}, max ULP {}\n",
                 n, s.differing, ta.numel().value, s.max_abs, s.max_rel, s.max_ulp);
      ++differing;
    }
  }
  if (differing > 0) {
    fmt::print(out, "{} difference(s)\n", differing);
    return kExitCheckFailed;
  }
  fmt::print(out, "checkpoints are equal ({} keys, {} scalars)\n", names.size(),
             scalar_names.size());
  return kExitOk;
}

void add_ckpt_command(CLI::App& app, std::ostream& out, int& exit_code) {
  auto* ckpt = app.add_subcommand("ckpt", "Inspect, verify and diff sharded checkpoints");
  ckpt->require_subcommand(1);
  auto dir = std::make_shared<std::string>();
  auto* inspect = ckpt->add_subcommand(
      "inspect", "Show a checkpoint's mesh, step, scalars and keys with their chunks");
  inspect->add_option("DIR", *dir, "Checkpoint directory (step_NNNNNNN)")->required();
  inspect->callback([&out, &exit_code, dir] { exit_code = ckpt_inspect(*dir, out); });
  auto* verify = ckpt->add_subcommand("verify", "Re-hash every chunk; exit 1 naming each mismatch");
  verify->add_option("DIR", *dir, "Checkpoint directory (step_NNNNNNN)")->required();
  verify->callback([&out, &exit_code, dir] { exit_code = ckpt_verify(*dir, out); });
  auto a = std::make_shared<std::string>();
  auto b = std::make_shared<std::string>();
  auto* diff = ckpt->add_subcommand(
      "diff",
      "Compare two checkpoints key by key after reassembly (max abs/rel/ULP); exit 1 if any "
      "differ");
  diff->add_option("A", *a, "First checkpoint directory")->required();
  diff->add_option("B", *b, "Second checkpoint directory")->required();
  diff->callback([&out, &exit_code, a, b] { exit_code = ckpt_diff(*a, *b, out); });
}

}  // namespace meshproof::harness
