// The allgather_parity check (harness/checks/checks.h check_allgather_parity): nothing compared is
// not a pass; a failure names the first step and tensor, its bytes, scales and error.
#include <gtest/gtest.h>

#include <filesystem>

#include "harness/checks/checks.h"
#include "runner_test_builders.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using reports::Verdict;
using namespace test;

TEST(AllGatherParityCheck, PassesOnlyWithRecordsAndNoMismatch) {
  auto r = check_allgather_parity({});
  EXPECT_EQ(r.verdict, Verdict::kFail);  // nothing compared is not a pass
  EXPECT_NE(r.message.find("no FP8 all-gathered weight was compared"), std::string::npos)
      << r.message;

  r = check_allgather_parity({parity_record(0, "layers.0.attn.qkv.weight", 0),
                              parity_record(0, "layers.0.mlp.fc1.weight", 0),
                              parity_record(1, "layers.0.attn.qkv.weight", 0)});
  EXPECT_EQ(r.verdict, Verdict::kPass) << r.message;
  EXPECT_EQ(r.kind, "allgather_parity");
  EXPECT_NE(r.message.find("3 FP8 all-gathered weights over 2 steps"), std::string::npos)
      << r.message;
  EXPECT_NE(r.message.find("590016 bytes compared"), std::string::npos) << r.message;
}

TEST(AllGatherParityCheck, FailureNamesFirstStepTensorBytesScalesAndError) {
  const auto r = check_allgather_parity({parity_record(0, "layers.0.attn.qkv.weight", 0),
                                         parity_record(1, "layers.1.mlp.fc2.weight", 71022),
                                         parity_record(2, "layers.0.attn.qkv.weight", 5)});
  ASSERT_EQ(r.verdict, Verdict::kFail);
  // Engine steps are 0-based; reports count from 1.
  EXPECT_NE(r.message.find("step 2, layers.1.mlp.fc2.weight: 71022 of 196672 bytes differ"),
            std::string::npos)
      << r.message;
  EXPECT_NE(r.message.find("scale_inv 0.000168936589 vs reference 0.000183105469"),
            std::string::npos)
      << r.message;
  EXPECT_NE(r.message.find("max abs error 0.0175"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("2 of 3 gathered weights mismatch"), std::string::npos) << r.message;
  ASSERT_TRUE(r.evidence.has_value());
  EXPECT_EQ(r.evidence->first_diverging_step, 2);
  EXPECT_EQ(r.evidence->tensor, "layers.1.mlp.fc2.weight");
  EXPECT_EQ(r.evidence->metric, "scale_inv");
  EXPECT_EQ(r.evidence->actual, 0.000168936589);
  EXPECT_EQ(r.evidence->expected, 0.000183105469);
  EXPECT_EQ(r.evidence->max_abs_err, 0.0175);
  EXPECT_EQ(r.evidence->failing_steps, 2);
}

}  // namespace
}  // namespace meshproof::harness
