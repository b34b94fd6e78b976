// The collectives check (harness/checks/checks.h check_collectives): the recorded parameter
// collectives of each rank and step equal the plan's as multisets; a failure names the first
// difference.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "harness/checks/checks.h"

namespace meshproof::harness {
namespace {

using kernels::DType;
using mesh::CollectiveCall;
using mesh::CollectiveKind;
using mesh::ReduceOp;
using reports::Verdict;

CollectiveCall call(int64_t step, CollectiveKind kind, const std::string& group, DType dtype,
                    int64_t bytes, const std::string& tensor, ReduceOp op = ReduceOp::kSum) {
  return {.step = step,
          .kind = kind,
          .op = op,
          .group = group,
          .dtype = dtype,
          .bytes = bytes,
          .tensor = tensor};
}

const std::vector<CollectiveCall> kPlan = {
    call(0, CollectiveKind::kAllGather, "dp_shard", DType::kE4M3, 4096, "layers.0.attn.qkv.weight"),
    call(0, CollectiveKind::kAllGather, "dp_shard", DType::kE4M3, 4096, "layers.0.attn.qkv.weight"),
    call(0, CollectiveKind::kReduceScatter, "dp_shard", DType::kFloat32, 16384,
         "layers.0.attn.qkv.weight", ReduceOp::kAvg),
    call(1, CollectiveKind::kAllGather, "dp_shard", DType::kE4M3, 4096, "layers.0.attn.qkv.weight"),
};

TEST(CollectivesCheck, EqualMultisetsPassInAnyOrder) {
  std::vector<CollectiveCall> ran(kPlan.rbegin(), kPlan.rend());
  const auto r = check_collectives(
      {{.rank = 0, .expected = kPlan, .ran = ran}, {.rank = 1, .expected = kPlan, .ran = kPlan}});
  EXPECT_EQ(r.verdict, Verdict::kPass) << r.message;
  EXPECT_EQ(r.kind, "collectives");
  EXPECT_EQ(r.message,
            "8 parameter collectives over 2 ranks and 2 steps as the sharding plan expects");
}

TEST(CollectivesCheck, NamesAnExtraCollective) {
  std::vector<CollectiveCall> ran = kPlan;
  ran.push_back(call(1, CollectiveKind::kAllReduce, "tp", DType::kFloat32, 4,
                     "layers.0.attn.qkv.weight", ReduceOp::kMax));
  const auto r = check_collectives({{.rank = 3, .expected = kPlan, .ran = ran}});
  EXPECT_EQ(r.verdict, Verdict::kFail);
  EXPECT_EQ(r.message,
            "step 2, rank 3, group tp: all_reduce(max) of layers.0.attn.qkv.weight: expected "
            "none, ran 1 (float32 4 B) (extra); 1 collectives differ from the sharding plan's");
  ASSERT_TRUE(r.evidence.has_value());
  EXPECT_EQ(r.evidence->tensor, "layers.0.attn.qkv.weight");
  EXPECT_EQ(r.evidence->first_diverging_step, 2);
}

TEST(CollectivesCheck, NamesAMissingCollectiveAndAnotherPayload) {
  std::vector<CollectiveCall> ran = {kPlan[0], kPlan[1], kPlan[3]};  // no reduce-scatter
  auto r = check_collectives({{.rank = 0, .expected = kPlan, .ran = ran}});
  EXPECT_EQ(r.verdict, Verdict::kFail);
  EXPECT_NE(r.message.find("step 1, rank 0, group dp_shard: reduce_scatter(avg) of "
                           "layers.0.attn.qkv.weight: expected 1 (float32 16384 B), ran none "
                           "(missing)"),
            std::string::npos)
      << r.message;
  // The same count of gathers, in bf16 bytes: another payload.
  ran = kPlan;
  ran[0].dtype = ran[1].dtype = DType::kBFloat16;
  ran[0].bytes = ran[1].bytes = 8192;
  r = check_collectives({{.rank = 0, .expected = kPlan, .ran = ran}});
  EXPECT_EQ(r.verdict, Verdict::kFail);
  EXPECT_EQ(r.message,
            "step 1, rank 0, group dp_shard: all_gather of layers.0.attn.qkv.weight: expected 2 "
            "(e4m3 4096 B, e4m3 4096 B), ran 2 (bfloat16 8192 B, bfloat16 8192 B) (different "
            "payload); 2 collectives differ from the sharding plan's");
}

}  // namespace
}  // namespace meshproof::harness
