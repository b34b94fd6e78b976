#include "harness/verbs/ckpt_verb.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>
#include <fnmatch.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <set>

#include "engine/checkpoint/checkpoint.h"
#include "engine/dcp/dcp_checkpoint.h"
#include "harness/checks/tensor_elements.h"
#include "harness/verbs/exit_codes.h"
#include "kernels/core/error.h"
#include "kernels/core/formats.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using kernels::DType;

std::string placements_str(const std::vector<mesh::Placement>& ps) {
  std::string s = "(";
  for (size_t i = 0; i < ps.size(); ++i) s += (i ? ", " : "") + ps[i].str();
  return s + ")";
}

struct DiffStats {
  int64_t differing = 0;  // elements whose bytes differ
  int64_t outside = 0;    // of those, elements outside the tolerance
  double max_abs = 0;
  double max_rel = 0;
  uint64_t max_ulp = 0;  // unsigned: the distance between two int64s or float64s reaches 2^64-2
};

// Element-wise comparison. Floating dtypes: an element is within tolerance when its bytes are
// equal, or both values are finite and |a - b| <= atol + rtol * |b| (numpy.isclose with B as the
// reference); NaN or infinity must match bitwise. Integer dtypes must be equal.
DiffStats diff_tensors(const kernels::Tensor& a, const kernels::Tensor& b, double rtol,
                       double atol) {
  DiffStats s;
  const int64_t n = a.numel().value;
  const int64_t width = kernels::dtype_bits(a.dtype()) / 8;
  const bool floating = kernels::is_floating(a.dtype());
  const auto* pa = static_cast<const uint8_t*>(a.raw_data());
  const auto* pb = static_cast<const uint8_t*>(b.raw_data());
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(pa + i * width, pb + i * width, static_cast<size_t>(width)) == 0) continue;
    ++s.differing;
    const Element x = element(a, i);
    const Element y = element(b, i);
    double abs = std::fabs(x.value - y.value);
    double rel = abs / std::max(std::fabs(x.value), std::fabs(y.value));
    const bool finite = std::isfinite(x.value) && std::isfinite(y.value);
    if (std::isnan(x.value) || std::isnan(y.value)) {
      abs = rel = std::numeric_limits<double>::infinity();
    }
    if (std::isnan(rel)) rel = 0;  // +0 vs -0
    const bool within = floating && finite && abs <= atol + rtol * std::fabs(y.value);
    if (!within) ++s.outside;
    s.max_abs = std::max(s.max_abs, abs);
    s.max_rel = std::max(s.max_rel, rel);
    s.max_ulp = std::max(s.max_ulp, distance(x.ordered, y.ordered));
  }
  return s;
}

// The group of a key in `inspect --summary`: its first path component ("model", "optim", ...).
std::string key_group(const std::string& key) { return key.substr(0, key.find('/')); }

}  // namespace

bool matches_any(const std::vector<std::string>& globs, const std::string& name) {
  if (globs.empty()) return true;
  return std::any_of(globs.begin(), globs.end(), [&](const std::string& g) {
    return ::fnmatch(g.c_str(), name.c_str(), 0) == 0;
  });
}

int ckpt_inspect(const std::string& dir, std::ostream& out, const InspectOptions& options) {
  if (engine::is_dcp_checkpoint(dir)) return dcp_inspect(dir, out, options);
  const engine::CheckpointIndex index =
      engine::read_checkpoint_index(dir, {.checksum = false, .file_sizes = false});
  const uint64_t h = engine::compute_index_xxh64(index);
  const bool checksum_ok = h == index.index_xxh64;
  fmt::print(out, "checkpoint {}\n", dir);
  fmt::print(out, "  step {}  mesh {} ({} ranks)  format {}  id {:016x}\n", index.step,
             index.mesh.str(), index.mesh.world_size(), index.format_version, index.checkpoint_id);
  fmt::print(out, "  meshproof {} (commit {})  scenario hash {}\n", index.meshproof_version,
             index.git_commit, index.scenario_hash.empty() ? "-" : index.scenario_hash);
  if (checksum_ok) {
    fmt::print(out, "  index checksum OK ({:016x})\n", h);
  } else {
    fmt::print(out,
               "  index checksum MISMATCH: content {:016x}, recorded {:016x} (edited or damaged "
               "after the save)\n",
               h, index.index_xxh64);
  }
  std::vector<const engine::KeyRecord*> keys;
  for (const auto& [name, k] : index.keys) {
    if (matches_any(options.key_globs, name)) keys.push_back(&k);
  }
  MP_CHECK_INPUT(!keys.empty() || options.key_globs.empty(),
                 "ckpt inspect {}: no key matches --key {}", dir,
                 fmt::join(options.key_globs, " --key "));
  if (options.summary) {
    struct Group {
      int64_t keys = 0, chunks = 0, elements = 0, bytes = 0;
      std::set<std::string> dtypes;
    };
    std::map<std::string, Group> groups;
    for (const engine::KeyRecord* k : keys) {
      Group& g = groups[key_group(k->key)];
      ++g.keys;
      g.chunks += static_cast<int64_t>(k->chunks.size());
      g.elements += k->shape.numel().value;
      g.bytes += k->shape.numel().value * kernels::dtype_bits(k->dtype) / 8;
      g.dtypes.insert(std::string(kernels::dtype_name(k->dtype)));
    }
    fmt::print(out, "  key groups ({} keys):\n", keys.size());
    for (const auto& [name, g] : groups) {
      fmt::print(out, "    {}/  {} keys  {} chunks  {} elements  {} bytes  {}\n", name, g.keys,
                 g.chunks, g.elements, g.bytes, fmt::join(g.dtypes, ","));
    }
    return checksum_ok ? kExitOk : kExitCheckFailed;
  }
  fmt::print(out, "  files ({}):\n", index.files.size());
  for (size_t i = 0; i < index.files.size(); ++i) {
    fmt::print(out, "    {}  {} bytes\n", index.files[i], index.file_bytes[i]);
  }
  fmt::print(out, "  scalars ({}):\n", index.scalars.size());
  for (const auto& [name, v] : index.scalars) {
    if (matches_any(options.key_globs, name)) fmt::print(out, "    {} = {}\n", name, v);
  }
  fmt::print(out, "  keys ({}):\n", keys.size());
  for (const engine::KeyRecord* k : keys) {
    fmt::print(out, "    {}  {} {}  {}  {} chunk(s)\n", k->key, kernels::dtype_name(k->dtype),
               k->shape.str(), placements_str(k->placements), k->chunks.size());
    for (const auto& c : k->chunks) {
      fmt::print(out, "      {}:{}  {}  xxh64 {:016x}\n", c.file, c.dataset, c.box.str(), c.xxh64);
    }
  }
  return checksum_ok ? kExitOk : kExitCheckFailed;
}

