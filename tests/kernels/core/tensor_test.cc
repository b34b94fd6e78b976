#include "kernels/core/tensor.h"

#include <gtest/gtest.h>

#include <thread>

#include "kernels/core/copy_plan.h"

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

// Shapes hold their dimensions inline (copies never allocate): up to kMaxRank of them, more is an
// input error (a checkpoint or tensor file can name any rank); equality is rank and extents, not
// the unused slots.
TEST(TensorTest, ShapeHoldsUpToMaxRankDimensions) {
  const std::vector<int64_t> eight = {1, 2, 3, 4, 5, 6, 7, 8};
  const Shape s(eight);
  EXPECT_EQ(s.rank(), Shape::kMaxRank);
  EXPECT_EQ(s.numel().value, 40320);
  EXPECT_EQ(std::vector<int64_t>(s.dims().begin(), s.dims().end()), eight);
  std::vector<int64_t> nine = eight;
  nine.push_back(9);
  try {
    const Shape too_many(nine);
    ADD_FAILURE() << "a rank-9 shape was accepted: " << too_many.str();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("at most 8 dimensions, got 9"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)s[8], Error);
  EXPECT_THROW((void)s[-9], Error);
  const Shape a{4, 3}, b = Shape{4, 3, 5}.with_dim(2, 7);
  EXPECT_EQ(b, (Shape{4, 3, 7}));
  EXPECT_NE(a, (Shape{4, 3, 0}));  // a zero extent is not an absent dimension
  EXPECT_EQ(Shape{}, Shape(std::vector<int64_t>{}));
  EXPECT_EQ(Shape{}.numel().value, 1);
  EXPECT_THROW((void)a.with_dim(2, 1), Error);
}

TEST(TensorTest, FromVectorAndSliceRowsShareStorage) {
  Tensor t = Tensor::from_vector<float>(Shape{3, 2}, {0, 1, 2, 3, 4, 5});
  Tensor rows = t.slice_rows(1, 3);
  EXPECT_EQ(rows.shape(), (Shape{2, 2}));
  EXPECT_EQ(rows.to_vector<float>(), (std::vector<float>{2, 3, 4, 5}));
  rows.data<float>()[0] = 42.0f;
  EXPECT_EQ(t.data<float>()[2], 42.0f);
}

