// The checks over collectives (docs/design.md sections 7 and 29): the collectives each rank ran
// against the sharding plan's budget, and the FP8 all-gathered weights against quantizing the
// gathered weight (allgather_parity). Declared in harness/checks/checks.h.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "harness/checks/checks.h"

namespace meshproof::harness {

namespace {

// The identity of a collective call apart from its payload: (step, group, kind, op, tensor).
using CallKey = std::tuple<int64_t, std::string, int, int, std::string>;
CallKey call_key(const mesh::CollectiveCall& c) {
  return {c.step, c.group, static_cast<int>(c.kind), static_cast<int>(c.op), c.tensor};
}
// Its payload, (dtype, bytes), sorted per key.
using Payloads = std::vector<std::pair<int, int64_t>>;

std::map<CallKey, Payloads> by_key(const std::vector<mesh::CollectiveCall>& calls) {
  std::map<CallKey, Payloads> m;
  for (const mesh::CollectiveCall& c : calls)
    m[call_key(c)].emplace_back(static_cast<int>(c.dtype), c.bytes);
  for (auto& [k, v] : m) std::sort(v.begin(), v.end());
  return m;
}

std::string payload_text(const Payloads& p) {
  if (p.empty()) return "none";
  std::vector<std::string> parts;
  for (const auto& [dtype, bytes] : p)
    parts.push_back(
        fmt::format("{} {} B", kernels::dtype_name(static_cast<kernels::DType>(dtype)), bytes));
  return fmt::format("{} ({})", p.size(), fmt::join(parts, ", "));
}

}  // namespace

reports::CheckResult check_collectives(const std::vector<RankCollectives>& ranks) {
  reports::CheckResult r;
  r.name = "collectives";
  r.kind = "collectives";
  int64_t expected = 0, differing = 0;
  std::set<int64_t> steps;
  std::string first;
  reports::Evidence ev;
  for (const RankCollectives& rc : ranks) {
    expected += static_cast<int64_t>(rc.expected.size());
    const std::map<CallKey, Payloads> want = by_key(rc.expected), got = by_key(rc.ran);
    std::set<CallKey> keys;
    for (const auto& [k, v] : want) keys.insert(k);
    for (const auto& [k, v] : got) keys.insert(k);
    for (const CallKey& k : keys) {
      steps.insert(std::get<0>(k));
      const auto w = want.find(k);
      const auto g = got.find(k);
      const Payloads none;
      const Payloads& pw = w == want.end() ? none : w->second;
      const Payloads& pg = g == got.end() ? none : g->second;
      if (pw == pg) continue;
      differing += std::max(pw.size(), pg.size());
      if (!first.empty()) continue;
      const auto kind = static_cast<mesh::CollectiveKind>(std::get<2>(k));
      const bool reduces =
          kind == mesh::CollectiveKind::kAllReduce || kind == mesh::CollectiveKind::kReduceScatter;
      const std::string what = pg.size() > pw.size()   ? "extra"
                               : pg.size() < pw.size() ? "missing"
                                                       : "different payload";
      first = fmt::format(
          "step {}, rank {}, group {}: {}{} of {}: expected {}, ran {} ({})", std::get<0>(k) + 1,
          rc.rank, std::get<1>(k), mesh::collective_name(kind),
          reduces ? fmt::format("({})",
                                mesh::reduce_op_name(static_cast<mesh::ReduceOp>(std::get<3>(k))))
                  : std::string(),
          std::get<4>(k), payload_text(pw), payload_text(pg), what);
      ev.first_diverging_step = std::get<0>(k) + 1;
      ev.tensor = std::get<4>(k);
      ev.metric = "collectives";
      ev.expected = static_cast<double>(pw.size());
      ev.actual = static_cast<double>(pg.size());
    }
  }
  if (first.empty()) {
    r.message = fmt::format(
        "{} parameter collectives over {} ranks and {} steps as the sharding plan expects",
        expected, ranks.size(), steps.size());
    return r;
  }
  r.verdict = reports::Verdict::kFail;
  r.message = fmt::format("{}; {} collectives differ from the sharding plan's", first, differing);
  r.evidence = ev;
  return r;
}

reports::CheckResult check_allgather_parity(const std::vector<engine::AllGatherParity>& records) {
  reports::CheckResult r;
  r.name = "allgather_parity";
  r.kind = "allgather_parity";
  if (records.empty()) {
    r.verdict = reports::Verdict::kFail;
    r.message =
        "no FP8 all-gathered weight was compared: the run gathered no weight in FP8 "
        "(fsdp.fp8_all_gather with a delayed, current, mxfp8 or nvfp4 recipe)";
    return r;
  }
  const engine::AllGatherParity* first = nullptr;
  int64_t bad = 0, bytes = 0;
  std::set<int64_t> bad_steps;
  for (const engine::AllGatherParity& p : records) {
    bytes += p.bytes;
    if (p.mismatched_bytes == 0) continue;
    ++bad;
    bad_steps.insert(p.step);
    if (first == nullptr) first = &p;
  }
  std::set<int64_t> steps;
  for (const engine::AllGatherParity& p : records) steps.insert(p.step);
  if (first == nullptr) {
    r.message = fmt::format(
        "{} FP8 all-gathered weights over {} steps bitwise equal to quantizing the gathered "
        "weight ({} bytes compared)",
        records.size(), steps.size(), bytes);
    return r;
  }
  r.verdict = reports::Verdict::kFail;
  r.message = fmt::format(
      "step {}, {}: {} of {} bytes differ from quantizing the gathered weight (scale_inv {:.9g} "
      "vs reference {:.9g}, max abs error {:.3g}); {} of {} gathered weights mismatch",
      first->step + 1, first->tensor, first->mismatched_bytes, first->bytes, first->scale_inv,
      first->reference_scale_inv, first->max_abs_error, bad, records.size());
  reports::Evidence ev;
  ev.first_diverging_step = first->step + 1;
  ev.metric = "scale_inv";
  ev.tensor = first->tensor;
  ev.actual = first->scale_inv;
  ev.expected = first->reference_scale_inv;
  ev.max_abs_err = first->max_abs_error;
  ev.failing_steps = static_cast<int64_t>(bad_steps.size());
  r.evidence = ev;
  return r;
}

}  // namespace meshproof::harness