int print_verify_report(const engine::VerifyReport& report, const std::string& dir,
                        std::ostream& out, std::string_view what, std::string_view how) {
  for (const engine::VerifyFinding& f : report.findings) {
    fmt::print(out, "FAIL {} ({}): {}\n", f.key.empty() ? f.file : f.key, f.file, f.message);
  }
  if (!report.ok()) {
    fmt::print(out, "checkpoint {}: {} problem(s) in {} chunk(s) of {} key(s)\n", dir,
               report.findings.size(), report.chunks, report.keys);
    return kExitCheckFailed;
  }
  fmt::print(out, "checkpoint {}: OK, {} and {} chunk(s) of {} key(s) match ({})\n", dir, what,
             report.chunks, report.keys, how);
  return kExitOk;
}

int ckpt_verify(const std::string& dir, std::ostream& out) {
  if (engine::is_dcp_checkpoint(dir)) return dcp_verify(dir, out);
  return print_verify_report(engine::verify_checkpoint(dir), dir, out, "the index checksum",
                             "hashes, attributes, file sizes");
}

int ckpt_diff(const std::string& a_dir, const std::string& b_dir, std::ostream& out,
              const DiffOptions& options) {
  MP_CHECK_INPUT(std::isfinite(options.rtol) && options.rtol >= 0,
                 "ckpt diff: --rtol {} must be a finite number >= 0", options.rtol);
  MP_CHECK_INPUT(std::isfinite(options.atol) && options.atol >= 0,
                 "ckpt diff: --atol {} must be a finite number >= 0", options.atol);
  const CheckpointView a = open_checkpoint_view(a_dir);
  const CheckpointView b = open_checkpoint_view(b_dir);
  const bool tolerant = options.rtol > 0 || options.atol > 0;
  int differing = 0;
  int within = 0;
  fmt::print(out, "A {} ({})\nB {} ({})\n", a_dir, a.title, b_dir, b.title);
  std::set<std::string> scalar_names;
  for (const auto& [n, v] : a.scalars) scalar_names.insert(n);
  for (const auto& [n, v] : b.scalars) scalar_names.insert(n);
  std::erase_if(scalar_names,
                [&](const std::string& n) { return !matches_any(options.key_globs, n); });
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
  std::erase_if(names, [&](const std::string& n) { return !matches_any(options.key_globs, n); });
  MP_CHECK_INPUT(!names.empty() || !scalar_names.empty() || options.key_globs.empty(),
                 "ckpt diff: no key or scalar matches --key {}",
                 fmt::join(options.key_globs, " --key "));
  for (const std::string& n : names) {
    auto ia = a.keys.find(n);
    auto ib = b.keys.find(n);
    if (ia == a.keys.end() || ib == b.keys.end()) {
      fmt::print(out, "{}: only in {}\n", n, ia == a.keys.end() ? "B" : "A");
      ++differing;
      continue;
    }
    const CheckpointView::Key& ka = ia->second;
    const CheckpointView::Key& kb = ib->second;
    if (ka.shape != kb.shape || ka.dtype != kb.dtype) {
      fmt::print(out, "{}: {} {} vs {} {}\n", n, ka.dtype, ka.shape.str(), kb.dtype,
                 kb.shape.str());
      ++differing;
      continue;
    }
    // A chunk that fails its integrity checks is named and the key counted as differing; the
    // other keys are still compared.
    kernels::Tensor ta, tb;
    try {
      if (ka.bytes) {
        const bool same = ka.bytes() == kb.bytes();
        fmt::print(out, "{}: {}\n", n, same ? "equal (bytes)" : "bytes differ");
        if (!same) ++differing;
        continue;
      }
      ta = ka.read();
      tb = kb.read();
    } catch (const kernels::Error& e) {
      if (e.kind() != kernels::ErrorKind::kIntegrity) throw;
      fmt::print(out, "{}: cannot compare: {}\n", n, e.message());
      ++differing;
      continue;
    }
    const DiffStats s = diff_tensors(ta, tb, options.rtol, options.atol);
    if (s.differing == 0) {
      fmt::print(out, "{}: equal\n", n);
      continue;
    }
    const std::string stats =
        fmt::format("{} of {} elements differ, max abs {:.6g}, max rel {:.6g}, max ULP {}",
                    s.differing, ta.numel().value, s.max_abs, s.max_rel, s.max_ulp);
    if (tolerant && s.outside == 0) {
      fmt::print(out, "{}: within tolerance: {}\n", n, stats);
      ++within;
    } else if (tolerant) {
      fmt::print(out, "{}: {}; {} outside rtol {:g}, atol {:g}\n", n, stats, s.outside,
                 options.rtol, options.atol);
      ++differing;
    } else {
      fmt::print(out, "{}: {}\n", n, stats);
      ++differing;
    }
  }
  if (differing > 0) {
    fmt::print(out, "{} difference(s)\n", differing);
    return kExitCheckFailed;
  }
  if (within > 0) {
    fmt::print(out,
               "checkpoints match within rtol {:g}, atol {:g} ({} keys, {} scalars; {} key(s) "
               "not bitwise equal)\n",
               options.rtol, options.atol, names.size(), scalar_names.size(), within);
    return kExitOk;
  }
  fmt::print(out, "checkpoints are equal ({} keys, {} scalars)\n", names.size(),
             scalar_names.size());
  return kExitOk;
}

