// Device memory outside the tracker in the per-rank memory figures (kernels/core/device_reserve.h):
// the arithmetic of RankMemory (reserves summed, added to the tracker's peak), the JSON keys
// (present only when a rank has reserves, so CPU reports are unchanged) and the Markdown line.
#include <gtest/gtest.h>

#include "reports/record/run_record.h"
#include "reports/writers/report_writers.h"
#include "sample_record.h"

namespace meshproof::reports {
namespace {

TEST(MemoryReserves, TotalsAreThePeakPlusEveryReserve) {
  RankMemory m;
  m.peak_bytes = 1000;
  EXPECT_EQ(m.device_reserved_bytes(), 0);
  EXPECT_EQ(m.device_total_bytes(), 1000);
  m.device_reserves = {{"cublaslt", 32}, {"cuda_pool", 400}, {"nccl", 7}};
  EXPECT_EQ(m.device_reserved_bytes(), 439);
  EXPECT_EQ(m.device_total_bytes(), 1439);
}

TEST(MemoryReserves, JsonAndMarkdownOnlyWhereARankHasReserves) {
  RunRecord r = testing::sample_record();
  ASSERT_FALSE(r.scenarios.empty());
  ASSERT_GE(r.scenarios[0].memory.size(), 2u);
  const nlohmann::json before = to_json(r);
  for (const nlohmann::json& m : before["scenarios"][0]["memory"]) {
    EXPECT_FALSE(m.contains("device_reserves"));
    EXPECT_FALSE(m.contains("device_total_bytes"));
  }
  EXPECT_EQ(render_markdown(r).find("device: peak"), std::string::npos);

  RankMemory& m0 = r.scenarios[0].memory[0];
  m0.device_reserves = {{"cuda_pool", 3 << 20}, {"nccl", 1 << 20}};
  const nlohmann::json j = to_json(r)["scenarios"][0]["memory"];
  EXPECT_EQ(j[0]["device_reserves"]["cuda_pool"].get<int64_t>(), 3 << 20);
  EXPECT_EQ(j[0]["device_reserves"]["nccl"].get<int64_t>(), 1 << 20);
  EXPECT_EQ(j[0]["device_reserved_bytes"].get<int64_t>(), 4 << 20);
  EXPECT_EQ(j[0]["device_total_bytes"].get<int64_t>(), m0.peak_bytes + (4 << 20));
  EXPECT_FALSE(j[1].contains("device_reserves"));
  const std::string md = render_markdown(r);
  const std::string line = "rank 0 device: peak ";
  const size_t at = md.find(line);
  ASSERT_NE(at, std::string::npos) << md;
  const std::string rest = md.substr(at, md.find('\n', at) - at);
  EXPECT_NE(rest.find("+ reserves 4.0 MiB (cuda_pool 3.0 MiB, nccl 1.0 MiB)"), std::string::npos)
      << rest;
}

}  // namespace
}  // namespace meshproof::reports
