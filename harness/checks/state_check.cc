// The state check (docs/design.md section 22): two checkpoints compared entry by entry and
// scalar by scalar, after a save -> load -> save round trip. Declared in harness/checks/checks.h.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/state_keys.h"
#include "harness/checks/checks.h"
#include "harness/checks/tensor_elements.h"
#include "kernels/core/error.h"

namespace meshproof::harness {

namespace {

// "[r, c]" of flat element `flat` in a row-major tensor of `shape`.
std::string global_index(const kernels::Shape& shape, int64_t flat) {
  std::vector<int64_t> idx(static_cast<size_t>(shape.rank()));
  for (int d = shape.rank() - 1; d >= 0; --d) {
    idx[static_cast<size_t>(d)] = flat % shape[d];
    flat /= shape[d];
  }
  return fmt::format("[{}]", fmt::join(idx, ", "));
}

// The state groups a checkpoint holds, for the pass message.
std::string state_groups(const engine::CheckpointIndex& index) {
  std::set<std::string> groups;
  for (const auto& [name, k] : index.keys) {
    if (name.starts_with(engine::keys::kFp8Params)) {
      groups.insert("fp8/params/");
    } else {
      groups.insert(name.substr(0, name.find('/') + 1));
    }
  }
  std::vector<std::string> out(groups.begin(), groups.end());
  std::vector<std::string> scalars;
  for (const auto& [name, v] : index.scalars) scalars.push_back(name);
  out.push_back(fmt::format("scalars {}", fmt::join(scalars, ",")));
  return fmt::format("{}", fmt::join(out, " "));
}

}  // namespace

reports::CheckResult compare_checkpoint_state(const std::filesystem::path& after,
                                              const std::filesystem::path& saved,
                                              const std::filesystem::path& before,
                                              const engine::TensorMap& params,
                                              const std::string& what) {
  reports::CheckResult r;
  r.name = "state";
  r.kind = "state";
  const engine::CheckpointIndex a = engine::read_checkpoint_index(after);
  const engine::CheckpointIndex b = engine::read_checkpoint_index(before);
  auto fail = [&](const std::string& key, const std::string& message, reports::Evidence ev) {
    r.verdict = reports::Verdict::kFail;
    r.message = fmt::format("{}: {}: {}", what, key, message);
    ev.tensor = key;
    ev.metric = "state";
    r.evidence = ev;
    return r;
  };
  // Issue #46: every key and scalar of the live state is in the checkpoint under test. A save
  // that left one out loads (the engine keeps its fresh value for it), so without this the
  // failure would read as a value difference of a key the checkpoint never held.
  if (saved != before) {
    const engine::CheckpointIndex c = engine::read_checkpoint_index(saved);
    for (const auto& [n, k] : b.keys) {
      if (c.keys.count(n) == 0) {
        return fail(n,
                    fmt::format("not in the checkpoint {} (the run's live state holds it, {} {}; "
                                "the load kept the fresh engine's value)",
                                saved.string(), kernels::dtype_name(k.dtype), k.shape.str()),
                    {});
      }
    }
    for (const auto& [n, v] : b.scalars) {
      if (c.scalars.count(n) == 0) {
        return fail(n,
                    fmt::format("scalar not in the checkpoint {} (the run's live state holds {})",
                                saved.string(), v),
                    {});
      }
    }
  }
  // Scalars: the optimizer step, data cursor, RNG offset and LR schedule position.
  std::set<std::string> scalars;
  for (const auto& [n, v] : a.scalars) scalars.insert(n);
  for (const auto& [n, v] : b.scalars) scalars.insert(n);
  for (const std::string& n : scalars) {
    const auto ia = a.scalars.find(n), ib = b.scalars.find(n);
    if (ia == a.scalars.end() || ib == b.scalars.end()) {
      return fail(n, ia == a.scalars.end() ? "scalar missing after the load" : "scalar not saved",
                  {});
    }
    if (ia->second != ib->second) {
      reports::Evidence ev;
      ev.actual = static_cast<double>(ia->second);
      ev.expected = static_cast<double>(ib->second);
      return fail(n, fmt::format("scalar {} after the load, {} when saved", ia->second, ib->second),
                  ev);
    }
  }
  // The saved masters against the run's own (its engine's gather of its real shards).
  for (const std::string& p : params.names()) {
    const std::string key = engine::keys::model(p);
    const auto ib = b.keys.find(key);
    if (ib == b.keys.end()) return fail(key, "not in the saved state", {});
    const kernels::Tensor saved = engine::read_global(before, b, ib->second);
    const std::vector<float> live = params.at(p).to_vector<float>();
    MP_CHECK(saved.dtype() == kernels::DType::kFloat32 &&
                 saved.numel().value == static_cast<int64_t>(live.size()),
             "state check: {} is {} {}, the run's parameter has {} elements", key,
             kernels::dtype_name(saved.dtype()), saved.shape().str(), live.size());
    const auto* ps = static_cast<const float*>(saved.raw_data());
    for (size_t i = 0; i < live.size(); ++i) {
      if (std::memcmp(&ps[i], &live[i], sizeof(float)) == 0) continue;
      int64_t differing = 0;
      for (size_t j = i; j < live.size(); ++j)
        differing += std::memcmp(&ps[j], &live[j], sizeof(float)) != 0;
      reports::Evidence ev;
      ev.actual = ps[i];
      ev.expected = live[i];
      ev.max_abs_err = std::fabs(static_cast<double>(ps[i]) - live[i]);
      return fail(key,
                  fmt::format("element {} is {:.9g} in the saved checkpoint, {:.9g} in the "
                              "run's gathered parameter ({} of {} elements differ: the "
                              "checkpoint's layout places the shards elsewhere)",
                              global_index(saved.shape(), static_cast<int64_t>(i)), ps[i], live[i],
                              differing, live.size()),
                  ev);
    }
  }
  std::set<std::string> names;
  for (const auto& [n, k] : a.keys) names.insert(n);
  for (const auto& [n, k] : b.keys) names.insert(n);
  int64_t elements = 0;
  for (const std::string& n : names) {
    const auto ia = a.keys.find(n), ib = b.keys.find(n);
    if (ia == a.keys.end() || ib == b.keys.end()) {
      return fail(n, ia == a.keys.end() ? "missing after the load" : "not in the saved state", {});
    }
    const engine::KeyRecord& ka = ia->second;
    const engine::KeyRecord& kb = ib->second;
    if (ka.dtype != kb.dtype || ka.shape != kb.shape) {
      return fail(
          n,
          fmt::format("{} {} after the load, {} {} when saved", kernels::dtype_name(ka.dtype),
                      ka.shape.str(), kernels::dtype_name(kb.dtype), kb.shape.str()),
          {});
    }
    const kernels::Tensor ta = engine::read_global(after, a, ka);
    const kernels::Tensor tb = engine::read_global(before, b, kb);
    const int64_t n_el = ta.numel().value;
    elements += n_el;
    const size_t width = static_cast<size_t>(kernels::dtype_bits(ka.dtype) / 8);
    const auto* pa = static_cast<const uint8_t*>(ta.raw_data());
    const auto* pb = static_cast<const uint8_t*>(tb.raw_data());
    if (std::memcmp(pa, pb, static_cast<size_t>(n_el) * width) == 0) continue;
    int64_t first = -1, differing = 0;
    for (int64_t i = 0; i < n_el; ++i) {
      if (std::memcmp(pa + i * width, pb + i * width, width) == 0) continue;
      if (first < 0) first = i;
      ++differing;
    }
    const Element x = element(ta, first), y = element(tb, first);
    const uint64_t ulp = distance(x.ordered, y.ordered);
    reports::Evidence ev;
    ev.actual = x.value;
    ev.expected = y.value;
    ev.max_abs_err = std::fabs(x.value - y.value);
    if (y.value != 0) ev.max_rel_err = std::fabs(x.value - y.value) / std::fabs(y.value);
    ev.ulp_distance = static_cast<int64_t>(
        std::min<uint64_t>(ulp, static_cast<uint64_t>(std::numeric_limits<int64_t>::max())));
    return fail(n,
                fmt::format("element {} is {:.9g} after the load, {:.9g} in the run's live state "
                            "({} {} apart; {} of {} {} elements differ)",
                            global_index(ka.shape, first), x.value, y.value, ulp,
                            kernels::is_floating(ka.dtype) ? "ULP" : "units", differing, n_el,
                            kernels::dtype_name(ka.dtype)),
                ev);
  }
  r.message = fmt::format(
      "{}: bitwise equal: {} keys ({} elements) and {} scalars; the checkpoint holds {}", what,
      names.size(), elements, scalars.size(), state_groups(b));
  return r;
}

}  // namespace meshproof::harness
