#include "worker/engine/support/memory_tracker.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>

namespace shardtrain {
namespace {

TEST(MemoryTrackerTest, CountsExactCpuTensorBytes) {
  MemoryTracker& tracker = MemoryTracker::Get();
  const torch::Device cpu(torch::kCPU);
  const int64_t before = tracker.Snapshot(cpu).allocated_bytes;
  tracker.ResetPeak(cpu);
  {
    torch::Tensor t = torch::empty({1 << 18}, torch::kFloat32);  // 1 MiB
    EXPECT_EQ(tracker.Snapshot(cpu).allocated_bytes - before, 1 << 20);
    torch::Tensor u = torch::empty({1 << 17}, torch::kFloat64);  // 1 MiB
    EXPECT_EQ(tracker.Snapshot(cpu).allocated_bytes - before, 2 << 20);
  }
  const MemorySnapshot after = tracker.Snapshot(cpu);
  EXPECT_EQ(after.allocated_bytes, before);
  EXPECT_EQ(after.peak_bytes - before, 2 << 20);
  EXPECT_EQ(after.reserved_bytes, after.allocated_bytes);

  tracker.ResetPeak(cpu);
  EXPECT_EQ(tracker.Snapshot(cpu).peak_bytes, before);
}

TEST(MemoryTrackerTest, ViewsDoNotAllocate) {
  MemoryTracker& tracker = MemoryTracker::Get();
  const torch::Device cpu(torch::kCPU);
  torch::Tensor t = torch::zeros({256, 256});
  const int64_t before = tracker.Snapshot(cpu).allocated_bytes;
  torch::Tensor view = t.narrow(0, 0, 128).view({-1});
  EXPECT_EQ(tracker.Snapshot(cpu).allocated_bytes, before);
}

// Some CPU kernels take scratch through the allocator's raw interface
// (bf16 matrix products among them), which needs a block's data to be its
// own context: counted like any tensor, freed by the raw deleter.
TEST(MemoryTrackerTest, RawAllocationsAreCountedAndFreed) {
  MemoryTracker& tracker = MemoryTracker::Get();
  const torch::Device cpu(torch::kCPU);
  const int64_t before = tracker.Snapshot(cpu).allocated_bytes;
  c10::Allocator* allocator = c10::GetCPUAllocator();
  void* block = allocator->raw_allocate(4096);
  ASSERT_NE(block, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block) % 64, 0u);
  EXPECT_EQ(tracker.Snapshot(cpu).allocated_bytes - before, 4096);
  allocator->raw_deallocate(block);
  EXPECT_EQ(tracker.Snapshot(cpu).allocated_bytes, before);

  // A bf16 product on CPU, which takes such scratch.
  const torch::Tensor a = torch::randn({64, 64}).to(torch::kBFloat16);
  const torch::Tensor b = torch::randn({64, 64}).to(torch::kBFloat16);
  const torch::Tensor c = at::addmm(a, a, b);
  EXPECT_EQ(c.scalar_type(), torch::kBFloat16);
}

}  // namespace
}  // namespace shardtrain
