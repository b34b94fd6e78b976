#include "kernels/tensor.h"

#include <gtest/gtest.h>

#include <thread>

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

// The per-thread host block cache (docs/design.md section 21): a freed block comes back for the
// next tensor of the same (64-byte rounded) size on the same thread, zeros() still zeroes it, the
// tracker counts tensors (not cached blocks), a block above the size limit and blocks beyond the
// per-thread byte limit go back to malloc, and another thread has its own cache.
TEST(TensorTest, HostBlockCacheReusesFreedBlocksPerThread) {
  const detail::HostBlockCacheStats s0 = detail::host_block_cache_stats();
  if (!s0.enabled) GTEST_SKIP() << "host block cache compiled out (AddressSanitizer build)";
  MemoryTracker tracker;
  ScopedRankContext ctx(RankContext{1, Device::cpu(), nullptr, &tracker});
  void* first = nullptr;
  {
    Tensor a = Tensor::empty(Shape{1000}, DType::kFloat32);  // 4000 bytes -> a 4032-byte block
    first = a.raw_data();
    a.data<float>()[7] = 3.0f;
  }
  EXPECT_EQ(tracker.current(DeviceType::kCpu).value, 0);
  const int64_t cached = detail::host_block_cache_stats().cached_bytes;
  EXPECT_GE(cached, 4032);
  {
    Tensor b = Tensor::zeros(Shape{1007}, DType::kFloat32);  // 4028 bytes: the same block size
    EXPECT_EQ(b.raw_data(), first);
    EXPECT_EQ(b.data<float>()[7], 0.0f);
    EXPECT_EQ(tracker.current(DeviceType::kCpu).value, 4028);
    EXPECT_EQ(detail::host_block_cache_stats().cached_bytes, cached - 4032);
    Tensor c = Tensor::empty(Shape{2000}, DType::kFloat32);  // another size: a new block
    EXPECT_NE(c.raw_data(), first);
  }
  EXPECT_EQ(tracker.peak(DeviceType::kCpu).value, 4028 + 8000);
  // Above the block limit: never cached.
  const int64_t before_big = detail::host_block_cache_stats().cached_bytes;
  { Tensor big = Tensor::empty(Shape{s0.max_block + 64}, DType::kUInt8); }
  EXPECT_EQ(detail::host_block_cache_stats().cached_bytes, before_big);
  // Many blocks freed at once: the cache keeps at most max_cached bytes.
  {
    std::vector<Tensor> many;
    for (int i = 0; i < 3 * s0.max_cached / s0.max_block + 1; ++i)
      many.push_back(Tensor::empty(Shape{s0.max_block}, DType::kUInt8));
  }
  EXPECT_LE(detail::host_block_cache_stats().cached_bytes, s0.max_cached);
  EXPECT_EQ(tracker.current(DeviceType::kCpu).value, 0);
  // Another thread (another virtual rank) does not take this thread's cached block: it gets a
  // fresh one while `first` stays cached here.
  void* other = nullptr;
  std::thread([&] { other = Tensor::empty(Shape{1000}, DType::kFloat32).raw_data(); }).join();
  EXPECT_NE(other, first);
  Tensor again = Tensor::empty(Shape{1000}, DType::kFloat32);
  EXPECT_EQ(again.raw_data(), first);
}

}  // namespace
}  // namespace meshproof::kernels