// on(device): the tensor itself (shared storage, no copy) when it is there already; the device
// case (a copy) runs in the gpu suites, whose ops move tensors with it.
TEST(TensorTest, OnItsOwnDeviceSharesStorage) {
  Tensor t = Tensor::from_vector<float>(Shape{2, 2}, {1, 2, 3, 4});
  Tensor same = t.on(Device::cpu());
  EXPECT_EQ(same.raw_data(), t.raw_data());
  EXPECT_EQ(same.shape(), t.shape());
  Tensor copy = t.to(Device::cpu());
  EXPECT_NE(copy.raw_data(), t.raw_data());
  EXPECT_EQ(copy.to_vector<float>(), t.to_vector<float>());
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

// The copy counter (kernels/core/runtime.h CopyCounter, counted in kernels::copy_bytes): a copy
// with exactly one host side adds its bytes to its direction in the process's counter and the
// current rank context's; host-host and device-device copies and empty copies add nothing. The
// counting itself (detail::count_copy) is exercised with device descriptors, as a build without a
// GPU can.
TEST(CopyCounterTest, CountsHostDeviceBytesPerDirectionGloballyAndPerRank) {
  CopyCounter rank_counter;
  const CopyCounts global0 = global_copy_counter().counts();
  {
    ScopedRankContext ctx(RankContext{3, Device::cpu(), nullptr, nullptr, &rank_counter});
    detail::count_copy(Device::cuda(0), Device::cpu(), Bytes(100));   // host -> device
    detail::count_copy(Device::cpu(), Device::cuda(1), Bytes(7));     // device -> host
    detail::count_copy(Device::cuda(0), Device::cuda(0), Bytes(50));  // on the device
    detail::count_copy(Device::cpu(), Device::cpu(), Bytes(60));      // on the host
    detail::count_copy(Device::cuda(0), Device::cpu(), Bytes(0));     // nothing moved
  }
  const CopyCounts r = rank_counter.counts();
  EXPECT_EQ(r.host_to_device, 100);
  EXPECT_EQ(r.device_to_host, 7);
  EXPECT_EQ(r.copies, 2);
  EXPECT_EQ(r.total(), 107);
  // 100 bytes is bulk; 7 bytes (<= kScalarCopyBytes) is a scalar.
  EXPECT_EQ(r.bulk_host_to_device, 100);
  EXPECT_EQ(r.bulk_device_to_host, 0);
  EXPECT_EQ(r.bulk_copies, 1);
  EXPECT_EQ((r - r).total(), 0);
  const CopyCounts g = global_copy_counter().counts();
  EXPECT_EQ(g.host_to_device - global0.host_to_device, 100);
  EXPECT_EQ(g.device_to_host - global0.device_to_host, 7);
  EXPECT_EQ(g.copies - global0.copies, 2);
  // Without a rank counter only the global counter moves.
  detail::count_copy(Device::cpu(), Device::cuda(0), Bytes(5));
  EXPECT_EQ(global_copy_counter().counts().device_to_host - g.device_to_host, 5);
  EXPECT_EQ(rank_counter.counts().device_to_host, 7);
  rank_counter.reset();
  EXPECT_EQ(rank_counter.counts().total(), 0);
  EXPECT_EQ(rank_counter.counts().copies, 0);
  // The scalar bound is inclusive: 8 bytes (a double) is a scalar, 9 bytes is bulk.
  {
    ScopedRankContext ctx(RankContext{3, Device::cpu(), nullptr, nullptr, &rank_counter});
    detail::count_copy(Device::cpu(), Device::cuda(0), Bytes(kScalarCopyBytes));
    detail::count_copy(Device::cpu(), Device::cuda(0), Bytes(kScalarCopyBytes + 1));
  }
  EXPECT_EQ(rank_counter.counts().device_to_host, 2 * kScalarCopyBytes + 1);
  EXPECT_EQ(rank_counter.counts().bulk_device_to_host, kScalarCopyBytes + 1);
  EXPECT_EQ(rank_counter.counts().bulk_copies, 1);
}

// Host tensors copy through copy_bytes, Tensor::to, copy_from, copy_bytes_2d, to_host_batched
// and copy_batched without counting anything (the CPU backend crosses no PCIe).
TEST(CopyCounterTest, HostCopiesAreNotCounted) {
  CopyCounter rank_counter;
  ScopedRankContext ctx(RankContext{0, Device::cpu(), nullptr, nullptr, &rank_counter});
  Tensor a = Tensor::from_vector<float>(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor b = a.to(Device::cpu());
  b.copy_from(a);
  const std::vector<Tensor> hosts = to_host_batched({a, b});
  Tensor c = Tensor::zeros(Shape{2, 3}, DType::kFloat32, Device::cpu());
  copy_batched({&c}, {a});
  EXPECT_EQ(rank_counter.counts().copies, 0);
  EXPECT_EQ(rank_counter.counts().total(), 0);
  EXPECT_EQ(c.to_vector<float>(), a.to_vector<float>());
  // Host tensors are returned as they are (no copy at all).
  EXPECT_EQ(hosts[0].raw_data(), a.raw_data());
  EXPECT_EQ(hosts[1].raw_data(), b.raw_data());
}

// copy_bytes_2d: rows of `width` bytes between pitched buffers (here: columns 1..2 of a [3, 4]
// float matrix into a dense [3, 2] one), and a pitch below the width is an error.
TEST(CopyBytes2dTest, CopiesPitchedRowsAndRejectsShortPitches) {
  const Tensor src =
      Tensor::from_vector<float>(Shape{3, 4}, {0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23});
  Tensor dst = Tensor::zeros(Shape{3, 2}, DType::kFloat32, Device::cpu());
  copy_bytes_2d(dst.raw_data(), Device::cpu(), 8, src.data<float>() + 1, Device::cpu(), 16, 8, 3);
  EXPECT_EQ(dst.to_vector<float>(), (std::vector<float>{1, 2, 11, 12, 21, 22}));
  EXPECT_THROW(
      copy_bytes_2d(dst.raw_data(), Device::cpu(), 4, src.raw_data(), Device::cpu(), 16, 8, 3),
      Error);
}

// The batched transfers' packing (kernels/core/copy_plan.h): every tensor, empty ones included,
// gets its own span in list order, starting on a 256-byte boundary, not overlapping the next one,
// and the buffer holds them all; a negative size is an error naming its position.
TEST(PackPlanTest, EveryTensorGetsItsOwnAlignedSpanInOrder) {
  const std::vector<int64_t> sizes = {0, 1, 255, 256, 257, 1000, 0, 4096};
  const PackPlan plan = pack_plan(sizes);
  ASSERT_EQ(plan.offsets.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(plan.offsets[i] % kPackAlignment, 0) << i;
    const int64_t end = plan.offsets[i] + sizes[i];
    const int64_t next = i + 1 < sizes.size() ? plan.offsets[i + 1] : plan.total;
    EXPECT_LE(end, next) << i;
    if (i > 0) {
      EXPECT_LE(plan.offsets[i - 1], plan.offsets[i]) << i;
    }
  }
  // 0, 256, 256, 256, 512, 1024, 0, 4096 bytes after rounding.
  EXPECT_EQ(plan.offsets, (std::vector<int64_t>{0, 0, 256, 512, 768, 1280, 2304, 2304}));
  EXPECT_EQ(plan.total, 6400);
  EXPECT_EQ(pack_plan({}).total, 0);
  try {
    pack_plan({8, -1});
    ADD_FAILURE() << "a negative size was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("negative size -1 at position 1"), std::string::npos)
        << e.what();
  }
}

TEST(CopyBatchedTest, RejectsMismatchedPairs) {
  Tensor a = Tensor::zeros(Shape{4}, DType::kFloat32, Device::cpu());
  const Tensor b = Tensor::zeros(Shape{3}, DType::kFloat32, Device::cpu());
  EXPECT_THROW(copy_batched({&a}, {b}), Error);
  EXPECT_THROW(copy_batched({&a}, {}), Error);
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
