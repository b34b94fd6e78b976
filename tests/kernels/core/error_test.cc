#include "kernels/core/error.h"

#include <gtest/gtest.h>

namespace meshproof::kernels {
namespace {

TEST(ErrorTest, CheckThrowsWithFileLineExpressionAndMessage) {
  const int rows = 3;
  try {
    MP_CHECK(rows % 2 == 0, "rows must be even, got {}", rows);
    FAIL() << "MP_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kRuntime);
    EXPECT_NE(e.file().find("error_test.cc"), std::string::npos);
    EXPECT_GT(e.line(), 0);
    EXPECT_EQ(e.expression(), "rows % 2 == 0");
    EXPECT_EQ(e.message(), "rows must be even, got 3");
    const std::string what = e.what();
    EXPECT_NE(what.find("error_test.cc:"), std::string::npos) << what;
    EXPECT_NE(what.find("check 'rows % 2 == 0' failed: rows must be even, got 3"),
              std::string::npos)
        << what;
  }
}

TEST(ErrorTest, InputCheckCarriesInputKind) {
  EXPECT_THROW(
      {
        try {
          MP_CHECK_INPUT(false, "scenario.yaml:3:5: mesh.tp: expected an integer");
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::kInput);
          EXPECT_EQ(e.message(), "scenario.yaml:3:5: mesh.tp: expected an integer");
          throw;
        }
      },
      Error);
}

TEST(ErrorTest, PassingCheckDoesNotEvaluateMessage) {
  int evaluated = 0;
  auto count = [&] { return ++evaluated; };
  MP_CHECK(true, "never formatted {}", count());
  EXPECT_EQ(evaluated, 0);
}

}  // namespace
}  // namespace meshproof::kernels
