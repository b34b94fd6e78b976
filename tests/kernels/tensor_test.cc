#include "kernels/tensor.h"

#include <gtest/gtest.h>

namespace meshproof::kernels {
namespace {

TEST(TensorTest, ShapeQueries) {
  Shape s{4, 3, 32};
  EXPECT_EQ(s.rank(), 3);
  EXPECT_EQ(s.numel().value, 384);
  EXPECT_EQ(s.leading(), 12);
  EXPECT_EQ(s.last(), 32);
  EXPECT_EQ(s[-1], 32);
  EXPECT_EQ(s.str(), "[4, 3, 32]");
}

TEST(TensorTest, FromVectorAndSliceRowsShareStorage) {
  Tensor t = Tensor::from_vector<float>(Shape{3, 2}, {0, 1, 2, 3, 4, 5});
  Tensor rows = t.slice_rows(1, 3);
  EXPECT_EQ(rows.shape(), (Shape{2, 2}));
  EXPECT_EQ(rows.to_vector<float>(), (std::vector<float>{2, 3, 4, 5}));
  rows.data<float>()[0] = 42.0f;
  EXPECT_EQ(t.data<float>()[2], 42.0f);
}

TEST(TensorTest, TypedAccessChecksDType) {
  Tensor t = Tensor::zeros(Shape{2}, DType::kBFloat16, Device::cpu());
  EXPECT_THROW(t.data<float>(), Error);
  EXPECT_EQ(t.nbytes().value, 4);
}

TEST(TensorTest, MemoryIsAccountedToTheRanksTracker) {
  MemoryTracker tracker;
  {
    ScopedRankContext ctx(RankContext{1, Device::cpu(), nullptr, &tracker});
    Tensor a = Tensor::empty(Shape{256}, DType::kFloat32);
    EXPECT_EQ(tracker.current(DeviceType::kCpu).value, 1024);
    {
      Tensor b = Tensor::empty(Shape{128}, DType::kFloat32);
      EXPECT_EQ(tracker.current(DeviceType::kCpu).value, 1536);
    }
    EXPECT_EQ(tracker.current(DeviceType::kCpu).value, 1024);
  }
  EXPECT_EQ(tracker.current(DeviceType::kCpu).value, 0);
  EXPECT_EQ(tracker.peak(DeviceType::kCpu).value, 1536);
}

TEST(TensorTest, ViewRejectsWrongElementCount) {
  Tensor t = Tensor::zeros(Shape{2, 3}, DType::kFloat32, Device::cpu());
  EXPECT_EQ(t.view(Shape{3, 2}).shape(), (Shape{3, 2}));
  EXPECT_THROW(t.view(Shape{4, 2}), Error);
}

}  // namespace
}  // namespace meshproof::kernels