void add_ckpt_command(CLI::App& app, std::ostream& out, int& exit_code) {
  auto* ckpt = app.add_subcommand("ckpt", "Inspect, verify and diff sharded checkpoints");
  ckpt->require_subcommand(1);
  auto dir = std::make_shared<std::string>();
  auto inspect_opts = std::make_shared<InspectOptions>();
  auto* inspect = ckpt->add_subcommand(
      "inspect", "Show a checkpoint's mesh, step, scalars and keys with their chunks");
  inspect
      ->add_option("DIR", *dir,
                   "Checkpoint directory (step_NNNNNNN, or a PyTorch DCP folder holding .metadata)")
      ->required();
  inspect->add_flag("--summary", inspect_opts->summary,
                    "One line per key group (first path component): keys, chunks, elements, "
                    "bytes, dtypes");
  // One glob per --key (repeat the flag), so that positionals after it stay positionals.
  inspect
      ->add_option("--key", inspect_opts->key_globs,
                   "Only keys (and scalars) matching this glob (fnmatch; repeatable)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  inspect->callback([&out, &exit_code, dir, inspect_opts] {
    exit_code = ckpt_inspect(*dir, out, *inspect_opts);
  });
  auto* verify = ckpt->add_subcommand(
      "verify",
      "Check the index checksum, rank files and every chunk (hash, attributes); exit 1 naming "
      "each problem");
  verify
      ->add_option("DIR", *dir,
                   "Checkpoint directory (step_NNNNNNN, or a PyTorch DCP folder holding .metadata)")
      ->required();
  verify->callback([&out, &exit_code, dir] { exit_code = ckpt_verify(*dir, out); });
  auto a = std::make_shared<std::string>();
  auto b = std::make_shared<std::string>();
  auto diff_opts = std::make_shared<DiffOptions>();
  auto* diff = ckpt->add_subcommand(
      "diff",
      "Compare two checkpoints key by key after reassembly (max abs/rel/ULP); exit 1 if any "
      "differ (beyond --rtol/--atol)");
  diff->add_option("A", *a, "First checkpoint directory (meshproof or PyTorch DCP)")->required();
  diff->add_option(
          "B", *b,
          "Second checkpoint directory (meshproof or PyTorch DCP; the reference of --rtol)")
      ->required();
  diff->add_option("--rtol", diff_opts->rtol,
                   "Relative tolerance for floating-point keys: |a-b| <= atol + rtol*|b| passes");
  diff->add_option("--atol", diff_opts->atol, "Absolute tolerance for floating-point keys");
  diff->add_option("--key", diff_opts->key_globs,
                   "Only keys (and scalars) matching this glob (fnmatch; repeatable)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  diff->callback(
      [&out, &exit_code, a, b, diff_opts] { exit_code = ckpt_diff(*a, *b, out, *diff_opts); });
}

}  // namespace meshproof::harness
