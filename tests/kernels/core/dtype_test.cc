#include "kernels/core/dtype.h"

#include <gtest/gtest.h>

#include "kernels/core/error.h"

namespace meshproof::kernels {
namespace {

TEST(DTypeTest, NamesRoundTrip) {
  for (DType t :
       {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16, DType::kE4M3,
        DType::kE5M2, DType::kE8M0, DType::kE2M1, DType::kInt32, DType::kInt64, DType::kUInt8}) {
    EXPECT_EQ(parse_dtype(dtype_name(t), "test"), t);
  }
}

TEST(DTypeTest, UnknownNameIsAnInputErrorNamingTheField) {
  try {
    parse_dtype("fp9", "/rowwise/data dtype attribute");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(e.message().find("/rowwise/data dtype attribute"), std::string::npos);
    EXPECT_NE(e.message().find("'fp9'"), std::string::npos);
  }
}

TEST(DTypeTest, StorageBytesPacksFp4) {
  EXPECT_EQ(storage_bytes(DType::kE2M1, Elements(7)).value, 4);
  EXPECT_EQ(storage_bytes(DType::kE2M1, Elements(8)).value, 4);
  EXPECT_EQ(storage_bytes(DType::kBFloat16, Elements(5)).value, 10);
  EXPECT_EQ(storage_bytes(DType::kE4M3, Elements(5)).value, 5);
  EXPECT_TRUE(is_fp8(DType::kE5M2));
  EXPECT_FALSE(is_fp8(DType::kE8M0));
}

}  // namespace
}  // namespace meshproof::kernels
