#include "worker/engine/support/memory_tracker.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

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

}  // namespace
}  // namespace shardtrain
